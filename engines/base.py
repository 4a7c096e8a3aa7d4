"""The one small interface the harness drives, and the typed events every backend emits.

A backend turns `GenerationRequest`s into a stream of `RequestEvent`s per request, and reports
its internal steps (when it has any) as `StepRecord`s to an observer. All timestamps come from
`now_ns`, one monotonic nanosecond clock shared by the engine and the harness, so TTFT and ITL
are exact differences of event times and never re-derived from chunk arrival guesses.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeGuard

from engines.sampling_params import SamplingParams
from engines.tool_calls import ToolCallOutput, ToolUse


class ConfigError(ValueError):
    """A backend option has a value the backend cannot take; the message names the key and the
    allowed values."""


now_ns: Callable[[], int] = time.perf_counter_ns

ChatMessages = list[dict[str, Any]]
Prompt = str | list[int] | ChatMessages


def is_chat(prompt: object) -> TypeGuard[ChatMessages]:
    """Whether a prompt is chat messages (a non-empty list of dicts)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


@dataclass
class GenerationRequest:
    """One request as a backend sees it: a prompt (text, token ids or chat messages)."""

    request_id: str
    prompt: Prompt
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    # Workload grouping, carried through to the records (shared prefixes, multi-turn sessions).
    prefix_group: str | None = None
    session_id: str | None = None
    turn: int = 0
    #: the functions a chat prompt offers and the tool choice (engines/tool_calls.py); a
    #: backend that cannot call tools refuses a request that has them
    tools: ToolUse | None = None
    #: the LoRA adapter the request runs under (the built-in engine's engine.lora_modules;
    #: engine=openai sends it as the model name); None: the base model
    lora: str | None = None


def refuse_tools_and_adapters(request: GenerationRequest, engine: str) -> None:
    """The rule of backends that run one model without tools: a request with tools or a LoRA
    adapter is refused (ValueError naming the field) rather than run without them."""
    if request.tools is not None:
        raise ValueError(
            f"tools: engine={engine} does not offer the model tools; allowed: none "
            "(engine=builtin and engine=openai do)"
        )
    if request.lora is not None:
        raise ValueError(
            f"lora: engine={engine} runs no LoRA adapters; allowed: null (engine=builtin "
            "with engine.enable_lora and engine=openai do)"
        )


def check_prompt_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The length rule of backends that cannot shorten a request: a prompt has tokens, and
    the prompt plus max_tokens fit max_model_len; else a ValueError naming `prompt`."""
    if not num_prompt_tokens:
        raise ValueError("prompt: empty (it has no tokens)")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"prompt: {num_prompt_tokens} tokens + max_tokens {max_tokens} exceed "
            f"max_model_len={max_model_len}"
        )


# ---- events -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestEvent:
    request_id: str
    step: int  # the engine step that produced the event; -1 before any step
    time_ns: int


@dataclass(frozen=True, slots=True)
class Arrived(RequestEvent):
    pass


@dataclass(frozen=True, slots=True)
class Tokenized(RequestEvent):
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Scheduled(RequestEvent):
    """First time the request gets compute (end of queueing)."""


@dataclass(frozen=True, slots=True)
class PrefillChunk(RequestEvent):
    num_tokens: int
    num_computed_before: int  # prompt tokens already in the KV cache before this chunk


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's log-probabilities (natural log, from the model's raw logits): the token
    that is there, and the most likely tokens at that position."""

    token_id: int
    logprob: float
    rank: int  # 1: the most likely token at the position
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class Tokens(RequestEvent):
    """New output tokens; several at once for speculative decoding or coalesced chunks."""

    token_ids: tuple[int, ...]
    text: str = ""
    index: int = 0  # which sample, for parallel sampling (SamplingParams.n > 1)
    # one per token id when the request asked for SamplingParams.logprobs, else None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class PromptLogprobs(RequestEvent):
    """The prompt's log-probabilities (SamplingParams.prompt_logprobs), once its last prompt
    token is computed: one per prompt token, None for the first (nothing comes before it)."""

    logprobs: tuple[TokenLogprob | None, ...]


@dataclass(frozen=True, slots=True)
class Preempted(RequestEvent):
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Finished(RequestEvent):
    finish_reason: str  # "length" | "stop" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    text: str = ""
    index: int = 0  # which sample; a request with n samples finishes n times
    detokenize_ns: int = 0  # time this sample spent turning token ids into text, summed
    # speculative decoding: steps that verified drafts, drafts proposed, drafts kept (None:
    # a backend that does not say, such as an HTTP server)
    spec_steps: int | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    # beam search (SamplingParams.use_beam_search): the beam's summed log-probabilities
    cumulative_logprob: float | None = None
    # structured output: the grammar's compile time the request paid, and whether the
    # compile cache answered instead (None: no constraint, or a backend that does not say)
    structured_compile_ns: int | None = None
    structured_cache_hit: bool | None = None
    # jump-forward decoding: output tokens the grammar forced, appended without a sampling step
    structured_forced_tokens: int | None = None
    # a request with tools: the answer's tool calls and the content left beside them
    tool_output: ToolCallOutput | None = None
    # of cached_prompt_tokens, those loaded back from a KV tier (host memory, disk) rather than
    # found in the device's pool (None: a backend that does not say)
    cached_prompt_tokens_host: int | None = None
    cached_prompt_tokens_disk: int | None = None
    # a disaggregated engine's request (engine.disaggregation=pd); None: a colocated one
    disaggregated: DisaggregatedFacts | None = None


@dataclass(frozen=True, slots=True)
class DisaggregatedFacts:
    """Where a request ran in a disaggregated engine and what handing its K/V over cost."""

    prefill_instance: int | None  # None: prefilled where it decoded (`fallback` says why)
    decode_instance: int
    kv_bytes: int  # the prompt's K/V handed over (0: none came)
    kv_transfer_ns: int | None  # from the prefill instance's read to the decode instance's
    decode_queue_ns: int | None  # from the K/V's arrival to the decode instance's first step
    fallback: str | None  # why the decode instance prefilled it itself (None: it did not)


@dataclass(frozen=True, slots=True)
class Failed(RequestEvent):
    error: str


TERMINAL_EVENTS = (Finished, Failed)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one engine step did; the step plan as it was executed."""

    step: int
    start_ns: int
    end_ns: int
    num_seqs: int
    num_prefill_seqs: int
    num_decode_seqs: int
    prefill_tokens: int
    decode_tokens: int
    padding_tokens: int
    num_waiting: int
    kv_bytes_reserved: int
    kv_bytes_used: int
    num_preempted: int = 0
    num_running: int = 0  # sequences holding KV memory after the step
    kv_blocks_used: int = 0
    # blocks more than one sequence holds (forks, beams, prefix hits), and the K/V bytes copied
    # before the step's forward (copy-on-write of a shared block; a contiguous fork's region)
    kv_blocks_shared: int = 0
    kv_bytes_copied: int = 0
    # structured outputs: the rows whose logits a grammar masked, and the time the mask took
    # (filling each row's bitmask and applying it; within forward_ns)
    structured_rows: int = 0
    structured_mask_ns: int = 0
    # LoRA: the distinct adapters the step ran, its token rows under one, and the most rows
    # under a single adapter
    lora_adapters: int = 0
    lora_rows: int = 0
    lora_rows_max: int = 0
    # mixture of experts: the (token, expert) pairs routed to each expert this step, over every
    # MoE layer (a token counts once per layer and chosen expert); () for a dense model
    moe_expert_tokens: tuple[int, ...] = ()
    moe_experts_touched: int = 0  # (layer, expert) pairs with a token: the experts' weights read
    moe_expert_ns: int = 0  # host time of the experts' MLPs (routing and grouping excluded)
    forward_ns: int = 0  # device time of the model forward and sampling within the step
    kv_gather_ns: int = 0  # of which copying K/V out of the cache (CPU dense attention)
    # For the roofline (harness/measuring/roofline.py); padding rows count as computed.
    logits_tokens: int = 0  # rows whose logits the LM head computed
    attention_pairs: int = 0  # (query, key) pairs attended, summed over the step's queries
    kv_tokens_read: int = 0  # cached tokens whose K/V the step's sequences read
    kv_tokens_written: int = 0  # tokens whose K/V the step stored
    # Speculative decoding: drafts the step verified and kept, and the proposer's time before
    # the step (the verification itself is in forward_ns).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    draft_ns: int = 0
    # per draft position 1, 2, ...: the verifying rows that proposed / kept a draft there
    spec_drafts_by_position: tuple[int, ...] = ()
    spec_accepted_by_position: tuple[int, ...] = ()
    # Tensor parallelism (rank 0's view): time in the forward's collectives (all-reduces, the
    # logits gather) and the bytes it contributed to them; the step's broadcast to the ranks
    comm_ns: int = 0
    comm_bytes: int = 0
    broadcast_ns: int = 0
    broadcast_bytes: int = 0
    # KV tiers (engine.kv_host_tier_bytes, kv_disk_tier_bytes): evicted blocks' bytes saved from
    # the pool and tier hits' bytes loaded into it before the forward, the time that took, and
    # the disk tier's reads while matching prefixes this step (its writes run on a thread)
    kv_bytes_saved: int = 0
    kv_bytes_loaded: int = 0
    kv_transfer_ns: int = 0
    kv_disk_read_bytes: int = 0
    kv_disk_read_ns: int = 0
    # disaggregation: the instance that ran the step ("prefill0", "decode0"; "": colocated);
    # kv_bytes_loaded then counts a prefill instance's K/V loaded, and kv_transfer_ns the time
    # moving K/V in or out of the pool
    instance: str = ""


StepObserver = Callable[[StepRecord], None]


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend offers beyond the `Backend` interface, declared by its class: the harness
    asks these, never the backend's type."""

    # the engine steps in this process: its step observers see every step and torch.profiler
    # traces it; False: a client of a server, which profiles itself (POST /start_profile)
    in_process: bool = True
    # how `run.quality` reads the backend's logits: "engine" (the built-in engine's logits
    # observer, on its `engine` and `config`), "prompt_logits" (the backend's own
    # `prompt_logits`), None (no quality probe)
    quality_probe: Literal["engine", "prompt_logits"] | None = None


class Backend(ABC):
    """What the harness needs from any engine: load, stream one request's events, close.

    `generate` is async so HTTP backends fit naturally; in-process engines adapt by running
    their step loop as a task on the same event loop (see `engines.builtin.backend`).
    """

    name: str = "backend"
    capabilities: BackendCapabilities = BackendCapabilities()

    def __init__(self) -> None:
        self.step_observers: list[StepObserver] = []
        # a folder for the backend's own files (a server's log), the run folder: set by the
        # harness before load(); None: write none
        self.files_dir: Path | None = None

    @abstractmethod
    def load(self) -> None:
        """Build or connect to the model. Timed by the harness as part of cold start."""

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        """Submit `request` now and yield its events, ending with `Finished` or `Failed`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""

    def start_measuring(self) -> None:  # noqa: B027 - optional hook
        """Called once, after any warm-up, before the measured requests: a backend that reads
        counters kept elsewhere (a server's /metrics) takes its starting values here."""

    def client_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The engine options with which a client process (run.num_clients) builds a backend
        that reaches this one's server: `options` unless load() changed where that is."""
        return options

    def served_adapters(self) -> tuple[str, ...] | None:
        """The LoRA adapters requests may name (GenerationRequest.lora); None: the backend
        cannot tell before it is asked (a server decides)."""
        return ()

    def failure(self) -> str | None:
        """Why the backend can serve no more requests (a tensor-parallel rank died), or None.
        A run whose backend failed this way fails, whatever requests completed before."""
        return None

    def describe(self) -> dict[str, Any]:
        """Facts worth recording in the run folder (model shape, byte counts, options)."""
        return {"backend": self.name}

    def emit_step(self, record: StepRecord) -> None:
        for observer in self.step_observers:
            observer(record)
