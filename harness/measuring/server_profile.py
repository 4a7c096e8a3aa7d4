"""`profile=true` with a server backend (engine=openai): the server profiles itself.

vLLM (started with VLLM_TORCH_PROFILER_DIR) and `inferlab serve` (with `profile_dir=`) answer
`POST /start_profile` and `POST /stop_profile` by running torch.profiler around their engine;
the trace stays on the server's machine. This calls them around the measured requests and
records what the server said; a server that refuses leaves the run going, with the refusal in
summary.json's `profile`.
"""

from __future__ import annotations

from typing import Any

import httpx

from engines.base import Backend

#: stopping writes the trace, which takes a server seconds for a busy window
TIMEOUT_S = 120.0


class ServerProfiler:
    """The StepProfiler's interface (attach, finish) over a server's profiler endpoints."""

    def __init__(self, root: str, timeout_s: float = TIMEOUT_S) -> None:
        self.root = root
        self.timeout_s = timeout_s
        self.started = False
        self.info: dict[str, Any] = {"server": root}

    def _post(self, endpoint: str) -> tuple[bool, str]:
        try:
            response = httpx.post(f"{self.root}/{endpoint}", timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            return False, f"{type(exc).__name__}: {exc}"
        body = response.text.strip()[:2000]
        return response.is_success, f"HTTP {response.status_code}" + (f": {body}" if body else "")

    def attach(self, target: Backend | list[Any], cuda: bool = False) -> None:
        self.started, said = self._post("start_profile")
        self.info["start_profile"] = said
        if not self.started:
            self.info["error"] = f"the server did not start profiling: {said}"

    def finish(self) -> dict[str, Any]:
        if self.started:
            stopped, said = self._post("stop_profile")
            self.info["stop_profile"] = said
            if not stopped:
                self.info["error"] = f"the server did not stop profiling: {said}"
        return self.info
