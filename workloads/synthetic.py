"""Synthetic workloads: N requests with fixed or uniformly ranged lengths, all at t = 0.

Prompts are either random token ids (exact lengths; drawn from the non-special part of the
tokenizer's vocabulary) or text: windows of a corpus file's tokens decoded back to text (the
engine re-tokenizes, so actual lengths may differ slightly and are recorded beside the request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import GenerationRequest
from engines.builtin.tokenizer import Tokenizer
from engines.sampling_params import SamplingParams
from workloads.lengths import parse_length, sample_lengths
from workloads.request import WorkloadRequest

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "engines/builtin/data/sonnets.txt"
PROMPT_KINDS = ("random_ids", "text")


@dataclass
class SyntheticWorkload:
    num_requests: int = 16
    input_len: Any = 128
    output_len: Any = 64
    prompt: str = "random_ids"
    corpus: str | None = None  # text file for prompt=text; default: the shipped sonnets
    seed: int = 0
    ignore_eos: bool = True  # benchmarks want exact output lengths
    temperature: float = 0.0
    id_prefix: str = "req"
    sampling: dict[str, Any] = field(default_factory=dict)  # extra SamplingParams fields

    def validate(self) -> SyntheticWorkload:
        if not isinstance(self.num_requests, int) or self.num_requests < 0:
            raise ValueError(f"workload.num_requests: {self.num_requests!r} is invalid; "
                             "allowed: an integer >= 0")
        if self.prompt not in PROMPT_KINDS:
            raise ValueError(f"workload.prompt: {self.prompt!r} is invalid; allowed: "
                             f"{'|'.join(PROMPT_KINDS)}")
        parse_length("input_len", self.input_len)
        parse_length("output_len", self.output_len)
        if self.corpus is not None and not Path(self.corpus).is_file():
            raise FileNotFoundError(f"workload.corpus: no file at {self.corpus}")
        return self

    def build(self, tokenizer: Tokenizer) -> list[WorkloadRequest]:
        self.validate()
        rng = np.random.default_rng(self.seed)
        n = self.num_requests
        input_lens = sample_lengths(parse_length("input_len", self.input_len), n, rng)
        output_lens = sample_lengths(parse_length("output_len", self.output_len), n, rng)
        corpus_ids = self._corpus_ids(tokenizer) if self.prompt == "text" else None
        # Random prompts avoid special ids, which would change what the prompt means.
        allowed = np.setdiff1d(np.arange(tokenizer.vocab_size), sorted(tokenizer.special_ids))
        requests = []
        for i in range(n):
            if corpus_ids is None:
                prompt: Any = rng.choice(allowed, size=input_lens[i]).tolist()
            else:
                start = int(rng.integers(0, max(1, len(corpus_ids) - input_lens[i])))
                prompt = tokenizer.decode(corpus_ids[start:start + input_lens[i]])
            sampling = SamplingParams(max_tokens=output_lens[i], temperature=self.temperature,
                                      ignore_eos=self.ignore_eos, **self.sampling)
            request = GenerationRequest(f"{self.id_prefix}-{i}", prompt, sampling)
            requests.append(WorkloadRequest(request, 0.0, input_lens[i]))
        return requests

    def _corpus_ids(self, tokenizer: Tokenizer) -> list[int]:
        text = Path(self.corpus or DEFAULT_CORPUS).read_text(encoding="utf-8")
        ids = tokenizer.encode(text, add_special_tokens=False)
        # Repeat a short corpus so the longest prompt still fits in one window.
        longest = parse_length("input_len", self.input_len)[1]
        while len(ids) < longest + 1:
            ids = ids + ids
        return ids
