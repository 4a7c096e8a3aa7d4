"""Between HTTP and the engine: prompts tokenized off the event loop and checked against the
engine's limits, admission against the server's bound (and refusal once shutting down), and
each request's engine events turned into choice pieces.

Everything here runs on the server's event loop. The engine steps in its own thread
(`BuiltinBackend.start_engine_thread`); from here the engine is only read where what is read
never changes after load (limits, vocabulary, KV layout), its state is read from the snapshot
the engine thread publishes, and everything else crosses to that thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from engines.base import (
    Failed,
    Finished,
    GenerationRequest,
    Prompt,
    PromptLogprobs,
    RequestEvent,
    TokenLogprob,
    Tokens,
    now_ns,
)
from engines.builtin.backend import BuiltinBackend, EngineThread
from engines.builtin.engine import LLMEngine
from engines.sampling_params import SamplingParams
from serving.config import ServerConfig
from serving.logprobs_format import TokenTexts
from serving.metrics import ServerMetrics
from serving.profiler import EngineProfiler
from serving.protocol import APIError, check_model
from serving.request_metrics import RequestObserver

logger = logging.getLogger("inferlab.serve")
T = TypeVar("T")

# Prompts are tokenized in a small pool of threads, so a long one never holds up the event loop
# (the tokenizer releases the GIL on long texts). At most `capacity` prompts (what the server
# admits at once) are queued or running there; past that, 503.
TOKENIZER_THREADS = 2


@dataclass(frozen=True, slots=True)
class ChoiceText:
    """New output of one choice: its text delta (may be empty) and the tokens that made it."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    # one per token id when the request asked for logprobs (engines/base.py's Tokens)
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class PromptScores:
    """A prompt's logprobs (SamplingParams.prompt_logprobs: completions' echo with logprobs),
    before any of its choices' text: one per prompt token, None for the first."""

    prompt_index: int
    logprobs: tuple[TokenLogprob | None, ...]


@dataclass(frozen=True, slots=True)
class ChoiceEnd:
    index: int
    finish_reason: str
    text: str  # the choice's whole text
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class GenerationFailed:
    message: str
    code: str = "engine_error"
    status: int = 500  # a non-streaming response's status


Piece = ChoiceText | ChoiceEnd | PromptScores | GenerationFailed


class Admission:
    """Sequences held against the server's bound, and their LoRA adapter against its unload;
    released once, however the request ends."""

    def __init__(self, owner: ServingEngine, num_sequences: int, adapter: str | None) -> None:
        self.owner = owner
        self.num_sequences = num_sequences
        self.adapter = adapter
        if adapter is not None:
            owner.adapter_holds[adapter] += 1

    def release(self) -> None:
        self.owner.in_flight -= self.num_sequences
        self.num_sequences = 0
        if self.adapter is not None:
            self.owner.adapter_holds[self.adapter] -= 1
            if not self.owner.adapter_holds[self.adapter]:
                del self.owner.adapter_holds[self.adapter]
            self.adapter = None


class ServingEngine:
    def __init__(self, backend: BuiltinBackend, config: ServerConfig) -> None:
        if backend.engine is None:
            raise ValueError("the backend must be loaded (backend.load()) before serving")
        self.backend = backend
        self.config = config
        self.engine_thread: EngineThread = backend.start_engine_thread()
        self.in_flight = 0  # sequences admitted and not yet finished
        #: adapter -> requests admitted under it and not finished: it cannot be unloaded
        self.adapter_holds: Counter[str] = Counter()
        assert backend.engine is not None
        #: the `model` requests must name, and vLLM's `model_name` label on /metrics
        self.model_name = config.served_model_name or str(backend.engine.config.model)
        if self.model_name in self.adapter_names():  # `model` could not reach the base model
            raise ValueError(
                f"engine.lora_modules.{self.model_name}: the served model's name "
                "(served_model_name); allowed: another adapter name"
            )
        self.metrics = ServerMetrics(
            backend, lambda: self.in_flight, self.model_name, config.metrics_names
        )
        #: POST /start_profile and /stop_profile (serving/profiler.py); None without profile_dir
        self.profiler = (
            None
            if config.profile_dir is None
            else EngineProfiler(
                self.engine_thread, Path(config.profile_dir), backend.engine.platform.is_cuda
            )
        )
        self.draining = False  # shutting down: admit nothing new
        self.shutdown_reason: str | None = None  # set when the rest is aborted
        self._tokenizer_pool = ThreadPoolExecutor(
            TOKENIZER_THREADS, thread_name_prefix="inferlab-tokenize"
        )
        self._tokenize_jobs = 0
        #: how logprobs write token ids (each id decoded once, then remembered)
        self.token_texts = TokenTexts(backend.engine.tokenizer)

    @property
    def engine(self) -> LLMEngine:
        engine = self.backend.engine
        if engine is None:
            raise APIError("the engine is shut down", None, "engine_closed", 503, "server_error")
        if engine.failure is not None:  # a tensor-parallel rank died: nothing can run
            failed = f"the engine has failed: {engine.failure}"
            raise APIError(failed, None, "engine_failed", 503, "server_error")
        return engine

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len

    @property
    def capacity(self) -> int:
        return self.engine.limits.max_num_seqs + self.config.max_queue_len

    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name as its `model` (engine.lora_modules and those
        loaded since)."""
        lora = self.engine.lora
        return () if lora is None else lora.names

    def check_serving(self) -> None:
        """503 once the engine is closed or the server is shutting down."""
        self.engine  # noqa: B018 - raises 503 once the engine is closed
        if self.draining:
            raise shutting_down()

    # ---- tokenization -------------------------------------------------------------------------

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, computed in the tokenizer pool (ValueError for a malformed
        conversation, as the engine raises it)."""
        return await self.in_tokenizer_pool(self.engine.tokenize, prompt)

    async def in_tokenizer_pool(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` (tokenizer work) in the tokenizer pool, off the event loop; 503 once
        `capacity` jobs are queued or running there."""
        if self._tokenize_jobs >= self.capacity:
            self.metrics.requests_rejected.inc()
            raise APIError(
                f"The server is overloaded: {self._tokenize_jobs} prompts are being "
                "tokenized. Retry later.",
                None,
                "server_overloaded",
                503,
                "server_error",
            )
        self._tokenize_jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_pool, work, *args
            )
        finally:
            self._tokenize_jobs -= 1

    # ---- checks -------------------------------------------------------------------------------

    def check_prompt(
        self,
        token_ids: list[int],
        max_tokens: int | None,
        param: str,
        max_tokens_param: str = "max_tokens",
    ) -> int:
        """Refuse a prompt the engine could never run; return the max_tokens to use
        (None: what the context has left, as vLLM does for chat)."""
        engine = self.engine
        max_len = self.max_model_len
        if not token_ids:
            raise APIError(
                f"{param}: the prompt is empty (it has no tokens)", param, "invalid_value"
            )
        vocab = engine.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:  # C loops: this runs on the loop
            bad = [t for t in token_ids if not 0 <= t < vocab]
            raise APIError(
                f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                param,
                "invalid_value",
            )
        if len(token_ids) >= max_len:
            raise APIError(
                f"This model's maximum context length is {max_len} tokens. However, your prompt "
                f"has {len(token_ids)} tokens (at least one token must be generated).",
                param,
                "context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = max_len - len(token_ids)
        if max_tokens >= 1 and len(token_ids) + max_tokens > max_len:
            raise APIError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {len(token_ids) + max_tokens} tokens ({len(token_ids)} in the "
                f"prompt, {max_tokens} for the completion). Please reduce the prompt or "
                f"{max_tokens_param}.",
                max_tokens_param,
                "context_length_exceeded",
            )
        try:
            # A paged pool smaller than the request fails now rather than readmitting forever.
            engine.check_fits(len(token_ids), max(max_tokens, 1))
        except ValueError as exc:
            raise APIError(str(exc), param, "context_length_exceeded") from None
        return max_tokens

    def check_engine_accepts(
        self, prompts: Sequence[list[int]], sampling: Sequence[SamplingParams]
    ) -> None:
        """The engine's own admission checks, run before answering: what it would refuse at
        add_request (inside a 200 stream, too late) is a 400 now, naming the field."""
        for token_ids, params in zip(prompts, sampling, strict=True):
            try:
                self.engine.check_request(token_ids, params)
            except ValueError as exc:
                # "SamplingParams.n: ..." -> "n: ...", the name the client sent
                message = str(exc).removeprefix("SamplingParams.")
                raise APIError(message, message.split(":", 1)[0], "invalid_value") from None

    def admit(self, num_sequences: int, param: str = "n", adapter: str | None = None) -> Admission:
        """Hold room for the request's sequences, or refuse it: 503 when the server is full or
        shutting down. `param`: the field that set the sequences per prompt; `adapter`: the
        LoRA adapter it runs under, held until it ends (a 400 if unloaded since the request's
        checks: its prompt was tokenized meanwhile)."""
        if self.draining:
            raise shutting_down()
        if adapter is not None:
            check_model(adapter, self.model_name, self.adapter_names())
        if num_sequences > self.capacity:
            raise APIError(
                f"the request needs {num_sequences} sequences (prompts x {param}) but the "
                f"server admits at most {self.capacity} at once",
                param,
                "invalid_value",
            )
        if self.in_flight + num_sequences > self.capacity:
            self.metrics.requests_rejected.inc()
            raise APIError(
                f"The server is overloaded: {self.in_flight} sequences are admitted, the limit "
                f"is {self.capacity} (max_num_seqs + max_queue_len). Retry later.",
                None,
                "server_overloaded",
                503,
                "server_error",
            )
        self.in_flight += num_sequences
        return Admission(self, num_sequences, adapter)

    # ---- generation ---------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompts: Sequence[list[int]],
        sampling: Sequence[SamplingParams],
        arrival_ns: int,
        admission: Admission,
        lora: str | None = None,
    ) -> AsyncGenerator[Piece, None]:
        """Run every prompt with its sampling parameters; choice index = prompt index x n +
        sample index, as OpenAI numbers them. Closing this stream aborts what is still running
        and frees its KV memory."""
        n = sampling[0].n
        streams = [
            self.backend.generate(GenerationRequest(f"{request_id}-{i}", ids, params, lora=lora))
            for i, (ids, params) in enumerate(zip(prompts, sampling, strict=True))
        ]
        observed = RequestObserver(self.metrics, prompts, sampling, arrival_ns)
        try:
            async for prompt_index, event in _merge(streams):
                observed.observe(prompt_index, event)
                if isinstance(event, Tokens):
                    yield ChoiceText(
                        prompt_index * n + event.index, event.text, event.token_ids, event.logprobs
                    )
                elif isinstance(event, PromptLogprobs):
                    yield PromptScores(prompt_index, event.logprobs)
                elif isinstance(event, Finished):
                    yield ChoiceEnd(
                        prompt_index * n + event.index,
                        event.finish_reason,
                        event.text,
                        event.num_output_tokens,
                    )
                elif isinstance(event, Failed):
                    engine = self.backend.engine
                    if self.shutdown_reason is not None and event.error == self.shutdown_reason:
                        yield GenerationFailed(event.error, "server_shutting_down", 503)
                    elif engine is not None and engine.failure is not None:
                        # the engine died under this request (a tensor-parallel rank is gone):
                        # the same 503 as every request after it gets, not a 500 of its own
                        failed = f"the engine has failed: {engine.failure}"
                        yield GenerationFailed(failed, "engine_failed", 503)
                    else:
                        yield GenerationFailed(f"generation failed: {event.error}")
                    return
        finally:
            if observed.open_choices:  # closed early: its client went away
                self.metrics.requests_aborted.inc()
                logger.info(
                    "%s: client disconnected after %d output tokens (%.2f s); request "
                    "aborted, its KV cache freed",
                    request_id,
                    observed.num_tokens,
                    (now_ns() - arrival_ns) / 1e9,
                )
            admission.release()

    # ---- shutdown -----------------------------------------------------------------------------

    def stop_admitting(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is admitted (True), or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def abort_all(self, reason: str) -> int:
        """End every running request with `reason` (streams get a final error event,
        non-streaming requests a 503) and free their KV memory; how many there were."""
        self.shutdown_reason = reason
        return await asyncio.wrap_future(self.engine_thread.abort_all(reason))

    def close(self) -> None:
        """After the server stopped, before the backend closes (the engine thread runs): a
        profile still running is stopped and written."""
        if self.profiler is not None:
            self.profiler.close()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def shutting_down() -> APIError:
    return APIError(
        "The server is shutting down and admits no new requests; retry against "
        "another replica or after it restarts.",
        None,
        "server_shutting_down",
        503,
        "server_error",
    )


async def _merge(
    streams: list[AsyncIterator[RequestEvent]],
) -> AsyncIterator[tuple[int, RequestEvent]]:
    """Interleave several request streams in arrival order, tagging each event with its
    stream's index; closing the merge closes (and so aborts) every stream."""
    if len(streams) == 1:  # the common case: no task, no hop
        async with aclosing(streams[0]) as stream:  # type: ignore[type-var]
            async for event in stream:
                yield 0, event
        return
    queue: asyncio.Queue[tuple[int, RequestEvent | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestEvent]) -> None:
        try:
            async with aclosing(stream) as events:  # type: ignore[type-var]
                async for event in events:
                    queue.put_nowait((index, event))
        except Exception as exc:  # handed to the consumer, raised there
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
