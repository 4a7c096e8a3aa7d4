"""vLLM's profiler endpoints, `POST /start_profile` and `POST /stop_profile`: torch.profiler
around whatever the engine does in between, written as a Chrome trace (`.json.gz`, for
chrome://tracing or Perfetto) into the server's `profile_dir`, one file per session.

The engine steps on a thread of its own, and torch.profiler records the operators of the
thread that started it only (its callbacks are thread-local; measured: a profiler started on
the event loop saw none of the engine thread's `aten::mm`). So the profiler is started and
stopped on the engine thread, between steps, through the thread's command queue; the engine
then names each step's model execution `step:<phase>` in the trace, as under `profile=true`.
Stopping finishes the profiler on the engine thread (torch collects the events there); the
trace is written from a worker thread, so that neither the engine nor the event loop waits for
the file. With tensor parallelism, only rank 0 (the server's process) is profiled.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from torch.profiler import ProfilerActivity, profile

from engines.builtin.backend import EngineThread
from engines.builtin.engine import LLMEngine
from serving.protocol import APIError

logger = logging.getLogger("inferlab.serve")

#: How long a shutdown waits for the engine thread to stop a running profiler.
SHUTDOWN_STOP_TIMEOUT_S = 30.0


@dataclass
class _Session:
    prof: profile
    trace: Path
    started: float  # time.monotonic()
    start_step: int  # the engine's step counter when it started


def not_enabled() -> APIError:
    """What the endpoints answer on a server started without `profile_dir` (vLLM has no such
    routes without VLLM_TORCH_PROFILER_DIR: 404)."""
    return APIError(
        "The profiler is not enabled on this server; start it with profile_dir=PATH (vLLM: "
        "VLLM_TORCH_PROFILER_DIR) to use POST /start_profile and POST /stop_profile",
        None,
        "profiler_not_enabled",
        404,
    )


def refuse_cross_origin(origin: str | None, host: str | None) -> None:
    """The endpoints take no body, so a web page can POST to them without a CORS preflight,
    and a server on localhost is in reach of every page its user opens. Browsers name the
    page's origin in `Origin`; command-line clients (vllm bench, the harness) send none. A
    request from a page of another origin is refused (403). So is one whose origin matches a
    `Host` that is a name other than localhost: a page of evil.example whose name the attacker
    then points at 127.0.0.1 (DNS rebinding) is of the same origin as the server it reaches.
    An IP address or localhost cannot be re-pointed, and this server serves no pages."""
    netloc = urlsplit(origin).netloc if origin is not None else None
    if origin is None or (netloc == (host or "") and not _rebindable(netloc)):
        return
    raise APIError(
        f"The profiler endpoints refuse requests from web pages of other origins (Origin: "
        f"{origin}, Host: {host}); call them from a command-line client",
        None,
        "cross_origin_refused",
        403,
    )


def _rebindable(netloc: str) -> bool:
    """Whether a host name could be made to point at this server (DNS rebinding)."""
    name = urlsplit(f"//{netloc}").hostname
    if name is None or name == "localhost":
        return name is None
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return True
    return False


class EngineProfiler:
    """One profiling session at a time, on the engine thread; its state lives on the event
    loop (the endpoints), so start and stop need no lock beyond `_busy`, which refuses a
    second call while one waits for the engine thread."""

    def __init__(self, engine_thread: EngineThread, out_dir: Path, cuda: bool) -> None:
        self.engine_thread = engine_thread
        self.out_dir = out_dir
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._session: _Session | None = None
        self._busy = False
        self._count = 0

    @property
    def running(self) -> bool:
        return self._session is not None

    def _check_idle(self) -> None:
        if self._busy:
            raise APIError(
                "A profiler start or stop is in progress; retry when it answers",
                None,
                "profiler_busy",
                409,
            )

    async def start(self) -> dict[str, Any]:
        self._check_idle()
        if self._session is not None:
            raise APIError(
                f"The profiler is already running (for {self._age():.1f} s; its trace goes to "
                f"{self._session.trace}); POST /stop_profile first",
                None,
                "profiler_already_running",
                409,
            )
        self._busy = True
        try:
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise APIError(
                    f"profile_dir: cannot create {self.out_dir}: {exc.strerror}",
                    None,
                    "profiler_failed",
                    500,
                    "server_error",
                ) from None
            prof = profile(activities=self.activities)

            def start_on_engine_thread(engine: LLMEngine) -> int:
                prof.start()
                return engine.step_counter

            try:
                step = await asyncio.wrap_future(self.engine_thread.call(start_on_engine_thread))
            except RuntimeError as exc:  # torch: a profiler already runs on that thread
                raise APIError(
                    f"cannot start the profiler: {exc}",
                    None,
                    "profiler_failed",
                    500,
                    "server_error",
                ) from None
            self._count += 1
            stamp = time.strftime("%Y%m%d-%H%M%S")
            trace = self.out_dir / f"trace-{stamp}-{os.getpid()}-{self._count}.json.gz"
            self._session = _Session(prof, trace, time.monotonic(), step)
        finally:
            self._busy = False
        logger.info("profiler started; POST /stop_profile writes %s", trace)
        return {"status": "profiling", "trace": str(trace)}

    async def stop(self) -> dict[str, Any]:
        self._check_idle()
        session = self._session
        if session is None:
            raise APIError(
                "The profiler is not running; POST /start_profile first",
                None,
                "profiler_not_running",
                409,
            )
        self._busy = True
        try:
            steps = await asyncio.wrap_future(
                self.engine_thread.call(lambda engine: _stop(session.prof, engine))
            )
            self._session = None
            seconds = time.monotonic() - session.started
            try:
                await asyncio.to_thread(session.prof.export_chrome_trace, str(session.trace))
            except OSError as exc:
                raise APIError(
                    f"the profile was taken but its trace could not be written to "
                    f"{session.trace}: {exc.strerror or exc}",
                    None,
                    "profiler_failed",
                    500,
                    "server_error",
                ) from None
        finally:
            self._busy = False
        logger.info("profiler stopped: %s (%.1f s, %d engine steps)", session.trace, seconds, steps)
        return {
            "status": "stopped",
            "trace": str(session.trace),
            "seconds": round(seconds, 3),
            "engine_steps": steps - session.start_step,
        }

    def close(self) -> Path | None:
        """At shutdown (the engine thread still running): a profile still running is stopped
        and its trace written, so that the session is not lost; the trace's path, or None."""
        session, self._session = self._session, None
        if session is None:
            return None
        try:
            self.engine_thread.call(lambda engine: _stop(session.prof, engine)).result(
                SHUTDOWN_STOP_TIMEOUT_S
            )
            session.prof.export_chrome_trace(str(session.trace))
        except Exception as exc:  # shutting down: say so, never fail the shutdown
            logger.warning(
                "shutting down while profiling: the trace was discarded (%s: %s)",
                type(exc).__name__,
                exc,
            )
            return None
        logger.warning("shutting down while profiling: trace written to %s", session.trace)
        return session.trace

    def _age(self) -> float:
        return 0.0 if self._session is None else time.monotonic() - self._session.started


def _stop(prof: profile, engine: LLMEngine) -> int:
    """On the engine thread: stop the profiler (torch collects its events here); the engine's
    step counter."""
    prof.stop()
    return engine.step_counter
