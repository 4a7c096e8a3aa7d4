"""What a run is doing, on stderr, so that a cold start is never silence: one line per phase
(loading, warm-up, running), then request progress: a tqdm bar on a terminal, and elsewhere
(make, CI logs, a pipe) a plain line every `interval_s` seconds."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class RunProgress:
    def __init__(
        self, enabled: bool, label: str = "", interval_s: float = 5.0, stream: TextIO | None = None
    ) -> None:
        self.enabled = enabled
        self.label = label
        self.interval_s = interval_s
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty()
        self._bar: tqdm | None = None
        self._total = self._done = 0
        self._started = self._last_line = 0.0

    def phase(self, message: str) -> None:
        if self.enabled:
            print(f"{self.label}{message}", file=self.stream, flush=True)

    def start_requests(self, total: int) -> None:
        self._total, self._done = total, 0
        self._started = self._last_line = time.monotonic()
        if not self.enabled:
            return
        if self.terminal:
            self._bar = tqdm(
                total=total, desc="requests", unit="req", delay=2.0, leave=False, file=self.stream
            )
        else:
            self.phase(f"running {total} requests")

    def request_done(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update()
            return
        if not self.enabled or self.terminal:
            return
        now = time.monotonic()
        if now - self._last_line >= self.interval_s:
            self._last_line = now
            self.phase(f"requests {self._done}/{self._total} done, {now - self._started:.0f} s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
