"""`profile=true` with a server backend (engine=openai): the server profiles itself.

vLLM (started with VLLM_TORCH_PROFILER_DIR) and `inferlab serve` (with `profile_dir=`) answer
`POST /start_profile` and `POST /stop_profile` by running torch.profiler around their engine;
the trace stays on the server's machine. This calls them around the measured requests and
records what the server said; a server that refuses leaves the run going, with the refusal in
summary.json's `profile`.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from engines.base import Backend

#: stopping writes the trace, which takes a server seconds for a busy window
TIMEOUT_S = 120.0
#: how much of an answer is kept (summary.json's `profile`)
MAX_ANSWER_CHARS = 2000


class ServerProfiler:
    """The StepProfiler's interface (attach, finish) over a server's profiler endpoints."""

    def __init__(self, root: str, timeout_s: float = TIMEOUT_S) -> None:
        self.root = root
        self.timeout_s = timeout_s
        self.started = False
        self.info: dict[str, Any] = {"server": root}

    def _post(self, endpoint: str) -> tuple[bool, str]:
        """POST the endpoint; whether it succeeded, and the answer in words. `timeout_s` bounds
        the whole exchange, not each read (httpx's timeout): an answer trickling in a byte at
        a time held the run before its first measured request for as long as the server
        went on; only the answer's first MAX_ANSWER_CHARS are read."""
        deadline = time.monotonic() + self.timeout_s
        url, body = f"{self.root}/{endpoint}", bytearray()
        try:
            with (
                httpx.Client() as client,
                client.stream("POST", url, timeout=self.timeout_s) as response,
            ):
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) >= MAX_ANSWER_CHARS * 4:  # enough for the kept characters
                        break
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout(
                            f"the answer took over {self.timeout_s:g} s", request=response.request
                        )
        except httpx.HTTPError as exc:
            return False, f"{type(exc).__name__}: {exc}"
        text = body.decode(response.encoding or "utf-8", errors="replace").strip()
        text = text[:MAX_ANSWER_CHARS]
        return response.is_success, f"HTTP {response.status_code}" + (f": {text}" if text else "")

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
