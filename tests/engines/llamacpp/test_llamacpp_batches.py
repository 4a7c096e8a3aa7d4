"""engine=llamacpp's batches, as llama.cpp needs them to be one ubatch: checked against a
stand-in for the runner that keeps llama.cpp's bookkeeping of each sequence's positions, so
it runs without llama-cpp-python.

With one KV stream per sequence, llama.cpp puts the tokens of several sequences in one ubatch
only while their ids run 0, 1, 2, ... in batch order (llama_batch_allocr::split_equal); any
other layout costs a whole extra pass over the weights per break. Sequences that finish out
of order, and new ones admitted into the ids they freed, made the backend's decode steps up
to 3.7x slower than llama.cpp's own loop (issue 34).
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engines.llamacpp.backend as backend_module
from engines.base import Failed, GenerationRequest, RequestEvent, Tokens
from engines.llamacpp.backend import LlamaCppBackend
from engines.llamacpp.config import LlamaCppConfig
from engines.llamacpp.runner import BatchToken
from engines.sampling_params import SamplingParams

VOCAB = 64


class FakeRunner:
    """llama.cpp's per-sequence position rule (a token's position is its sequence's next) and
    its stream copies, and greedy logits that depend on the sequence's last token."""

    def __init__(self, path: Path, num_seqs: int, seq_len: int | None, **_: Any) -> None:
        self.seq_len = seq_len or 256
        self.n_vocab = VOCAB
        self.n_ctx = num_seqs * self.seq_len
        self.next_pos: dict[int, int] = {}  # seq id -> the position its next token must have
        self.batches: list[list[BatchToken]] = []
        self.moves = 0
        self._last: list[int] = []

    def kv_bytes_per_token(self) -> int:
        return 1

    def describe(self) -> dict[str, Any]:
        return {}

    def decode(self, tokens: list[BatchToken]) -> None:
        for t in tokens:
            expected = self.next_pos.get(t.seq_id, 0)
            if t.pos != expected:  # llama_decode's -1: inconsistent sequence positions
                raise RuntimeError(f"seq {t.seq_id}: position {t.pos}, expected {expected}")
            self.next_pos[t.seq_id] = t.pos + 1
        self.batches.append(list(tokens))
        self._last = [t.token for t in tokens]

    def logits(self, row: int) -> np.ndarray:
        out = np.zeros(VOCAB, dtype=np.float32)
        out[(self._last[row] * 7 + 3) % VOCAB] = 1.0
        return out

    def free_seq(self, seq_id: int) -> None:
        self.next_pos.pop(seq_id, None)

    def move_seq(self, src: int, dst: int) -> None:
        assert dst not in self.next_pos, f"seq {dst} still holds cells"
        self.next_pos[dst] = self.next_pos.pop(src)
        self.moves += 1

    def close(self) -> None:
        pass


class FakeTokenizer:
    vocab_size = VOCAB

    class special:
        eos_ids = (0,)

    def encode_prompt(self, prompt: Any) -> list[int]:
        return list(prompt)


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> LlamaCppBackend:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(backend_module, "LlamaCppRunner", FakeRunner)
    monkeypatch.setattr(backend_module, "tokenizer_for_model", lambda *_: FakeTokenizer())
    config = LlamaCppConfig(
        model=str(model), max_num_seqs=4, max_model_len=256, max_num_batched_tokens=16
    )
    llama = LlamaCppBackend(config)
    llama.load()
    return llama


def drive(llama: LlamaCppBackend, requests: list[GenerationRequest]) -> list[list[Any]]:
    async def one(request: GenerationRequest) -> list[RequestEvent]:
        return [event async for event in llama.generate(request)]

    async def main() -> list[list[RequestEvent]]:
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def request(i: int, prompt_len: int, max_tokens: int) -> GenerationRequest:
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    return GenerationRequest(f"r{i}", [1 + (i + k) % 50 for k in range(prompt_len)], sampling)


def tokens_of(events: list[RequestEvent]) -> list[int]:
    return [t for e in events if isinstance(e, Tokens) for t in e.token_ids]


def test_every_batch_runs_its_sequence_ids_0_1_2_in_order(backend: LlamaCppBackend) -> None:
    # ten requests of different lengths through four slots: sequences finish out of order,
    # new ones take the ids they freed, prompts go in chunks beside decode tokens; then four
    # with nothing waiting behind them, the second ending first: a hole below two others
    lengths = [(5, 9), (12, 3), (3, 14), (20, 6), (7, 7), (9, 2), (4, 11), (15, 5), (6, 8), (2, 4)]
    for workload in (lengths, [(4, 12), (4, 2), (4, 10), (4, 11)]):
        results = drive(backend, [request(i, p, n) for i, (p, n) in enumerate(workload)])
        assert not [e for events in results for e in events if isinstance(e, Failed)]
    runner = backend.runner
    assert isinstance(runner, FakeRunner)
    for batch in runner.batches:
        ids = [t.seq_id for t in batch]
        runs = [ids[0]] + [b for a, b in itertools.pairwise(ids) if a != b]
        # each sequence's tokens together, and the sequences 0, 1, ..., k-1: one ubatch each
        assert runs == list(range(len(runs))), ids
    assert runner.moves > 0  # sequences did finish below others and were moved down


def test_moved_sequences_keep_their_tokens(backend: LlamaCppBackend) -> None:
    """The same requests one at a time give the same greedy tokens as four at once, where
    sequences are moved to lower ids mid-decode."""
    lengths = [(5, 9), (12, 3), (3, 14), (20, 6), (7, 7), (9, 2)]
    together = drive(backend, [request(i, p, n) for i, (p, n) in enumerate(lengths)])
    alone = [drive(backend, [request(i, p, n)])[0] for i, (p, n) in enumerate(lengths)]
    assert [tokens_of(e) for e in together] == [tokens_of(e) for e in alone]


def test_a_failed_decode_fails_its_requests_and_the_next_ones_run(
    backend: LlamaCppBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = backend.runner
    assert isinstance(runner, FakeRunner)
    decode = runner.decode

    def fail_once(tokens: list[BatchToken]) -> None:
        monkeypatch.setattr(runner, "decode", decode)
        raise RuntimeError("llama_decode returned -1")

    monkeypatch.setattr(runner, "decode", fail_once)
    failed = drive(backend, [request(i, 4, 3) for i in range(2)])
    assert all(isinstance(events[-1], Failed) for events in failed)
    assert "llama.cpp: RuntimeError: llama_decode returned -1" in failed[0][-1].error
    later = drive(backend, [request(i, 4, 3) for i in range(2)])
    assert [len(tokens_of(events)) for events in later] == [3, 3]
    assert runner.next_pos == {}  # the failed sequences' cells were freed
