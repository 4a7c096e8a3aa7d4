"""One instance of a disaggregated engine: a process of its own (started by router.py) that
runs a plain LLMEngine in one role.

- prefill: runs each request to its first token with `export_kv`, then hands the prompt's K/V
  to the decode instance the router named, on a sender thread (the step loop goes on).
- decode: holds each request until its K/V arrive (SGLang's and vLLM's "waiting for remote
  KVs"), then admits it with them: only the last prompt token is computed, to sample. When
  the router says they will not come ("nokv": a prefill instance hung, died or could not
  send; the router keeps the time), `kv_load_failure_policy` applies: `recompute` (the
  prompt is prefilled here, counted as a fallback) or `fail` (the request fails, with the
  reason).

Between steps the instance reads the router's messages and answers with an update: the step's
events, its step records, its K/V notes and its gauges.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import traceback
from multiprocessing.connection import Connection, wait
from queue import Empty, Queue
from typing import Any

from engines.base import Failed, Finished, RequestEvent, StepRecord, now_ns
from engines.builtin.config import EngineConfig
from engines.builtin.disaggregation.connectors import (
    KV_CONNECTORS,
    ConnectorClosedError,
    KVConnector,
)
from engines.builtin.disaggregation.messages import (
    PREFILL,
    InstanceRequest,
    InstanceSpec,
    KVHandoff,
    KVNote,
)
from engines.builtin.engine import LLMEngine

#: How long an idle instance waits for news (a message, a hand-off: either wakes it sooner)
#: before it looks at its early hand-offs' deadlines again.
_IDLE_POLL_S = 0.5


class Instance:
    def __init__(self, spec: InstanceSpec, control: Connection) -> None:
        self.spec, self.control = spec, control
        if spec.cores is not None:
            os.sched_setaffinity(0, spec.cores)
        self.engine = LLMEngine(EngineConfig.from_dict(spec.config))
        self.records: list[StepRecord] = []
        self.engine.step_observers.append(self.records.append)
        kind = KV_CONNECTORS.get(spec.connector)
        self.connector: KVConnector = kind.open(
            spec.links, spec.role, spec.index, spec.num_prefill, spec.num_decode
        )
        self.notes: Queue[KVNote] = Queue()  # from the sender thread too
        self.events: list[RequestEvent] = []  # made here, between steps
        # prefill: (decode instance, hand-off) for the sender thread
        self.outbox: Queue[tuple[int, KVHandoff] | None] = Queue()
        self.decodes: dict[str, tuple[int, list[int]]] = {}  # where each prompt's K/V go
        # decode: hand-offs from the receiver thread; requests waiting for theirs; hand-offs
        # that came before their request (dropped after the timeout: it was aborted)
        self.arrived: Queue[KVHandoff] = Queue()
        self.waiting: dict[str, InstanceRequest] = {}
        self.early: dict[str, tuple[KVHandoff, int]] = {}
        self.timeout_ns = int(spec.kv_transfer_timeout_s * 1e9)
        self.connector_error: str | None = None  # the K/V thread's, which ends the instance
        # the K/V thread wakes the loop when it has news (a hand-off in, a note)
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        worker = self._send_loop if spec.role == PREFILL else self._receive_loop
        threading.Thread(target=worker, daemon=True, name=f"kv-{spec.role}").start()

    # ---- the loop ---------------------------------------------------------------------------

    def serve(self) -> None:
        engine = self.engine
        self.control.send(
            (
                "ready",
                {
                    "describe": engine.describe(),
                    "limits": engine.limits,
                    "sample_vocab_size": engine.runner.sample_vocab_size,
                    "address": self.connector.address(),
                    "pid": os.getpid(),
                    "cores": sorted(os.sched_getaffinity(0)),
                },
            )
        )
        while True:
            idle = 0.0 if engine.has_unfinished_requests() else _IDLE_POLL_S
            ready = wait([self.control, self._wake_in], idle)
            if self.control in ready and not self._take_messages():
                return
            self._drain_wakes()
            if self.connector_error is not None:
                raise RuntimeError(self.connector_error)
            self._take_arrivals()
            self._expire_early()
            events = self.events + (engine.step() if engine.has_unfinished_requests() else [])
            self.events = []
            if self.spec.role == PREFILL:
                self._hand_over(events)
            notes = self._drain_notes()
            if events or self.records or notes:
                self.control.send(("update", events, self.records, notes, engine.gauges()))
                self.records.clear()  # sent (pickled) already; the observer keeps this list

    def _take_messages(self) -> bool:
        """The router's messages so far; False once it says close."""
        while self.control.poll(0):
            message = self.control.recv()
            kind = message[0]
            if kind == "close":
                return False
            if kind == "peers":
                self.connector.connect(message[1])
            elif kind == "add":
                self._add(message[1])
            elif kind == "abort":
                self._abort(message[1])
            elif kind == "nokv":
                _, request_id, reason = message
                waiting = self.waiting.pop(request_id, None)
                if waiting is not None:
                    self._admit(waiting, None, reason)
            else:
                raise ValueError(f"unknown message {kind!r} from the router")
        return True

    # ---- requests ---------------------------------------------------------------------------

    def _add(self, request: InstanceRequest) -> None:
        if request.export_kv:
            self.decodes[request.request_id] = (request.decode, request.token_ids)
        if not request.expects_kv:
            self._start(request)
            return
        early = self.early.pop(request.request_id, None)
        if early is not None:
            self._admit(request, early[0], None)
        else:  # until its K/V come, or the router says they will not ("nokv")
            self.waiting[request.request_id] = request

    def _start(self, request: InstanceRequest, remote_kv: Any = None) -> bool:
        try:
            self.engine.add_request(
                request.request_id,
                request.token_ids,
                request.sampling,
                request.arrival_ns,
                request.priority,
                export_kv=request.export_kv,
                remote_kv=remote_kv,
            )
        except ValueError as exc:
            self._fail(request.request_id, str(exc))
            return False
        return True

    def _fail(self, request_id: str, reason: str) -> None:
        self.events.append(Failed(request_id, self.engine.step_counter, now_ns(), reason))

    def _abort(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        self.early.pop(request_id, None)
        self.decodes.pop(request_id, None)
        if self.engine.has_request(request_id):
            self.engine.abort_request(request_id)
        self.engine.take_exported_kv(request_id)

    # ---- decode: K/V in ---------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while True:
            try:
                self.arrived.put(self.connector.receive())
            except ConnectorClosedError:
                return
            except Exception as exc:  # the links broke: the router must know this instance
                connector = self.spec.connector
                self.connector_error = (
                    f"receiving K/V failed (engine.kv_connector={connector}): "
                    f"{type(exc).__name__}: {exc}"
                )
                self._wake()
                return
            self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # its buffer is full: the loop is awake anyway
            self._wake_out.send(b"!")

    def _drain_wakes(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_in.recv(4096):
                pass

    def _take_arrivals(self) -> None:
        while True:
            try:
                handoff = self.arrived.get_nowait()
            except Empty:
                return
            waiting = self.waiting.pop(handoff.request_id, None)
            if waiting is None:  # its request is not here yet (or was aborted)
                self.early[handoff.request_id] = (handoff, now_ns() + self.timeout_ns)
            else:
                self._admit(waiting, handoff, None)

    def _expire_early(self) -> None:
        """K/V whose request never came (aborted on the way) are dropped after the timeout."""
        now = now_ns()
        for request_id, (_, deadline) in list(self.early.items()):
            if now > deadline:
                del self.early[request_id]

    def _admit(
        self, request: InstanceRequest, handoff: KVHandoff | None, reason: str | None
    ) -> None:
        """Start a decode request with the K/V that came, or without them (`reason`)."""
        if handoff is not None and handoff.token_ids != request.token_ids:
            handoff, reason = None, "the prefill instance's prompt tokens differ from these"
        if handoff is None:
            reason = reason or "no K/V"
            if self.spec.kv_load_failure_policy == "fail":
                self.notes.put(KVNote(request.request_id, "kv_failed", now_ns(), reason=reason))
                self._fail(
                    request.request_id,
                    f"KV transfer failed: {reason} (engine.kv_load_failure_policy=fail)",
                )
                return
            self.notes.put(KVNote(request.request_id, "fallback", now_ns(), reason=reason))
            self._start(request)
            return
        if self._start(request, handoff.payload):
            size = handoff.payload.numel()
            self.notes.put(
                KVNote(request.request_id, "received", handoff.received_ns, size, handoff.read_ns)
            )

    # ---- prefill: K/V out -------------------------------------------------------------------

    def _hand_over(self, events: list[RequestEvent]) -> None:
        """Each prompt prefilled this step: its K/V to the sender thread."""
        for event in events:
            if not isinstance(event, (Finished, Failed)):
                continue
            payload = self.engine.take_exported_kv(event.request_id)
            decode = self.decodes.pop(event.request_id, None)
            if payload is None or decode is None or isinstance(event, Failed):
                continue
            if event.finish_reason == "abort":  # the router gave up on these K/V
                continue
            decode_index, token_ids = decode
            handoff = KVHandoff(event.request_id, token_ids, payload, event.time_ns)
            self.outbox.put((decode_index, handoff))

    def _send_loop(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            decode, handoff = item
            try:
                self.connector.send(decode, handoff)
            except Exception as exc:
                reason = (
                    f"sending the K/V failed (engine.kv_connector={self.spec.connector}): "
                    f"{type(exc).__name__}: {exc}"
                )
                self.notes.put(KVNote(handoff.request_id, "send_failed", now_ns(), reason=reason))
            else:
                size = handoff.payload.numel()
                self.notes.put(KVNote(handoff.request_id, "sent", now_ns(), size))
            self._wake()

    def _drain_notes(self) -> list[KVNote]:
        notes = []
        while True:
            try:
                notes.append(self.notes.get_nowait())
            except Empty:
                return notes


def main(argv: list[str]) -> None:
    """The instance process: `argv` is the control socket's file descriptor."""
    control = Connection(int(argv[0]))
    try:
        spec: InstanceSpec = control.recv()
        instance = Instance(spec, control)
        instance.serve()
    except BaseException as exc:
        if not isinstance(exc, (EOFError, KeyboardInterrupt)):  # EOF: the router is gone
            said = f"{type(exc).__name__}: {exc}"
            try:
                control.send(("fatal", said, traceback.format_exc()))
            except OSError:
                print(
                    f"inferlab disaggregated instance (pid {os.getpid()}): {said}", file=sys.stderr
                )
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # the connector's threads and gloo's are not waited for
