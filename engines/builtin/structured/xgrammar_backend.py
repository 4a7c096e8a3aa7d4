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
                # compact JSON (vLLM's disable_any_whitespace): whitespace between tokens
                # is where a small model loops until max_tokens
                return compiler.compile_json_schema(params.spec, any_whitespace=False)
            if kind == "json_object":  # an object, as OpenAI's json_object promises
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(params.spec)
            if kind == "choice":
                options = " | ".join(json.dumps(c) for c in json.loads(params.spec))
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
