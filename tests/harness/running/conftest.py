"""Fixtures the driver tests share."""

from virtual_time import virtual_time  # noqa: F401  (the fixture, for every test here)
