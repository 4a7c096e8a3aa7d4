"""xgrammar (https://github.com/mlc-ai/xgrammar), vLLM's and SGLang's default: grammars
compiled against the vocabulary's token strings, a 32-bit-packed mask per row, applied in
place. Used rather than written: a correct grammar engine over byte-level BPE tokens is
xgrammar's whole job (the issue asked for it)."""

from __future__ import annotations

import json
import re
from typing import Any, cast

import torch

from engines.builtin.structured.backend import GrammarBackend, Matcher
from engines.structured_outputs import StructuredOutputsParams
from models.tokenizer import Tokenizer

#: JSON-schema keywords xgrammar 0.2 accepts but does not enforce (an output that finishes
#: may break them): refused rather than promised
UNENFORCED_KEYWORDS = frozenset(
    {
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "propertyNames",
        "patternProperties",
        "dependentRequired",
        "dependentSchemas",
        "unevaluatedProperties",
        "unevaluatedItems",
        "minProperties",
        "maxProperties",
    }
)


def _check_enforceable(schema: Any) -> None:
    """ValueError naming the first keyword (and where) xgrammar would not enforce, or a $ref
    outside the schema (nothing is fetched)."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{where}/{i}") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in UNENFORCED_KEYWORDS:
                raise ValueError(
                    f"the schema uses {key} (at {where or '/'}), which xgrammar does not "
                    "enforce; allowed: a schema without it"
                )
            if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
                raise ValueError(
                    f"the schema's $ref {str(value)[:80]!r} (at {where or '/'}) is outside it; "
                    "allowed: references into the schema (#/...), nothing is fetched"
                )
            if key not in ("enum", "const", "default", "examples"):  # data, not schemas
                stack.append((value, f"{where}/{key}"))


class XGrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token: int) -> bool:
        return bool(self._matcher.accept_token(token))

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def fork(self) -> Matcher:
        return XGrammarMatcher(self._matcher.fork())

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def forced_tokens(self) -> list[int]:
        return list(self._matcher.find_jump_forward_tokens())


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        try:
            import xgrammar
        except ImportError:
            raise ValueError(
                "engine.structured_output_backend: 'xgrammar' is not installed; allowed: none "
                "or auto (or `pip install xgrammar`, which the dev extra installs)"
            ) from None
        import transformers

        self._xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=stop_ids
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, params: StructuredOutputsParams) -> object:
        compiler, kind = self._compiler, params.kind
        try:
            if kind == "json":
                _check_enforceable(json.loads(params.spec))
                # compact JSON (vLLM's disable_any_whitespace): whitespace between tokens
                # is where a small model loops until max_tokens
                return compiler.compile_json_schema(params.spec, any_whitespace=False)
            if kind == "json_object":  # an object, as OpenAI's json_object promises
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(params.spec)
            if kind == "choice":
                # ensure_ascii=False: xgrammar reads a \ud83c escape as a lone surrogate
                options = " | ".join(
                    json.dumps(c, ensure_ascii=False) for c in json.loads(params.spec)
                )
                return compiler.compile_grammar(f"root ::= {options}")
            return compiler.compile_grammar(params.spec)
        except (RuntimeError, ValueError) as exc:  # xgrammar's errors: bad schema or syntax
            # its message without the C++ source position ("[14:02:50] /project/cpp/x.cc:94: ")
            first = str(exc).strip().splitlines()[0]
            raise ValueError(re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)[:300]) from None

    def matcher(self, compiled: object) -> Matcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(cast(Any, compiled)))

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        bitmask = bitmask.to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=rows
        )
