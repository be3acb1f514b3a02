"""What the tests share: fakes, helpers, servers of their own (PostgreSQL), paths."""
