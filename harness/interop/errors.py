"""The one error the interop commands raise for bad input."""

from __future__ import annotations


class InteropError(ValueError):
    """A file that cannot be imported, or a folder that cannot be exported. The message is one
    line that names the file and what is wrong with it."""
