"""`engine=llamacpp`: llama.cpp in process, through llama-cpp-python's low-level API, on a GGUF
file (the same file the built-in engine dequantizes for model=smollm2-135m).

Scheduling is this module's, computing is llama.cpp's (engines/llamacpp/runner.py). Every step
is one `llama_decode` call: a decode token of each running sequence first, then prompt chunks
of newly admitted ones within `max_num_batched_tokens`, up to `max_num_seqs` sequences at once
(continuous batching, as llama.cpp's server slots do). Prompts are tokenized by the tokenizer
the built-in engine builds from the same file (models.gguf), so both see the same token ids.

The step loop is the stepping adapter's (engines/stepping.py): llama_decode runs in its worker
thread (ctypes releases the GIL while llama.cpp computes); between steps the event loop admits
arrivals, frees aborted sequences and hands out the step's events, whose timestamps are taken
in the worker as soon as a step's tokens are sampled.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engines.base import (
    Arrived,
    BackendCapabilities,
    Failed,
    Finished,
    GenerationRequest,
    PrefillChunk,
    RequestEvent,
    Scheduled,
    StepRecord,
    Tokenized,
    Tokens,
    check_prompt_length,
    now_ns,
    refuse_tools_and_adapters,
)
from engines.llamacpp.config import LlamaCppConfig
from engines.llamacpp.runner import BatchToken, LlamaCppRunner, check_gguf
from engines.sampling_params import LOGITS_FIELDS, SamplingParams
from engines.stepping import SteppedBackend
from models.gguf_quantize import derived_gguf
from models.tokenizer import Tokenizer, stream_step, tokenizer_for_model


@dataclass(eq=False)
class _Seq:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    detok: Any  # DetokenizerStream | None
    seed: int
    seq_id: int = -1  # llama.cpp's sequence id while it holds KV cells
    computed: int = 0  # prompt tokens in the KV cache
    output: list[int] = field(default_factory=list)
    sampler: Any = None  # llama.cpp's sampler chain (non-greedy only)
    scheduled: bool = False
    done: bool = False  # finished, failed or aborted


@dataclass
class _Planned:
    seq: _Seq
    num_tokens: int
    prefill: bool
    row: int | None  # the batch row whose logits sample the next token; None mid-prompt


class LlamaCppBackend(SteppedBackend):
    name = "llamacpp"
    # one worker: llama.cpp's context is not thread-safe, and steps run one at a time
    worker_name = "llamacpp-step"
    capabilities = BackendCapabilities(quality_probe="prompt_logits")

    def __init__(self, config: LlamaCppConfig) -> None:
        super().__init__()
        self.config = config  # checked when it was built
        self.runner: LlamaCppRunner | None = None
        self.tokenizer: Tokenizer | None = None
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        # a heap: a new sequence takes the lowest free id (see _compact)
        self._free_ids: list[int] = []
        self._step_number = 0
        self._seeds = np.random.default_rng(config.seed)

    @classmethod
    def from_config(cls, options: dict[str, Any]) -> LlamaCppBackend:
        return cls(LlamaCppConfig.from_dict(options))

    # ---- load ----------------------------------------------------------------------------

    def load(self) -> None:
        cfg = self.config
        source = check_gguf(cfg.model)
        path = derived_gguf(source, cfg.gguf_type) if cfg.gguf_type else source
        self.gguf_file = path
        threads = cfg.num_threads or torch.get_num_threads()
        self.runner = LlamaCppRunner(
            path,
            num_seqs=cfg.max_num_seqs,
            seq_len=cfg.max_model_len,
            batch_tokens=cfg.max_num_batched_tokens,
            threads=threads,
            threads_batch=cfg.num_threads_batch or threads,
            flash_attn=cfg.flash_attn,
        )
        self.max_model_len = self.runner.seq_len
        self.tokenizer = tokenizer_for_model(str(path), None)
        self.eos_ids = frozenset(self.tokenizer.special.eos_ids)
        self._free_ids = list(range(cfg.max_num_seqs))
        self._kv_per_token = self.runner.kv_bytes_per_token()

    def describe(self) -> dict[str, Any]:
        assert self.runner is not None, "load() first"
        cfg = self.config
        return {
            "backend": self.name,
            "model": cfg.model,  # the model group's file (the quality probe's reference)
            "gguf_type": cfg.gguf_type,
            "gguf_file": str(self.gguf_file),  # the file llama.cpp runs
            "device": "cpu",
            "max_num_seqs": cfg.max_num_seqs,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "flash_attn": cfg.flash_attn,
            "kv_cache_bytes": self.runner.n_ctx * self._kv_per_token,
            **self.runner.describe(),
            "torch_threads": torch.get_num_threads(),
        }

    # ---- requests ------------------------------------------------------------------------

    def _tokenize(self, request: GenerationRequest) -> list[int]:
        """The built-in engine's rules (LLMEngine.tokenize and check_request)."""
        assert self.tokenizer is not None and self.runner is not None
        ids = self.tokenizer.encode_prompt(request.prompt)
        check_prompt_length(len(ids), request.sampling.max_tokens, self.max_model_len)
        bad = [t for t in ids if not 0 <= t < self.runner.n_vocab]
        if bad:
            raise ValueError(
                f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {self.runner.n_vocab})"
            )
        return ids

    @staticmethod
    def _check_supported(sampling: SamplingParams) -> None:
        sampling.validate()
        if sampling.n != 1:
            raise ValueError(f"SamplingParams.n: {sampling.n} is invalid; allowed: 1")
        if sampling.use_beam_search:
            raise ValueError(
                "SamplingParams.use_beam_search: engine=llamacpp does not search beams; "
                "allowed: false"
            )
        unsupported = sampling.changed(LOGITS_FIELDS)
        if unsupported:
            raise ValueError(
                f"SamplingParams.{unsupported[0]}: engine=llamacpp does not apply it; allowed: "
                "its default (the built-in engine and inferlab serve do)"
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(sampling, name) is not None:
                raise ValueError(
                    f"SamplingParams.{name}: engine=llamacpp does not report log-probabilities; "
                    "allowed: null"
                )
        if sampling.stop:
            raise ValueError(
                "SamplingParams.stop: stop strings are not supported by engine=llamacpp; "
                "allowed: [] (stop_token_ids, EOS and max_tokens are)"
            )

    def _submit(self, request: GenerationRequest) -> list[RequestEvent]:
        assert self.runner is not None and self.tokenizer is not None, "load() first"
        arrival = now_ns()
        self._check_supported(request.sampling)
        refuse_tools_and_adapters(request, "llamacpp")
        ids = self._tokenize(request)
        tokenized = Tokenized(request.request_id, -1, now_ns(), len(ids))
        sampling = request.sampling
        detok = (
            self.tokenizer.new_stream(ids, sampling.skip_special_tokens)
            if sampling.detokenize
            else None
        )
        seed = sampling.seed if sampling.seed is not None else int(self._seeds.integers(2**32))
        self._waiting.append(_Seq(request.request_id, ids, sampling, detok, seed))
        return [Arrived(request.request_id, -1, arrival), tokenized]

    def _abort(self, request_id: str) -> None:
        for seq in (*self._waiting, *self._running):
            if seq.request_id == request_id:
                seq.done = True  # freed at the next step boundary

    # ---- the step (on the event loop; llama_decode in the adapter's worker) ---------------

    def _has_work(self) -> bool:
        return bool(self._running or self._waiting)

    async def _step(self) -> list[RequestEvent]:
        self._release([s for s in self._running if s.done])
        self._admit()  # into the lowest free ids first
        self._compact()
        if not self._running:
            return []  # what waited was aborted
        plan, tokens = self._plan()
        start = now_ns()
        try:
            sampled, forward_ns, end = await self._in_worker(self._execute, plan, tokens)
            events = self._after_step(plan, tokens, sampled, start, end, forward_ns)
        except Exception as exc:  # fail this step's sequences, keep serving the rest
            events = self._fail(plan, f"llama.cpp: {type(exc).__name__}: {exc}")
        self._step_number += 1
        return events

    def _fail(self, plan: list[_Planned], reason: str) -> list[RequestEvent]:
        failed = now_ns()
        events: list[RequestEvent] = []
        for item in plan:
            event = Failed(item.seq.request_id, self._step_number, failed, reason)
            self._end(item.seq, event, events)
        return events

    def _admit(self) -> None:
        while self._waiting and self._free_ids:
            seq = self._waiting.popleft()
            if seq.done:
                continue  # aborted while waiting
            seq.seq_id = heapq.heappop(self._free_ids)
            if not seq.sampling.greedy:
                assert self.runner is not None
                s = seq.sampling
                seq.sampler = self.runner.new_sampler(s.temperature, s.top_k, s.top_p, seq.seed)
            self._running.append(seq)

    def _plan(self) -> tuple[list[_Planned], list[BatchToken]]:
        """This step's batch: every decoding sequence's last token, then prompt chunks in
        admission order while the token budget lasts; laid out in sequence-id order.

        With one KV stream per sequence (kv_unified off), llama.cpp puts tokens of several
        sequences in one ubatch only while their ids run 0, 1, 2, ... in batch order
        (llama_batch_allocr::split_equal); each break in that run starts another ubatch, a
        whole pass over the weights. In admission order, a batch of 16 decode tokens whose ids
        had been handed out again in another order took up to 16 passes (measured: 3.7x the
        step time of llama.cpp's own loop). So the batch goes in id order, and _compact keeps
        the running ids 0..n-1."""
        budget = self.config.max_num_batched_tokens
        counts: dict[_Seq, int] = {}
        for seq in self._running:
            if seq.computed == len(seq.prompt):
                counts[seq] = 1
        budget -= len(counts)
        for seq in self._running:
            left = len(seq.prompt) - seq.computed
            if left == 0 or budget == 0:
                continue
            counts[seq] = min(left, budget)
            budget -= counts[seq]
        plan: list[_Planned] = []
        tokens: list[BatchToken] = []
        for seq in sorted(counts, key=lambda s: s.seq_id):
            n = counts[seq]
            if seq.computed == len(seq.prompt):
                pos = len(seq.prompt) + len(seq.output) - 1
                plan.append(_Planned(seq, 1, False, len(tokens)))
                tokens.append(BatchToken(seq.seq_id, seq.output[-1], pos, True))
                continue
            last = seq.computed + n == len(seq.prompt)  # its last row gives the first token
            end = seq.computed + n
            for pos in range(seq.computed, end):
                tokens.append(BatchToken(seq.seq_id, seq.prompt[pos], pos, last and pos == end - 1))
            plan.append(_Planned(seq, n, True, len(tokens) - 1 if last else None))
        return plan, tokens

    def _execute(
        self, plan: list[_Planned], tokens: list[BatchToken]
    ) -> tuple[dict[int, int], int, int]:
        """In the worker: one llama_decode, then a token for every row with logits. Returns
        the tokens by row, the decode's time and the moment the tokens existed."""
        runner = self.runner
        assert runner is not None and self.tokenizer is not None
        start = now_ns()
        runner.decode(tokens)
        forward_ns = now_ns() - start
        vocab = self.tokenizer.vocab_size
        sampled: dict[int, int] = {}
        for item in plan:
            if item.row is None:
                continue
            seq, logits = item.seq, runner.logits(item.row)
            # the built-in engine's rules: no id past the tokenizer's vocabulary, and no EOS
            # or stop token before min_tokens
            if vocab < runner.n_vocab:
                logits[vocab:] = -math.inf
            s = seq.sampling
            if not s.ignore_eos and len(seq.output) < s.min_tokens:
                banned = [t for t in (*self.eos_ids, *s.stop_token_ids) if t < runner.n_vocab]
                logits[banned] = -math.inf
            if seq.sampler is None:
                sampled[item.row] = int(np.argmax(logits))
            else:
                sampled[item.row] = runner.sample(seq.sampler, item.row)
        return sampled, forward_ns, now_ns()

    def _after_step(
        self,
        plan: list[_Planned],
        tokens: list[BatchToken],
        sampled: dict[int, int],
        start: int,
        end: int,
        forward_ns: int,
    ) -> list[RequestEvent]:
        step = self._step_number
        events: list[RequestEvent] = []
        prefill = [p for p in plan if p.prefill]
        # the step is reported before its tokens so a run never ends with its last step
        # unrecorded
        kv_read = sum(p.seq.computed + p.num_tokens + len(p.seq.output) for p in plan)
        self.emit_step(
            StepRecord(
                step=step,
                start_ns=start,
                end_ns=end,
                num_seqs=len(plan),
                num_prefill_seqs=len(prefill),
                num_decode_seqs=len(plan) - len(prefill),
                prefill_tokens=sum(p.num_tokens for p in prefill),
                decode_tokens=len(plan) - len(prefill),
                padding_tokens=0,
                num_waiting=sum(1 for s in self._waiting if not s.done),
                kv_bytes_reserved=self.runner.n_ctx * self._kv_per_token if self.runner else 0,
                kv_bytes_used=self._kv_per_token
                * sum(s.computed + len(s.output) for s in self._running),
                num_running=len(self._running),
                forward_ns=forward_ns,
                logits_tokens=len(sampled),
                attention_pairs=sum(t.pos + 1 for t in tokens),
                kv_tokens_read=kv_read,
                kv_tokens_written=len(tokens),
            )
        )
        for item in plan:
            seq = item.seq
            if seq.done:  # aborted during the step: freed at the next boundary
                continue
            if not seq.scheduled:
                seq.scheduled = True
                events.append(Scheduled(seq.request_id, step, start))
            if item.prefill:
                events.append(
                    PrefillChunk(seq.request_id, step, end, item.num_tokens, seq.computed)
                )
                seq.computed += item.num_tokens
            if item.row is None:
                continue
            token = sampled[item.row]
            seq.output.append(token)
            events.append(Tokens(seq.request_id, step, end, (token,), self._text(seq, token)))
            s, n = seq.sampling, len(seq.output)
            if n >= s.max_tokens:
                self._finish(seq, "length", end, step, events)
            elif (
                not s.ignore_eos
                and n >= s.min_tokens
                and (token in self.eos_ids or token in s.stop_token_ids)
            ):
                self._finish(seq, "stop", end, step, events)
        return events

    def _text(self, seq: _Seq, token: int) -> str:
        assert self.tokenizer is not None
        return stream_step(seq.detok, token, self.tokenizer.vocab_size)

    def _finish(
        self, seq: _Seq, reason: str, time: int, step: int, events: list[RequestEvent]
    ) -> None:
        self._end(
            seq,
            Finished(
                seq.request_id,
                step,
                time,
                reason,
                len(seq.prompt),
                len(seq.output),
                text=seq.detok.text if seq.detok else "",
            ),
            events,
        )

    def _end(self, seq: _Seq, event: RequestEvent, events: list[RequestEvent]) -> None:
        """The sequence's last event (unless it was aborted), and its KV cells freed."""
        if not seq.done:
            events.append(event)
        seq.done = True
        self._release([seq])

    def _release(self, seqs: list[_Seq]) -> None:
        """Free the KV cells and sampler of finished or aborted sequences (between steps)."""
        runner = self.runner
        for seq in seqs:
            if seq not in self._running:
                continue
            self._running.remove(seq)
            if runner is not None:
                runner.free_seq(seq.seq_id)
                if seq.sampler is not None:
                    runner.free_sampler(seq.sampler)
                    seq.sampler = None
            heapq.heappush(self._free_ids, seq.seq_id)
            seq.seq_id = -1

    def _compact(self) -> None:
        """Keep the running sequences' ids 0..n-1 (see _plan): the highest-numbered one moves
        into a free id below it, its KV with it (llama.cpp copies the stream's buffer at the
        next decode: max_model_len cells, a memcpy, against a whole extra pass over the
        weights in every later step). Between steps only, once every sequence's count of
        computed tokens says what its KV holds."""
        while self._running and self._free_ids:
            top = max(self._running, key=lambda s: s.seq_id)
            if self._free_ids[0] > top.seq_id:
                return
            low = heapq.heappop(self._free_ids)
            if self.runner is not None and (top.computed or top.output):
                self.runner.move_seq(top.seq_id, low)
            heapq.heappush(self._free_ids, top.seq_id)
            top.seq_id = low

    # ---- quality probe ---------------------------------------------------------------------

    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """float32 logits [len(prompt), vocab] at every position of every prompt, one prompt
        at a time in chunks of max_num_batched_tokens (the quality probe's input; see
        harness/measuring/quality.py). Call while no request runs."""
        runner = self.runner
        assert runner is not None, "load() first"
        if self._running:
            raise RuntimeError("prompt_logits: requests are running")
        seq_id, chunk = 0, self.config.max_num_batched_tokens
        out = []
        for prompt in prompts:
            if len(prompt) > self.max_model_len:
                raise ValueError(
                    f"prompt: {len(prompt)} tokens exceed max_model_len={self.max_model_len}"
                )
            rows = []
            try:
                for begin in range(0, len(prompt), chunk):
                    part = prompt[begin : begin + chunk]
                    runner.decode(
                        [BatchToken(seq_id, t, begin + i, True) for i, t in enumerate(part)]
                    )
                    rows += [torch.from_numpy(runner.logits(i).copy()) for i in range(len(part))]
            finally:
                runner.free_seq(seq_id)
            out.append(torch.stack(rows))
        return out

    def close(self) -> None:
        self._stop_stepping(wait_for_worker=True)  # no decode left in flight
        if self.runner is not None:
            self.runner.close()
            self.runner = None
