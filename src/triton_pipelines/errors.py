"""Errors that describe a bad request; adapters turn them into a per-request error response."""


class InputError(ValueError):
    """The request's input is invalid; the message names the input and the problem."""
