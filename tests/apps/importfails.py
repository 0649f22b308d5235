"""A module that raises while it is imported (the supervisor tests' usage error)."""

raise RuntimeError("this module cannot be imported")
