"""The tensor-parallel ranks as the model and the runner see them.

`TPGroup` is what the model calls: one all-reduce after each row-parallel layer and after the
vocabulary-parallel embedding, one gather of the LM head's vocabulary slices. It counts the time
and bytes of each, so every step reports what communication cost. Without a process group (one
rank, the usual case) they do nothing and cost nothing; a process group of one (the GPU check's
NCCL world of one) runs them for real. `ControlChannel` carries rank 0's messages (the engine
to build, each step's packed inputs) to the other ranks: one broadcast per step when the
message is small.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """A collective failed or timed out: a rank died, hung or lost its connection. The
    engine cannot go on (the ranks' states have diverged)."""


class TPGroup:
    """This rank's place among `size` tensor-parallel ranks, and the collectives over them."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        group: Any = None,
        describe_failure: Callable[[], str] | None = None,
        measure: bool = True,
    ) -> None:
        """`measure`: count each collective's time and bytes (rank 0, which reports steps;
        the other ranks would only pile up CUDA events nobody reads)."""
        self.rank, self.size, self.group = rank, size, group
        self.measure = measure
        # what the launcher knows about the other ranks when a collective fails (exit codes)
        self.describe_failure = describe_failure or (lambda: "")
        self.comm_ns = 0  # time in collectives since the last take_counters()
        self.comm_bytes = 0  # their payload: what this rank contributed to each
        self.comm_calls = 0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.group is None:  # checked outside the compiled-out part: one rank, no break
            return x
        return self._all_reduce(x)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` [..., n] concatenated along the last dimension, on rank 0 (None
        elsewhere): the LM head's vocabulary slices, for rank 0's sampler."""
        if self.group is None:
            return x
        return self._gather_last_dim(x)

    def keep_out_of_compiled_graphs(self) -> None:
        """Run the collectives outside torch.compile's graphs (engine.compile=true): traced,
        the counters (plain ints) become guards on their values, and every step would
        recompile the model until dynamo's limit, after which it runs eagerly. Wrapped here,
        not by decorators: torch.compiler.disable imports torch._dynamo (a second or more),
        which every process importing the engine would pay, compiled or not."""
        self._all_reduce = torch.compiler.disable(self._all_reduce)  # type: ignore[method-assign]
        self._gather_last_dim = torch.compiler.disable(self._gather_last_dim)  # type: ignore[method-assign]

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._timed(lambda: dist.all_reduce(x, group=self.group), x, "all-reduce")
        return x

    def _gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        self._timed(
            lambda: dist.gather(x, parts, dst=0, group=self.group), x, "gather of the logits"
        )
        return torch.cat(parts, dim=-1) if parts is not None else None

    def take_counters(self) -> tuple[int, int]:
        """(ns, bytes) of the collectives since the last call; on CUDA waits for their events."""
        if self._events:
            torch.cuda.synchronize()
            self.comm_ns += sum(int(a.elapsed_time(b) * 1e6) for a, b in self._events)
            self._events.clear()
        taken = self.comm_ns, self.comm_bytes
        self.comm_ns = self.comm_bytes = 0
        return taken

    def _timed(self, op: Callable[[], Any], x: torch.Tensor, what: str) -> None:
        self.comm_bytes += x.numel() * x.element_size()
        self.comm_calls += 1
        try:
            if not self.measure:
                op()
                return
            if x.is_cuda and not torch.cuda.is_current_stream_capturing():
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                op()
                end.record()
                self._events.append((start, end))
                return
            began = time.perf_counter_ns()
            op()
            self.comm_ns += time.perf_counter_ns() - began
        except RuntimeError as exc:  # gloo/NCCL: a peer closed the connection or timed out
            raise failure(f"tensor-parallel {what}", exc, self.describe_failure()) from exc


def failure(what: str, exc: BaseException, ranks: str) -> TensorParallelError:
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return TensorParallelError(f"{what} failed: {first}" + (f"; {ranks}" if ranks else ""))


#: A step's message fits this many bytes in most steps: one broadcast. A larger one (a long
#: prefill's token ids) takes a second broadcast of the rest.
FIRST_BROADCAST_BYTES = 16 << 10
#: How often rank 0 looks whether the ranks took a start-up message (what bounds Ctrl-C's delay)
POLL_S = 0.01
_LENGTH_BYTES = 8


class ControlChannel:
    """Rank 0's messages to the other ranks, pickled, over a gloo group (host memory whatever
    the device). The receivers wait without a deadline: an idle engine sends nothing. A sender
    that dies closes its connections, which ends the wait with an error. The sender waits at
    most `timeout_s` for every rank to take a message (gloo hands data over only to a rank
    that is receiving): a hung rank fails the send."""

    def __init__(
        self,
        rank: int,
        group: Any,
        describe_failure: Callable[[], str] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.rank, self.group = rank, group
        self.describe_failure = describe_failure or (lambda: "")
        self.timeout_s = timeout_s
        self._first = torch.zeros(FIRST_BROADCAST_BYTES, dtype=torch.uint8)
        self.last_ns = 0  # the last send's time and size, for the step's record
        self.last_bytes = 0

    def send(self, message: Any, timeout_s: float | None = None) -> None:
        """Send `message` to every other rank; `timeout_s` (default: the channel's) for a
        message the ranks take only after work of their own (loading their shards): that wait
        is a poll in Python, which Ctrl-C stops at once (a step's waits in C++, which is
        quicker, and which Ctrl-C reaches only when it ends)."""
        assert self.rank == 0, "only rank 0 sends"
        deadline = timedelta(seconds=self.timeout_s if timeout_s is None else timeout_s)
        poll = timeout_s is not None
        began = time.perf_counter_ns()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        body = len(data)
        first = self._first
        first[:_LENGTH_BYTES] = torch.tensor([body], dtype=torch.int64).view(torch.uint8)
        head = min(body, FIRST_BROADCAST_BYTES - _LENGTH_BYTES)
        first[_LENGTH_BYTES : _LENGTH_BYTES + head] = torch.frombuffer(
            bytearray(data[:head]), dtype=torch.uint8
        )
        self._broadcast(first, deadline, poll)
        if body > head:
            rest = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)
            self._broadcast(rest, deadline, poll)
        self.last_ns = time.perf_counter_ns() - began
        self.last_bytes = FIRST_BROADCAST_BYTES + max(0, body - head)

    def receive(self) -> Any:
        first = self._first
        self._broadcast(first)
        body = int(first[:_LENGTH_BYTES].view(torch.int64).item())
        head = min(body, FIRST_BROADCAST_BYTES - _LENGTH_BYTES)
        data = first[_LENGTH_BYTES : _LENGTH_BYTES + head].numpy().tobytes()
        if body > head:
            rest = torch.empty(body - head, dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def _broadcast(
        self, tensor: torch.Tensor, deadline: timedelta | None = None, poll: bool = False
    ) -> None:
        try:
            if deadline is None:  # a receiver: wait for as long as rank 0 is there
                dist.broadcast(tensor, src=0, group=self.group)
                return
            work = dist.broadcast(tensor, src=0, group=self.group, async_op=True)
            assert work is not None
            if poll:
                ends = time.monotonic() + deadline.total_seconds()
                while not work.is_completed():
                    if time.monotonic() > ends:
                        raise RuntimeError(
                            f"the ranks did not take the message within "
                            f"{deadline.total_seconds():g} s"
                        )
                    time.sleep(POLL_S)
            work.wait(timeout=deadline)
        except RuntimeError as exc:
            raise failure("tensor-parallel broadcast", exc, self.describe_failure()) from exc
