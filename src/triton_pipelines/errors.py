"""Errors that describe a bad request; adapters turn them into a per-request error response."""

# Every bad-input answer of our models starts with this. A direct client also gets the code
# (HTTP 400 / INVALID_ARGUMENT), but a BLS caller (the router) gets only the message (Triton 2.51
# passes a callee's error to a BLS caller as INTERNAL): the prefix is how it tells bad input apart.
INPUT_ERROR_PREFIX = "invalid input: "


class InputError(ValueError):
    """The request's input is invalid; the message names the input and the problem."""
