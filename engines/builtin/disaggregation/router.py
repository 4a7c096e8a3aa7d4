"""The disaggregated engine (`engine.disaggregation=pd`): what `inferlab run` and `inferlab
serve` drive in place of an LLMEngine, with the same methods. It does no model work itself:

    add_request -> tokenize -> decode instance (waits for the K/V) + prefill instance (computes
    them, sends them over the connector) ... step -> the instances' updates -> events

Each request goes to the least loaded prefill and decode instances. Its events are merged into
one stream: the prefill instance's scheduling and prompt chunks, then the decode instance's
tokens; its Finished carries `DisaggregatedFacts` (where it ran, the hand-off's bytes and
time, and whether it had to be prefilled on the decode instance instead).

Faults end in an error or a counted fallback, never a hang. The router keeps the time: an
instance that has work and says nothing for `kv_transfer_timeout_s` is hung (a decode
instance: 4 times that, since it may be prefilling a long prompt itself).
- A decode instance that dies or hangs is killed, and its requests fail naming it; with
  none left the engine is dead (`failure`, EngineDeadError).
- A prefill instance that dies or hangs, or K/V sent and not received in time: the decode
  instance prefills the prompt itself, counted (or fails the request:
  `kv_load_failure_policy`), the prefill instance's copy is aborted, and a hung prefill
  instance gets no new requests until it answers again.
- Closing, garbage collection or the process's exit end every instance (killed if it does not
  leave).
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from typing import Any

import torch

from engines.base import (
    Arrived,
    ConfigError,
    DisaggregatedFacts,
    Failed,
    Finished,
    Preempted,
    PrefillChunk,
    Prompt,
    RequestEvent,
    Scheduled,
    StepObserver,
    Tokenized,
    now_ns,
)
from engines.builtin.config import EngineConfig
from engines.builtin.disaggregation.connectors import KV_CONNECTORS
from engines.builtin.disaggregation.messages import (
    DECODE,
    PREFILL,
    InstanceRequest,
    InstanceSpec,
    KVNote,
)
from engines.builtin.disaggregation.processes import (
    STARTUP_TIMEOUT_S,
    InstanceProcess,
    end_instances,
    placement,
)
from engines.builtin.engine import (
    EngineClosedError,
    EngineDeadError,
    check_beams_fit,
    check_prompt_length,
    check_some_token_allowed,
    check_structured_outputs,
    check_token_ids,
)
from engines.builtin.limits import EngineLimits
from engines.builtin.platform import Platform
from engines.builtin.step_stats import EngineGauges
from engines.builtin.structured import build_structured_outputs, resolve_structured_output_backend
from engines.sampling_params import SamplingParams
from models.config import ModelConfig
from models.location import resolve_model
from models.tokenizer import tokenizer_for_model

#: How long a step waits for the instances' news when it has none to give.
_POLL_S = 0.002
#: A decode instance may be silent this many times kv_transfer_timeout_s before it counts as
#: hung (it may be prefilling a long prompt itself, after a fallback).
_DECODE_SILENCE_FACTOR = 4


@dataclass
class _Request:
    request_id: str
    num_prompt_tokens: int
    decode: int
    prefill: int | None
    routed_ns: int
    samples_left: int
    fallback: str | None = None
    prefill_scheduled: bool = False
    kv_sent_ns: int | None = None  # the prefill instance has sent its K/V
    kv_given_up: bool = False  # the decode instance was told to go without them
    kv_bytes: int = 0
    kv_received_ns: int | None = None
    kv_transfer_ns: int | None = None
    decode_scheduled_ns: int | None = None


class DisaggregatedEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.closed = False
        self.failure: str | None = None
        self.config = config
        self.model_config = resolve_model(config.model, config.model_overrides)
        _refuse_windows(config, self.model_config)
        self.tokenizer = tokenizer_for_model(config.model, config.tokenizer)
        self.eos_ids = sorted(
            set(self.tokenizer.special.eos_ids) | set(self.model_config.eos_token_ids)
        )
        self.platform = Platform(torch.device("cpu"))  # the clock; the instances compute
        self.step_observers: list[StepObserver] = []
        self.step_counter = 0
        self.counters: Counter[str] = Counter()
        self._requests: dict[str, _Request] = {}
        self._pending_events: list[RequestEvent] = []
        kind = KV_CONNECTORS.get(config.kv_connector)
        self._links = kind.setup(config.num_prefill_instances, config.num_decode_instances)
        self.instances: list[InstanceProcess] = []
        self._finalizer = weakref.finalize(
            self, end_instances, self.instances, kind.cleanup, self._links
        )
        try:
            self._start_instances()
            decode = self._decodes[0].facts
            self.limits: EngineLimits = decode["limits"]
            # Grammars are compiled here too, so that a constraint no instance could compile
            # is a ValueError (a 400) at add_request, as colocated. The decode instance
            # compiles it again: a grammar's first use pays both.
            self.structured = build_structured_outputs(
                resolve_structured_output_backend(config.structured_output_backend),
                self.tokenizer,
                decode["sample_vocab_size"],
                self.eos_ids,
            )
        except BaseException:
            self.close()
            raise

    # ---- instances --------------------------------------------------------------------------

    @property
    def _prefills(self) -> list[InstanceProcess]:
        return [i for i in self.instances if i.role == PREFILL]

    @property
    def _decodes(self) -> list[InstanceProcess]:
        return [i for i in self.instances if i.role == DECODE]

    def _start_instances(self) -> None:
        config = self.config
        roles = [(PREFILL, i) for i in range(config.num_prefill_instances)]
        roles += [(DECODE, i) for i in range(config.num_decode_instances)]
        threads, cores = placement(len(roles), config.num_threads)
        colocated = replace(config, disaggregation="none", num_threads=threads).to_dict()
        for n, (role, index) in enumerate(roles):
            pinned = None if cores is None else tuple(cores[n * threads : (n + 1) * threads])
            spec = InstanceSpec(
                role,
                index,
                colocated,
                pinned,
                config.kv_connector,
                self._links,
                config.num_prefill_instances,
                config.num_decode_instances,
                config.kv_transfer_timeout_s,
                config.kv_load_failure_policy,
            )
            self.instances.append(InstanceProcess.start(spec))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for instance in self.instances:
            instance.await_ready(deadline)
        addresses = [d.facts["address"] for d in self._decodes]
        for prefill in self._prefills:
            prefill.send(("peers", addresses))

    # ---- what the harness and the server read -----------------------------------------------

    @property
    def lora(self) -> None:
        return None  # engine.enable_lora is refused with disaggregation

    @property
    def kv_tiers(self) -> None:
        return None  # so are the KV tiers

    def describe(self) -> dict[str, Any]:
        self._ensure_not_closed()
        facts = dict(self._decodes[0].facts["describe"])
        facts["disaggregation"] = {
            "mode": "pd",
            "kv_connector": self.config.kv_connector,
            "kv_transfer_timeout_s": self.config.kv_transfer_timeout_s,
            "kv_load_failure_policy": self.config.kv_load_failure_policy,
            "instances": [
                {
                    "role": i.role,
                    "index": i.index,
                    "pid": i.process.pid,
                    "num_threads": i.facts.get("describe", {}).get("num_threads"),
                    "cores": i.facts.get("cores"),
                }
                for i in self.instances
            ],
            **self.counters,
        }
        return facts

    def gauges(self) -> EngineGauges:
        """The instances' gauges summed (each holds KV memory of its own)."""
        self._ensure_not_closed()
        gauges = [instance.gauges for instance in self.instances]

        def total(name: str) -> int:
            return sum(getattr(g, name) for g in gauges)

        return EngineGauges(
            num_running=total("num_running"),
            num_waiting=total("num_waiting"),
            kv_bytes_reserved=total("kv_bytes_reserved"),
            kv_pool_bytes=total("kv_pool_bytes"),
            kv_blocks_used=total("kv_blocks_used"),
            kv_num_blocks=total("kv_num_blocks"),
            step=self.step_counter,
            num_preemptions=total("num_preemptions"),
            prefix_cache_queries=total("prefix_cache_queries"),
            prefix_cache_hits=total("prefix_cache_hits"),
        )

    # ---- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode_prompt(prompt)

    def check_request(self, token_ids: list[int], sampling: SamplingParams) -> None:
        """An LLMEngine's checks, against a decode instance's limits."""
        self._ensure_not_closed()
        sampling.validate()
        if sampling.structured_outputs is not None:
            check_structured_outputs(self.structured, sampling.structured_outputs)
        vocab = self.model_config.vocab_size
        check_token_ids(token_ids, sampling, vocab)
        check_some_token_allowed(
            sampling,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            vocab,
            self.eos_ids,
        )
        check_beams_fit(sampling, self.limits.max_num_seqs)
        check_prompt_length(token_ids, self.limits.max_model_len)
        self.check_fits(len(token_ids), sampling.max_tokens)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        facts = self._decodes[0].facts["describe"]
        block = facts["kv_block_size"]
        longest = min(num_prompt_tokens + max_tokens, self.limits.max_model_len)
        if -(-longest // block) > facts["kv_num_blocks"] - 1:
            raise ValueError(
                f"prompt: {num_prompt_tokens} prompt tokens + max_tokens={max_tokens} do not "
                f"fit a decode instance's KV pool ({facts['kv_num_blocks'] - 1} blocks of "
                f"{block} tokens); the request can never run"
            )

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        arrival_ns: int | None = None,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        self.ensure_open()
        if lora_name is not None:
            raise ValueError(
                f"lora: {lora_name!r} asked of a disaggregated engine, which serves no "
                "adapters; allowed: null"
            )
        sampling = sampling or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        self.check_request(token_ids, sampling)
        arrival_ns = now_ns() if arrival_ns is None else arrival_ns
        decode = _least_loaded(self._decodes, self._requests.values(), _decoding)
        prefill, fallback = self._pick_prefill(token_ids, sampling)
        request = _Request(
            request_id, len(token_ids), decode.index, prefill, now_ns(), sampling.n, fallback
        )
        if fallback is not None:
            self.counters["colocated_requests"] += 1
        self._requests[request_id] = request
        decode.send(
            (
                "add",
                InstanceRequest(
                    request_id,
                    token_ids,
                    sampling,
                    arrival_ns,
                    priority,
                    expects_kv=prefill is not None,
                ),
            ),
        )
        if prefill is not None:
            one_token = SamplingParams(max_tokens=1, temperature=0.0)
            self._prefills[prefill].send(
                (
                    "add",
                    InstanceRequest(
                        request_id,
                        token_ids,
                        one_token,
                        arrival_ns,
                        priority,
                        export_kv=True,
                        decode=decode.index,
                    ),
                ),
            )
        step = self.step_counter
        self._pending_events += [
            Arrived(request_id, step, arrival_ns),
            Tokenized(request_id, step, now_ns(), len(token_ids)),
        ]

    def _pick_prefill(
        self, token_ids: list[int], sampling: SamplingParams
    ) -> tuple[int | None, str | None]:
        """The prefill instance for a prompt, or None and why it is prefilled where it
        decodes."""
        if sampling.prompt_logprobs is not None:
            return (
                None,
                "prompt_logprobs: every prompt token's logits are computed where it decodes",
            )
        if len(token_ids) < 2:
            return None, "a one-token prompt has no K/V to hand over"
        ready = [p for p in self._prefills if p.alive and p.unresponsive is None]
        if not ready:
            return None, "no prefill instance is answering"
        return _least_loaded(ready, self._requests.values(), _prefilling).index, None

    def abort_request(self, request_id: str) -> None:
        self._ensure_not_closed()
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.prefill is not None:
            self._prefills[request.prefill].send(("abort", request_id))
        self._decodes[request.decode].send(("abort", request_id))

    def has_request(self, request_id: str) -> bool:
        self._ensure_not_closed()
        return request_id in self._requests

    def has_unfinished_requests(self) -> bool:
        self._ensure_not_closed()
        return bool(self._requests or self._pending_events)

    # ---- the step: the instances' news ------------------------------------------------------

    def step(self) -> list[RequestEvent]:
        self.ensure_open()
        events, self._pending_events = self._pending_events, []
        live = {i.control: i for i in self.instances if i.alive}
        for control in wait(list(live), timeout=0 if events else _POLL_S):
            events += self._read(live[control])  # type: ignore[index]
        events += self._time_out_silent_instances()
        self.step_counter += 1
        return events

    def _read(self, instance: InstanceProcess) -> list[RequestEvent]:
        events: list[RequestEvent] = []
        while instance.alive:
            try:
                if not instance.control.poll(0):
                    break
                message = instance.control.recv()
            except (EOFError, OSError):
                code = instance.process.poll()
                return events + self._lost(instance, f"exited (code {code})")
            instance.last_heard_ns = now_ns()
            instance.unresponsive = None
            if message[0] == "fatal":
                return events + self._lost(instance, f"failed: {message[1]}")
            _, updates, records, notes, gauges = message
            instance.gauges = gauges
            for record in records:
                record = replace(record, instance=f"{instance.role}{instance.index}")
                for observer in self.step_observers:
                    observer(record)
            for note in notes:
                self._on_note(note)
            for event in updates:
                events += self._route(instance, event)
        return events

    def _route(self, instance: InstanceProcess, event: RequestEvent) -> list[RequestEvent]:
        """An instance's event as the request's one stream has it (or not at all)."""
        request = self._requests.get(event.request_id)
        if request is None:
            return []  # aborted: its last events are nobody's
        if instance.role == PREFILL:
            if request.kv_given_up:
                return []  # prefilled where it decodes: the copy here is not the request's
            if isinstance(event, Scheduled):
                request.prefill_scheduled = True
                return [event]
            if isinstance(event, (PrefillChunk, Preempted)):
                return [event]
            if isinstance(event, Failed):
                self._give_up_kv(request, f"the prefill failed: {event.error}")
            return []  # its arrival (the router's), its one token, its end: not the request's
        if isinstance(event, (Arrived, Tokenized)):
            return []
        if isinstance(event, Scheduled) and request.decode_scheduled_ns is None:
            request.decode_scheduled_ns = event.time_ns
            return [] if request.prefill_scheduled and not request.kv_given_up else [event]
        if isinstance(event, Failed):
            del self._requests[event.request_id]
        if isinstance(event, Finished):
            event = replace(event, disaggregated=self._facts(request))
            request.samples_left -= 1
            if request.samples_left <= 0:
                del self._requests[event.request_id]
        return [event]

    def _facts(self, request: _Request) -> DisaggregatedFacts:
        received = request.kv_received_ns
        scheduled = request.decode_scheduled_ns
        return DisaggregatedFacts(
            prefill_instance=request.prefill if request.fallback is None else None,
            decode_instance=request.decode,
            kv_bytes=request.kv_bytes,
            kv_transfer_ns=request.kv_transfer_ns,
            decode_queue_ns=None if received is None or scheduled is None else scheduled - received,
            fallback=request.fallback,
        )

    def _on_note(self, note: KVNote) -> None:
        request = self._requests.get(note.request_id)
        if note.kind == "sent":
            self.counters["kv_handoffs_sent"] += 1
            self.counters["kv_bytes_sent"] += note.num_bytes
            if request is not None:
                request.kv_sent_ns = note.time_ns
        elif note.kind == "send_failed":
            self.counters["kv_send_failures"] += 1
            if request is not None:
                self._give_up_kv(request, note.reason)
        elif note.kind == "received":
            self.counters["kv_handoffs_received"] += 1
            if request is not None:
                request.kv_bytes = note.num_bytes
                request.kv_received_ns = note.time_ns
                request.kv_transfer_ns = note.time_ns - note.read_ns
        elif note.kind in ("fallback", "kv_failed"):  # by kv_load_failure_policy
            self.counters["kv_fallbacks" if note.kind == "fallback" else "kv_failures"] += 1
            if request is not None:
                request.fallback = note.reason

    def _give_up_kv(self, request: _Request, reason: str) -> None:
        """Tell the decode instance to go without the request's K/V (kv_load_failure_policy),
        and abort the prefill instance's copy."""
        if request.kv_given_up or request.kv_received_ns is not None:
            return
        request.kv_given_up = True
        self._decodes[request.decode].send(("nokv", request.request_id, reason))
        if request.prefill is not None:
            self._prefills[request.prefill].send(("abort", request.request_id))

    def _time_out_silent_instances(self) -> list[RequestEvent]:
        """The router's clock on the instances (kv_transfer_timeout_s): a prefill instance
        that owes K/V and says nothing for that long is hung, and so are K/V sent and not
        received in that time; a decode instance silent for 4 times that while it has requests
        to run is hung too."""
        now, timeout = now_ns(), int(self.config.kv_transfer_timeout_s * 1e9)
        events: list[RequestEvent] = []
        for request in list(self._requests.values()):
            sent = request.kv_sent_ns
            if sent is not None and request.kv_received_ns is None and now - sent > timeout:
                self._give_up_kv(request, self._late("were sent but not received"))
        for instance in [i for i in self.instances if i.alive]:
            owed = [
                r
                for r in self._requests.values()
                if (_prefilling if instance.role == PREFILL else _running_on)(r, instance)
            ]
            if not owed:
                continue
            limit = timeout * (1 if instance.role == PREFILL else _DECODE_SILENCE_FACTOR)
            quiet_since = max(instance.last_heard_ns, min(r.routed_ns for r in owed))
            if now - quiet_since <= limit:
                continue
            silent = f"said nothing for {(now - quiet_since) / 1e9:.1f} s"
            if instance.role == DECODE:
                events += self._lost(instance, f"{silent}; killed")
                continue
            if instance.unresponsive is None:
                self.counters["prefill_instances_unresponsive"] += 1
            instance.unresponsive = f"{instance.name} {silent}"
            for request in owed:
                self._give_up_kv(request, self._late(f"did not come: {instance.name} {silent}"))
        return events

    def _late(self, what: str) -> str:
        return (
            f"the K/V {what} (engine.kv_transfer_timeout_s={self.config.kv_transfer_timeout_s:g})"
        )

    def _lost(self, instance: InstanceProcess, how: str) -> list[RequestEvent]:
        """An instance that died or hung: its prefills are computed where they decode; a lost
        decode instance fails its requests, and the engine if it was the last."""
        instance.kill()
        reason = f"{instance.name} {how}"
        self.counters[f"{instance.role}_instances_lost"] += 1
        now, events = now_ns(), list[RequestEvent]()
        for request in list(self._requests.values()):
            if instance.role == PREFILL and request.prefill == instance.index:
                self._give_up_kv(request, reason)
            elif instance.role == DECODE and request.decode == instance.index:
                del self._requests[request.request_id]
                events.append(Failed(request.request_id, self.step_counter, now, reason))
        if not any(d.alive for d in self._decodes):
            self.failure = f"no decode instance is left: {reason}"
            end_instances(self.instances, None, None)
        return events

    # ---- lifetime ---------------------------------------------------------------------------

    def ensure_open(self) -> None:
        self._ensure_not_closed()
        if self.failure is not None:
            raise EngineDeadError(self.failure)

    def _ensure_not_closed(self) -> None:
        if self.closed:
            raise EngineClosedError(
                "the engine is closed (close(), or the end of its `with` block); build a new "
                "LLM to generate again"
            )

    def close(self) -> None:
        """End every instance (asked to leave, killed if it does not) and clear the
        connector's files. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()


def _least_loaded(
    instances: list[InstanceProcess],
    requests: Iterable[_Request],
    on: Callable[[_Request, InstanceProcess], bool],
) -> InstanceProcess:
    """The live instance with the fewest requests `on` it."""
    live = [i for i in instances if i.alive]
    counts = Counter(i.index for r in requests for i in live if on(r, i))
    return min(live, key=lambda instance: counts[instance.index])


def _prefilling(request: _Request, instance: InstanceProcess) -> bool:
    """The request waits for this prefill instance: its K/V are neither sent nor given up."""
    return (
        request.prefill == instance.index and request.kv_sent_ns is None and not request.kv_given_up
    )


def _decoding(request: _Request, instance: InstanceProcess) -> bool:
    return request.decode == instance.index


def _running_on(request: _Request, instance: InstanceProcess) -> bool:
    """The decode instance has this request to run (not one still waiting for K/V)."""
    started = request.prefill is None or request.kv_received_ns is not None
    return _decoding(request, instance) and (started or request.kv_given_up)


def _refuse_windows(config: EngineConfig, model: ModelConfig) -> None:
    """A windowed layer's blocks out of its window are released while a prompt is computed:
    they cannot be handed over."""
    windowed = [i for i in range(model.num_layers) if model.layer_window(i) is not None]
    if windowed:
        raise ConfigError(
            f"engine.disaggregation={config.disaggregation!r}: {config.model} keeps a sliding "
            f"window in {len(windowed)} layers, whose blocks out of the window are released "
            "before its K/V could be handed over; allowed with it: none"
        )
