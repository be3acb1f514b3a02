"""`make rehearse` (python -m tools.rehearse): see __main__.py."""
