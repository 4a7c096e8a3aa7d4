"""Every built-in proposer, registered: import PROPOSERS from here."""

from engines.builtin.spec_decode import draft_model, ngram  # noqa: F401  (they register)
from engines.builtin.spec_decode.proposer import PROPOSERS

__all__ = ["PROPOSERS"]
