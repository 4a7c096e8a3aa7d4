"""The disaggregated engine (`engine.disaggregation=pd`): what `inferlab run` and `inferlab
serve` drive in place of an LLMEngine, with the same methods. It does no model work itself:

    add_request -> tokenize -> decode instance (waits for the K/V) + prefill instance (computes
    them, sends them over the connector) ... step -> the instances' updates -> events

Each request goes to the least loaded prefill and decode instances. Its events are merged into
one stream: the prefill instance's scheduling and prompt chunks, then the decode instance's
tokens; its Finished carries `DisaggregatedFacts` (where it ran, the hand-off's bytes and
time, and whether it had to be prefilled on the decode instance instead).

Faults end in an error or a counted fallback, never a hang:
- a decode instance that dies fails its requests, naming it; with none left the engine is
  dead (`failure`, EngineDeadError);
- a prefill instance that dies or hangs: its requests' decode instances prefill them
  themselves after `kv_transfer_timeout_s` at most (or fail them: `kv_load_failure_policy`),
  and the router sends it no more (a hung one again once it answers);
- closing, or the process's exit, ends every instance (killed if it does not leave).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
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
from engines.builtin.distributed.launch import CODE_ROOT
from engines.builtin.engine import EngineClosedError, EngineDeadError
from engines.builtin.limits import EngineLimits
from engines.builtin.platform import Platform, available_cpus
from engines.builtin.step_stats import EngineGauges
from engines.sampling_params import SamplingParams
from models.location import resolve_model
from models.tokenizer import tokenizer_for_model

#: An instance: this Python, then CODE_ROOT and its control socket's descriptor (`-c`, as the
#: tensor-parallel workers: no other copy of inferlab on the path is imported first).
INSTANCE_COMMAND = [
    sys.executable,
    "-c",
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from engines.builtin.disaggregation.instance import main; main(sys.argv[2:])",
]
#: How long the instances may take to load their engines.
STARTUP_TIMEOUT_S = 600.0
#: How long a step waits for the instances' news when it has none to give.
_POLL_S = 0.002
#: How long close() waits for an instance to leave before killing it.
_EXIT_GRACE_S = 5.0


@dataclass
class _Instance:
    role: str
    index: int
    process: subprocess.Popen[bytes]
    control: Connection
    alive: bool = True
    gauges: EngineGauges = field(default_factory=EngineGauges)
    facts: dict[str, Any] = field(default_factory=dict)
    last_heard_ns: int = 0
    unresponsive: str | None = None  # why the router sends it nothing now (a hung prefill)

    @property
    def name(self) -> str:
        return f"{self.role} instance {self.index} (pid {self.process.pid})"


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
        self.tokenizer = tokenizer_for_model(config.model, config.tokenizer)
        self.platform = Platform(torch.device("cpu"))  # the clock; the instances compute
        self.step_observers: list[StepObserver] = []
        self.step_counter = 0
        self.counters: Counter[str] = Counter()
        self._requests: dict[str, _Request] = {}
        self._pending_events: list[RequestEvent] = []
        kind = KV_CONNECTORS.get(config.kv_connector)
        self._links = kind.setup(config.num_prefill_instances, config.num_decode_instances)
        self.instances: list[_Instance] = []
        self._finalizer = weakref.finalize(
            self, _end_instances, self.instances, kind.cleanup, self._links
        )
        try:
            self._start_instances()
        except BaseException:
            self.close()
            raise
        decode = self._decodes[0].facts
        self.limits: EngineLimits = decode["limits"]

    # ---- instances --------------------------------------------------------------------------

    @property
    def _prefills(self) -> list[_Instance]:
        return [i for i in self.instances if i.role == PREFILL]

    @property
    def _decodes(self) -> list[_Instance]:
        return [i for i in self.instances if i.role == DECODE]

    def _start_instances(self) -> None:
        config = self.config
        roles = [(PREFILL, i) for i in range(config.num_prefill_instances)]
        roles += [(DECODE, i) for i in range(config.num_decode_instances)]
        threads, cores = _placement(len(roles), config.num_threads)
        colocated = replace(config, disaggregation="none", num_threads=threads).to_dict()
        for n, (role, index) in enumerate(roles):
            ours, theirs = socket.socketpair()
            process = subprocess.Popen(
                [*INSTANCE_COMMAND, CODE_ROOT, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
            )
            theirs.close()
            instance = _Instance(role, index, process, Connection(ours.detach()))
            self.instances.append(instance)
            instance.control.send(
                InstanceSpec(
                    role,
                    index,
                    colocated,
                    None if cores is None else tuple(cores[n * threads : (n + 1) * threads]),
                    config.kv_connector,
                    self._links,
                    config.num_prefill_instances,
                    config.num_decode_instances,
                    config.kv_transfer_timeout_s,
                    config.kv_load_failure_policy,
                )
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for instance in self.instances:
            instance.facts = self._await_ready(instance, deadline)
        addresses = [d.facts["address"] for d in self._decodes]
        for prefill in self._prefills:
            prefill.control.send(("peers", addresses))

    def _await_ready(self, instance: _Instance, deadline: float) -> dict[str, Any]:
        while not instance.control.poll(1.0):
            code = instance.process.poll()
            if code is not None:
                raise RuntimeError(f"{instance.name} exited with code {code} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{instance.name} did not start in {STARTUP_TIMEOUT_S:g} s")
        try:
            message = instance.control.recv()
        except EOFError:
            raise RuntimeError(f"{instance.name} exited while starting") from None
        if message[0] == "fatal":
            raise _startup_error(message[1], instance.name)
        return message[1]

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
        """The checks that need no engine; a decode instance makes the others when the request
        reaches it (a refusal there fails the request, with its reason)."""
        self._ensure_not_closed()
        sampling.validate()
        if not token_ids:
            raise ValueError("prompt: empty (it has no tokens)")
        if len(token_ids) >= self.limits.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens do not fit max_model_len="
                f"{self.limits.max_model_len} (at least one token must be generated)"
            )
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
        decode = _least_loaded(self._decodes, self._requests, "decode")
        prefill, fallback = self._pick_prefill(token_ids, sampling)
        request = _Request(
            request_id, len(token_ids), decode.index, prefill, now_ns(), sampling.n, fallback
        )
        if fallback is not None:
            self.counters["colocated_requests"] += 1
        self._requests[request_id] = request
        self._send(
            decode,
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
            self._send(
                self._prefills[prefill],
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
        return _least_loaded(ready, self._requests, "prefill").index, None

    def abort_request(self, request_id: str) -> None:
        self._ensure_not_closed()
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.prefill is not None:
            self._send(self._prefills[request.prefill], ("abort", request_id))
        self._send(self._decodes[request.decode], ("abort", request_id))

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
        self.step_counter += 1
        return events

    def _read(self, instance: _Instance) -> list[RequestEvent]:
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
                self._on_note(instance, note)
            for event in updates:
                events += self._route(instance, event)
        return events

    def _route(self, instance: _Instance, event: RequestEvent) -> list[RequestEvent]:
        """An instance's event as the request's one stream has it (or not at all)."""
        request = self._requests.get(event.request_id)
        if request is None:
            return []  # aborted: its last events are nobody's
        if instance.role == PREFILL:
            if isinstance(event, Scheduled):
                request.prefill_scheduled = True
                return [event]
            if isinstance(event, (PrefillChunk, Preempted)):
                return [event]
            if isinstance(event, Failed):
                reason = f"the prefill failed: {event.error}"
                self._send(self._decodes[request.decode], ("nokv", event.request_id, reason))
            return []  # its arrival (the router's), its one token, its end: not the request's
        if isinstance(event, (Arrived, Tokenized)):
            return []
        if isinstance(event, Scheduled) and request.decode_scheduled_ns is None:
            request.decode_scheduled_ns = event.time_ns
            return [] if request.prefill_scheduled else [event]
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

    def _on_note(self, instance: _Instance, note: KVNote) -> None:
        request = self._requests.get(note.request_id)
        if note.kind == "sent":
            self.counters["kv_handoffs_sent"] += 1
            self.counters["kv_bytes_sent"] += note.num_bytes
        elif note.kind == "send_failed":
            self.counters["kv_send_failures"] += 1
            if request is not None:
                self._send(self._decodes[request.decode], ("nokv", note.request_id, note.reason))
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
                self._suspect_prefill(request, note.reason)

    def _suspect_prefill(self, request: _Request, reason: str) -> None:
        """A prefill instance silent since this request went to it is sent no more until it
        answers again (a hung process: its decode side timed the request out)."""
        if request.prefill is None:
            return
        prefill = self._prefills[request.prefill]
        if prefill.alive and prefill.last_heard_ns < request.routed_ns:
            prefill.unresponsive = reason
            self.counters["prefill_instances_unresponsive"] += 1

    def _lost(self, instance: _Instance, how: str) -> list[RequestEvent]:
        """An instance that died: its prefills are computed where they decode; a dead decode
        instance fails its requests, and the engine if it was the last."""
        instance.alive = False
        _kill(instance.process)
        reason = f"{instance.name} {how}"
        self.counters[f"{instance.role}_instances_lost"] += 1
        now, events = now_ns(), list[RequestEvent]()
        for request in list(self._requests.values()):
            if instance.role == PREFILL and request.prefill == instance.index:
                if request.kv_received_ns is None:
                    self._send(self._decodes[request.decode], ("nokv", request.request_id, reason))
            elif instance.role == DECODE and request.decode == instance.index:
                del self._requests[request.request_id]
                events.append(Failed(request.request_id, self.step_counter, now, reason))
        if not any(d.alive for d in self._decodes):
            self.failure = f"no decode instance is left: {reason}"
            _end_instances(self.instances, None, None)
        return events

    def _send(self, instance: _Instance, message: tuple[Any, ...]) -> None:
        if not instance.alive:
            return
        with contextlib.suppress(OSError):  # it died: the next step reads its end
            instance.control.send(message)

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
    instances: list[_Instance], requests: dict[str, _Request], role: str
) -> _Instance:
    live = [i for i in instances if i.alive]

    def load(instance: _Instance) -> int:
        return sum(getattr(r, role) == instance.index for r in requests.values())

    return min(live, key=load)


def _placement(num_instances: int, num_threads: int | None) -> tuple[int, list[int] | None]:
    """Threads per instance, and the cores to pin them to in turn (None: not pinned, too few
    cores to give each its own). Without engine.num_threads the cores are shared out."""
    cores = sorted(os.sched_getaffinity(0))
    count, _ = available_cpus()
    threads = num_threads or max(1, count // num_instances)
    if threads * num_instances > len(cores):
        return threads, None
    return threads, cores


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


def _end_instances(instances: list[_Instance], cleanup: Any, links: Any) -> None:
    """Ask every live instance to leave, kill those that do not within the grace, and clear
    what the connector's setup left (a finalizer: it runs once, at close, collection or exit)."""
    for instance in instances:
        if instance.alive:
            with contextlib.suppress(OSError):
                instance.control.send(("close",))
    deadline = time.monotonic() + _EXIT_GRACE_S
    for instance in instances:
        with contextlib.suppress(subprocess.TimeoutExpired):
            instance.process.wait(max(0.0, deadline - time.monotonic()))
        _kill(instance.process)
        instance.alive = False
        instance.control.close()
    if cleanup is not None:
        cleanup(links)


def _startup_error(message: str, name: str) -> Exception:
    error = ConfigError if "engine." in message else RuntimeError
    return error(f"{name}: {message}")
