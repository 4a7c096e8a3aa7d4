"""Every built-in proposer, registered: import PROPOSERS from here."""

# they register; ngram first (nothing else imports draft_model), so that the listed values
# (an unknown method's message, `inferlab list`) start with the default method
# isort: off
from engines.builtin.spec_decode import ngram  # noqa: F401
from engines.builtin.spec_decode import draft_model  # noqa: F401

# isort: on
from engines.builtin.spec_decode.proposer import PROPOSERS

__all__ = ["PROPOSERS"]
