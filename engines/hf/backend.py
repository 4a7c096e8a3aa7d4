"""`engine=hf`: Hugging Face transformers in process, on the very same weights.

Two sub-modes, each what a transformers user would actually run:
- `generate`: static batching. Up to `max_num_seqs` waiting requests are left-padded into one
  batch and `model.generate` runs it to completion; requests arriving meanwhile wait for the
  next batch. A streamer timestamps every decoding step, so TTFT and ITL are per token, and
  each step is reported as a StepRecord (padding and finished rows counted as padding).
- `generate_batch`: transformers' continuous batching (`init_continuous_batching`, the
  engine behind `generate_batch`), fed request by request; token times are the ones it records.

A request that asks for its prompt's log-probabilities (SamplingParams.prompt_logprobs) gets
them from one more forward over its prompt alone (unpadded, batch 1), in the worker before its
generation starts: the `PromptLogprobs` event the built-in engine emits, from the same
log-softmax over the tokenizer's ids (engines/builtin/logprobs.py), before its first token.

The model runs in the stepping adapter's worker thread (engines/stepping.py); each step's
events cross to the event loop in one hand-over, so the harness sees the same typed events as
from any backend.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engines.base import (
    Arrived,
    BackendCapabilities,
    Failed,
    Finished,
    GenerationRequest,
    PrefillChunk,
    PromptLogprobs,
    RequestEvent,
    Scheduled,
    StepRecord,
    Tokenized,
    Tokens,
    check_prompt_length,
    now_ns,
    refuse_tools_and_adapters,
)
from engines.builtin.logprobs import token_logprobs
from engines.hf.config import HFConfig
from engines.hf.model import load_hf_model
from engines.sampling_params import LOGITS_FIELDS, SamplingParams
from engines.stepping import SteppedBackend
from models.dtypes import TORCH_DTYPES
from models.tokenizer import Tokenizer, stream_step, tokenizer_for_model

if TYPE_CHECKING:
    from engines.hf.model import CausalLM

# generate_batch: the KV pool when nothing bounds it better (max_num_seqs x max_model_len)
DEFAULT_KV_POOL_BYTES = 4 << 30


@dataclass
class _Pending:
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    detok: Any  # DetokenizerStream | None
    output: list[int] = field(default_factory=list)
    done: bool = False


class HFBackend(SteppedBackend):
    name = "hf"
    worker_name = "hf-generate"
    capabilities = BackendCapabilities()

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.config = config  # checked when it was built
        self.model: CausalLM | None = None
        self.tokenizer: Tokenizer | None = None
        self._waiting: deque[_Pending] = deque()
        self._open: dict[str, _Pending] = {}  # requests not done yet, by id
        self._manager: Any = None  # generate_batch's ContinuousBatchingManager
        self._step_number = 0

    @classmethod
    def from_config(cls, options: dict[str, Any]) -> HFBackend:
        return cls(HFConfig.from_dict(options))

    # ---- load ----------------------------------------------------------------------------

    def load(self) -> None:
        cfg = self.config
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        if cfg.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(cfg.device)
        dtype_name = (
            cfg.dtype
            if cfg.dtype != "auto"
            else ("bfloat16" if self.device.type == "cuda" else "float32")
        )
        self.dtype = TORCH_DTYPES[dtype_name]
        if Path(cfg.model).is_dir() and cfg.model_overrides:
            raise ValueError(
                "model.overrides: not supported with engine=hf and a checkpoint "
                "folder (transformers loads the folder's config.json as it is)"
            )
        self.model, self.model_config = load_hf_model(
            cfg.model,
            cfg.model_overrides,
            self.dtype,
            self.device,
            cfg.seed,
            cfg.attn_implementation,
        )
        self.tokenizer = tokenizer_for_model(cfg.model, cfg.tokenizer)
        mc = self.model_config
        self.max_model_len = min(
            cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.eos_ids = sorted(set(self.tokenizer.special.eos_ids) | set(mc.eos_token_ids))
        self.pad_id = (
            self.tokenizer.special.pad_id if self.tokenizer.special.pad_id is not None else 0
        )

    def _start_continuous_batching(self) -> None:
        """Started with the first request, not at load: while its generation thread is alive,
        torch work on the main thread runs at about half speed on a 2-core CPU, the hardware
        probe that runs after load included (docs/benchmarks.md, "Figures behind design
        choices")."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        assert self.model is not None and self.tokenizer is not None  # load() ran before
        cfg, mc = self.config, self.model_config
        # Its INFO lines (flash-attention advice, cache sizes) would flood every run's output,
        # and it warns that suppress_tokens "might not be supported": the tests check it is.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
        element = torch.tensor([], dtype=self.dtype).element_size()
        kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * element
        tokens = min(cfg.max_num_seqs * self.max_model_len, DEFAULT_KV_POOL_BYTES // kv_per_token)
        self._manager = self.model.init_continuous_batching(
            generation_config=GenerationConfig(
                do_sample=False,
                eos_token_id=self.eos_ids or None,
                pad_token_id=self.pad_id,
                # the built-in engine never samples ids past the tokenizer's vocabulary
                suppress_tokens=list(range(self.tokenizer.vocab_size, mc.vocab_size)) or None,
            ),
            continuous_batching_config=ContinuousBatchingConfig(
                max_requests_per_batch=cfg.max_num_seqs,
                page_size=cfg.block_size,
                num_blocks=max(1, math.ceil(tokens / cfg.block_size)),
                max_batch_tokens=max(2048, self.max_model_len),
                use_cuda_graph=False,
                allow_block_sharing=False,
                seed=cfg.seed,
            ),
        )
        self._manager.start()

    def describe(self) -> dict[str, Any]:
        assert self.model is not None, "load() first"
        mc = self.model_config
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return {
            "backend": self.name,
            "mode": self.config.mode,
            "model": self.config.model,
            "architecture": mc.architecture,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "max_num_seqs": self.config.max_num_seqs,
            "max_model_len": self.max_model_len,
            "num_parameters": mc.num_parameters(),
            "weight_bytes": weight_bytes,
            "attn_implementation": self.config.attn_implementation,
            "transformers": __import__("transformers").__version__,
            "torch_threads": torch.get_num_threads(),
        }

    # ---- requests ------------------------------------------------------------------------

    def _tokenize(self, request: GenerationRequest) -> list[int]:
        assert self.tokenizer is not None
        ids = self.tokenizer.encode_prompt(request.prompt)
        check_prompt_length(len(ids), request.sampling.max_tokens, self.max_model_len)
        return ids

    def _check_supported(self, sampling: SamplingParams) -> None:
        if sampling.n != 1:
            raise ValueError("SamplingParams.n: engine=hf supports n=1 only")
        if sampling.use_beam_search:
            raise ValueError(
                "SamplingParams.use_beam_search: engine=hf does not search beams; allowed: false"
            )
        unsupported = sampling.changed(LOGITS_FIELDS)
        if unsupported:
            raise ValueError(
                f"SamplingParams.{unsupported[0]}: engine=hf does not apply it; allowed: "
                "its default (the built-in engine and inferlab serve do)"
            )
        if sampling.logprobs is not None:
            raise ValueError(
                "SamplingParams.logprobs: engine=hf does not report the generated tokens' "
                "log-probabilities; allowed: null (prompt_logprobs is reported)"
            )
        if sampling.stop or sampling.stop_token_ids:
            raise ValueError(
                "SamplingParams.stop: stop strings/ids are not supported by "
                "engine=hf (use max_tokens / EOS)"
            )
        if self.config.mode == "generate_batch":
            if not sampling.greedy:
                raise ValueError(
                    "SamplingParams.temperature: engine.mode=generate_batch runs "
                    "greedy decoding only (temperature=0); use mode=generate"
                )
            if sampling.min_tokens and not sampling.ignore_eos:
                raise ValueError(
                    "SamplingParams.min_tokens: not supported by "
                    "mode=generate_batch; use ignore_eos for exact lengths"
                )

    def _submit(self, request: GenerationRequest) -> list[RequestEvent]:
        assert self.model is not None and self.tokenizer is not None, "load() first"
        arrival = now_ns()
        sampling = request.sampling
        self._check_supported(sampling)
        refuse_tools_and_adapters(request, "hf")
        ids = self._tokenize(request)
        events: list[RequestEvent] = [
            Arrived(request.request_id, -1, arrival),
            Tokenized(request.request_id, -1, now_ns(), len(ids)),
        ]
        detok = (
            self.tokenizer.new_stream(ids, sampling.skip_special_tokens)
            if sampling.detokenize
            else None
        )
        pending = self._open[request.request_id] = _Pending(
            request.request_id, ids, sampling, detok
        )
        if self.config.mode == "generate_batch" and sampling.prompt_logprobs is None:
            if self._manager is None:
                self._start_continuous_batching()
            events += self._submit_continuous(pending)
        else:  # generate_batch: its prompt is scored in the worker first (_step)
            self._waiting.append(pending)
        return events

    def _abort(self, request_id: str) -> None:
        pending = self._open.get(request_id)
        if pending is not None:
            self._done(pending)
        if self._manager is not None:
            self._manager.cancel_request(request_id)

    def _done(self, pending: _Pending) -> None:
        """No more events for this request (finished, failed or aborted)."""
        pending.done = True
        self._open.pop(pending.request_id, None)

    def _text(self, pending: _Pending, token: int) -> str:
        assert self.tokenizer is not None
        return stream_step(pending.detok, token, self.tokenizer.vocab_size)

    def _finished(self, pending: _Pending, reason: str, time: int, step: int) -> Finished:
        self._done(pending)
        return Finished(
            pending.request_id,
            step,
            time,
            reason,
            len(pending.token_ids),
            len(pending.output),
            text=pending.detok.text if pending.detok else "",
        )

    # ---- mode=generate: static batches ---------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self._waiting)

    async def _step(self) -> list[RequestEvent]:
        """One batch, run to completion in the worker (its events are posted from there)."""
        batch = self._next_batch()
        if not batch:
            return []  # what waited was aborted
        if self.config.mode == "generate_batch":  # requests that ask for prompt logprobs
            return await self._score_then_submit(batch)
        try:
            await self._in_worker(self._generate_batch, batch)
        except Exception as exc:  # fail this batch, keep serving the next
            failed, reason = now_ns(), f"hf generate: {type(exc).__name__}: {exc}"
            events: list[RequestEvent] = []
            for pending in [p for p in batch if not p.done]:
                self._done(pending)
                events.append(Failed(pending.request_id, self._step_number, failed, reason))
            return events
        return []

    def _next_batch(self) -> list[_Pending]:
        """The oldest waiting request and the next ones decoding the same way (one
        `generate` call takes one set of sampling options), up to max_num_seqs."""
        first = self._waiting[0]
        key = _decode_key(first.sampling)
        batch: list[_Pending] = []
        rest: deque[_Pending] = deque()
        while self._waiting:
            pending = self._waiting.popleft()
            if pending.done:
                continue  # aborted while waiting
            if len(batch) < self.config.max_num_seqs and _decode_key(pending.sampling) == key:
                batch.append(pending)
            else:
                rest.append(pending)
        self._waiting = rest
        return batch

    async def _score_then_submit(self, batch: list[_Pending]) -> list[RequestEvent]:
        """generate_batch: the prompts' logprobs in the worker, then the requests to the
        manager."""
        try:
            await self._in_worker(self._post_prompt_logprobs, batch, -1)
        except Exception as exc:
            failed, reason = now_ns(), f"hf prompt logprobs: {type(exc).__name__}: {exc}"
            events: list[RequestEvent] = []
            for pending in [p for p in batch if not p.done]:
                self._done(pending)
                events.append(Failed(pending.request_id, -1, failed, reason))
            return events
        if self._manager is None:
            self._start_continuous_batching()
        events = []
        for pending in batch:
            if not pending.done:
                events += self._submit_continuous(pending)
        return events

    @torch.inference_mode()
    def _post_prompt_logprobs(self, batch: list[_Pending], step: int) -> None:
        """In the worker: each request of `batch` that asks, its prompt's log-probabilities
        from a forward over its prompt alone (fp32 log-softmax over the tokenizer's ids, as
        the built-in engine reports them), posted as a PromptLogprobs event."""
        assert self.model is not None and self.tokenizer is not None
        events: list[RequestEvent] = []
        for pending in batch:
            top = pending.sampling.prompt_logprobs
            if top is None or pending.done:
                continue
            ids = torch.tensor([pending.token_ids], device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1]
            found = token_logprobs(
                logits[:, : self.tokenizer.vocab_size], ids[0, 1:], [top] * (ids.shape[1] - 1)
            )
            events.append(PromptLogprobs(pending.request_id, step, now_ns(), (None, *found)))
        if events:
            self._post(events)

    @torch.inference_mode()
    def _generate_batch(self, batch: list[_Pending]) -> None:
        from transformers import LogitsProcessorList

        assert self.model is not None and self.tokenizer is not None
        width = max(len(p.token_ids) for p in batch)
        rows = [[self.pad_id] * (width - len(p.token_ids)) + p.token_ids for p in batch]
        mask = [[0] * (width - len(p.token_ids)) + [1] * len(p.token_ids) for p in batch]
        input_ids = torch.tensor(rows, device=self.device)
        attention_mask = torch.tensor(mask, device=self.device)
        sampling = batch[0].sampling
        max_new = max(p.sampling.max_tokens for p in batch)
        options: dict[str, Any] = {"max_new_tokens": max_new, "pad_token_id": self.pad_id}
        if sampling.ignore_eos:
            options["eos_token_id"] = None  # run every row to the batch's longest max_tokens
        else:
            options["eos_token_id"] = self.eos_ids or None
            options["min_new_tokens"] = sampling.min_tokens
        if sampling.greedy:
            options["do_sample"] = False
        else:
            options.update(
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else None,
            )
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        streamer = _StepStreamer(self, batch, width)
        start, step = now_ns(), self._step_number
        scheduled: list[RequestEvent] = []
        for pending in batch:
            scheduled.append(Scheduled(pending.request_id, step, start))
            scheduled.append(
                PrefillChunk(pending.request_id, step, start, len(pending.token_ids), 0)
            )
        self._post(scheduled)
        self._post_prompt_logprobs(batch, step)
        streamer.last_ns = start
        self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            streamer=streamer,
            logits_processor=LogitsProcessorList([_MaskPast(self.tokenizer.vocab_size)]),
            **options,
        )
        end = now_ns()
        # EOS reached by every row before its max_tokens, or aborted
        last = [p for p in batch if not p.done]
        self._post([self._finished(p, "stop", end, self._step_number) for p in last])

    # ---- mode=generate_batch: transformers' continuous batching ---------------------------

    def _submit_continuous(self, pending: _Pending) -> list[RequestEvent]:
        """Hand the request to transformers' manager, whose result handler runs on the loop;
        the events of a refusal."""
        manager = self._manager
        sampling = pending.sampling
        seen = 0

        def on_output(output: Any) -> None:
            nonlocal seen
            if pending.done:
                return
            events = self._continuous_events(pending, output, seen)
            seen = len(output.generated_tokens)
            self._deliver(events)

        manager.register_result_handler(pending.request_id, on_output)
        eos = -1 if sampling.ignore_eos or not self.eos_ids else self.eos_ids
        added = manager.add_request(
            pending.token_ids,
            request_id=pending.request_id,
            max_new_tokens=sampling.max_tokens,
            streaming=True,
            record_timestamps=True,
            eos_token_id=eos,
        )
        if added is None:
            self._done(pending)
            reason = "hf generate_batch: the manager refused the request"
            return [Failed(pending.request_id, -1, now_ns(), reason)]
        return []

    def _continuous_events(self, pending: _Pending, output: Any, seen: int) -> list[RequestEvent]:
        """The events of one result of the manager's, whose first `seen` tokens were had."""
        if output.error:
            self._done(pending)
            return [Failed(pending.request_id, -1, now_ns(), f"hf generate_batch: {output.error}")]
        events: list[RequestEvent] = []
        times = output.timestamps or []
        if seen == 0 and output.generated_tokens:
            first = int(times[0] * 1e9) if times else now_ns()
            scheduled = int(output.lifespan[0] * 1e9) if output.lifespan[0] > 0 else first
            events.append(Scheduled(pending.request_id, -1, min(scheduled, first)))
        for i in range(seen, len(output.generated_tokens)):
            token = output.generated_tokens[i]
            pending.output.append(token)
            time = int(times[i] * 1e9) if i < len(times) else now_ns()
            events.append(
                Tokens(pending.request_id, -1, time, (token,), self._text(pending, token))
            )
        if output.is_finished():
            count = len(output.generated_tokens)
            reason = "length" if count >= pending.sampling.max_tokens else "stop"
            time = int(times[-1] * 1e9) if times else now_ns()
            events.append(self._finished(pending, reason, time, -1))
        return events

    def close(self) -> None:
        self._stop_stepping(wait_for_worker=False)
        if self._manager is not None:
            self._manager.stop(block=True)
            self._manager = None
        self.model = None


def _decode_key(s: SamplingParams) -> tuple:
    return (s.greedy, s.temperature, s.top_k, s.top_p, s.ignore_eos, s.min_tokens, s.seed)


class _MaskPast:
    """Ids past the tokenizer's vocabulary (a dummy model's padding rows) are never
    generated: the built-in engine's rule, so greedy tokens are comparable."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[-1] > self.vocab_size:
            scores[:, self.vocab_size :] = -math.inf
        return scores


class _StepStreamer:
    """transformers calls `put` with the prompt, then with each step's new tokens: each
    call ends a step, which becomes a StepRecord and one Tokens event per live row."""

    def __init__(self, backend: HFBackend, batch: list[_Pending], width: int) -> None:
        self.backend = backend
        self.batch = batch
        self.width = width
        self.steps_done = -1  # the first put is the prompt itself
        self.last_ns = 0

    def put(self, value: torch.Tensor) -> None:
        self.steps_done += 1
        if self.steps_done == 0:
            return
        now = now_ns()
        backend, step = self.backend, self.backend._step_number
        tokens = value.reshape(-1).tolist()
        live = [(p, t) for p, t in zip(self.batch, tokens, strict=True) if not p.done]
        prefill = self.steps_done == 1
        real_prompt = sum(len(p.token_ids) for p in self.batch)
        record = StepRecord(
            step=step,
            start_ns=self.last_ns,
            end_ns=now,
            num_seqs=len(self.batch),
            num_prefill_seqs=len(self.batch) if prefill else 0,
            num_decode_seqs=0 if prefill else len(self.batch),
            prefill_tokens=real_prompt if prefill else 0,
            decode_tokens=0 if prefill else len(live),
            padding_tokens=(self.width * len(self.batch) - real_prompt)
            if prefill
            else len(self.batch) - len(live),
            num_waiting=len(backend._waiting),
            kv_bytes_reserved=0,
            kv_bytes_used=0,
            num_running=len(self.batch),
            forward_ns=now - self.last_ns,
        )
        events: list[RequestEvent] = []
        for pending, token in live:
            pending.output.append(token)
            events.append(
                Tokens(pending.request_id, step, now, (token,), backend._text(pending, token))
            )
            s = pending.sampling
            n = len(pending.output)
            if n >= s.max_tokens:
                events.append(backend._finished(pending, "length", now, step))
            elif not s.ignore_eos and token in backend.eos_ids and n >= s.min_tokens:
                events.append(backend._finished(pending, "stop", now, step))
        backend._post(events, record)  # observers run on the event loop, not this thread
        backend._step_number += 1
        self.last_ns = now

    def end(self) -> None:
        pass
