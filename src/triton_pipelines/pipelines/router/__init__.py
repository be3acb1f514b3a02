"""The router: the Router, canary splits, payload parsing and the request handling service."""
