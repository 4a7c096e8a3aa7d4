"""Trace replay: real arrival times and token lengths from a trace file, synthetic prompts.

Selection: rows whose time since the trace's first row t lies in [start_s, end_s) (before
scaling), then the first num_requests of those; the file is read only as far as that
selection reaches (workloads/traces.py), so `info` counts the rows read. Request i arrives at
(t_i - t_first) / time_scale, where t_first is the first selected row's time, so the run starts
with its first request and time_scale = 10 replays ten times faster. The replay is an open
loop; `max_concurrency` caps the requests in flight as it does for an arrival process
(workloads/arrivals.py): a request arriving while that many are in flight waits for one.

Lengths: max(1, round(length * scale)), then max_input_len / max_output_len, then the
context clipping rule of workloads/lengths.py.

Mooncake: each hash id names a block of block_len = max(1, round(512 * input_scale)) tokens,
drawn from a generator seeded by (seed, hash id) alone, so equal leading hash ids give equal
leading tokens. A prompt is its blocks in order truncated to its (scaled, clipped) input
length; when rounding leaves the blocks short, the tail is filled with the request's own
tokens. `prefix_group` is the first hash id.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.tokenizer import Tokenizer
from workloads.base import WorkloadBase
from workloads.common import (
    MAX_ARRIVAL_S,
    arrivals_too_late,
    check_choice,
    check_common,
    check_int,
    check_number,
    invalid,
    resolve_path,
    rng_streams,
)
from workloads.lengths import clip_to_context
from workloads.prompts import PROMPT_KINDS, BlockTokens, TokenSource, tokenizer_or_default
from workloads.request import WorkloadRequest
from workloads.traces import (
    MAX_TOKENS,
    MOONCAKE_BLOCK,
    TRACE_FORMATS,
    Trace,
    load_trace,
    parse_columns,
)


@dataclass
class TraceWorkload(WorkloadBase):
    path: str | None = None  # required
    format: str = "azure"
    num_requests: int | None = None  # None: every row in the window
    time_scale: float = 1.0  # speed-up factor
    start_s: float = 0.0  # window on the trace's own clock, before scaling
    end_s: float | None = None
    # the open loop's cap on the requests in flight (workloads/arrivals.py); None: no cap
    max_concurrency: int | None = None
    input_scale: float = 1.0
    output_scale: float = 1.0
    max_input_len: int | None = None
    max_output_len: int | None = None
    prompt: str = "random_ids"
    corpus: str | None = None  # text file for prompt=text; default: the shipped sonnets
    columns: dict[str, Any] | None = None  # csv/jsonl: {timestamp, input_len, output_len, ...}
    id_prefix: str = "trace"

    @property
    def concurrency(self) -> int | None:
        return None  # a trace is open-loop: its timestamps are the arrival process

    def validate(self) -> TraceWorkload:
        if self.path is None or self.path == "???":
            raise invalid("path", self.path, "a trace file path (required)")
        resolve_path("path", self.path)
        check_choice("format", self.format, TRACE_FORMATS)
        if self.format in ("csv", "jsonl"):
            parse_columns("columns", self.columns or {})
        elif self.columns:
            raise invalid(
                "columns", self.columns, f"null for format {self.format} (its columns are fixed)"
            )
        check_int("num_requests", self.num_requests, 0, allow_none=True)
        for name in ("time_scale", "input_scale", "output_scale"):
            check_number(name, getattr(self, name), 0.0, strict=True)
        check_number("start_s", self.start_s, 0.0)
        end = check_number("end_s", self.end_s, 0.0, allow_none=True)
        if end is not None and end <= self.start_s:
            raise invalid("end_s", self.end_s, f"null or a number > start_s ({self.start_s})")
        check_int("max_concurrency", self.max_concurrency, 1, allow_none=True)
        check_int("max_input_len", self.max_input_len, 1, allow_none=True)
        check_int("max_output_len", self.max_output_len, 1, allow_none=True)
        check_choice("prompt", self.prompt, PROMPT_KINDS)
        if self.corpus is not None:
            resolve_path("corpus", self.corpus)
        check_common(self)
        return self

    def _select(self, trace: Trace) -> np.ndarray:
        """Indices of the selected rows of the trace (which is read only as far as they go)."""
        rows = np.arange(len(trace))
        if trace.timestamps_s is not None and trace.first_timestamp_s is not None:
            since = trace.timestamps_s - trace.first_timestamp_s
            inside = since >= self.start_s
            if self.end_s is not None:
                inside &= since < self.end_s
            rows = rows[inside]
            if not len(rows) and self.num_requests != 0:
                where = (
                    f"the trace spans 0 to {_span(trace):.3f} s"
                    if trace.read_to_end
                    else "no usable row of the trace lies in it"
                )
                raise invalid(
                    "start_s",
                    self.start_s,
                    f"a window [start_s, end_s) that holds rows (end_s={self.end_s}; {where})",
                )
        return rows if self.num_requests is None else rows[: self.num_requests]

    def build(
        self, tokenizer: Tokenizer | None = None, context_len: int | None = None
    ) -> list[WorkloadRequest]:
        self.validate()
        tok = tokenizer_or_default(tokenizer)
        path = resolve_path("path", self.path)
        trace = self._load(path)
        selected = self._select(trace)
        (prompt_rng,) = rng_streams(self.seed, 1)
        lengths = self._lengths(trace, selected, context_len)
        arrivals = self._arrivals(trace, selected, path)
        source = TokenSource(
            tok,
            self.prompt,
            resolve_path("corpus", self.corpus) if self.corpus is not None else None,
        )
        block_len = max(1, round(MOONCAKE_BLOCK * self.input_scale))
        blocks = BlockTokens(source, self.seed, block_len) if self.format == "mooncake" else None
        requests = [
            self._request(
                f"{self.id_prefix}-{i}",
                source.render(ids),
                int(lengths.inputs[i]),
                int(lengths.outputs[i]),
                float(arrivals[i]),
                prefix_group=group,
            )
            for i, (ids, group) in enumerate(
                self._prompts(trace, selected, lengths.inputs, source, blocks, prompt_rng)
            )
        ]
        self.info = {
            "type": "trace",
            "path": str(path),
            "format": self.format,
            "prompt": self.prompt,
            "tokenizer": tok.name,
            "rows_read": trace.rows_read,
            "rows_skipped": dict(trace.skipped),
            "rows_usable": len(trace),
            "read_to_end": trace.read_to_end,
            "requests": len(selected),
            "trace_span_s": _span(trace) if trace.read_to_end else None,
            "window_s": [self.start_s, self.end_s],
            "time_scale": self.time_scale,
            "input_scale": self.input_scale,
            "output_scale": self.output_scale,
            "clipped_max_input_len": lengths.clipped_in,
            "clipped_max_output_len": lengths.clipped_out,
            "block_len": block_len if blocks is not None else None,
            **self._totals(arrivals, lengths.inputs, lengths.outputs),
            **lengths.clip_info,
            **self._cancel(requests),
        }
        return requests

    def _load(self, path: Path) -> Trace:
        """The trace, read as far as the selection reaches; refused when it has no usable row."""
        generic = self.format in ("csv", "jsonl")
        columns = parse_columns("columns", self.columns or {}) if generic else None
        if (
            columns is not None
            and columns["timestamp"] is None
            and (self.start_s or self.end_s is not None)
        ):
            raise invalid(
                "start_s", self.start_s, "0 with end_s null (this trace has no timestamp column)"
            )
        trace = load_trace(
            path,
            self.format,
            columns,
            start_s=self.start_s,
            end_s=self.end_s,
            limit=self.num_requests,
        )
        if not len(trace) and self.num_requests != 0 and trace.read_to_end:
            raise invalid(
                "path",
                str(path),
                f"a trace with usable rows ({trace.rows_read} read, skipped: {trace.skipped})",
            )
        return trace

    def _lengths(self, trace: Trace, selected: np.ndarray, context_len: int | None) -> _Lengths:
        """The selected rows' lengths: scaled, capped by max_input_len / max_output_len, then
        clipped to the context."""
        inputs = _scaled("input_scale", trace.input_lens[selected], self.input_scale)
        outputs = _scaled("output_scale", trace.output_lens[selected], self.output_scale)
        clipped_in = clipped_out = 0
        if self.max_input_len is not None:
            clipped_in = int((inputs > self.max_input_len).sum())
            inputs = np.minimum(inputs, self.max_input_len)
        if self.max_output_len is not None:
            clipped_out = int((outputs > self.max_output_len).sum())
            outputs = np.minimum(outputs, self.max_output_len)
        inputs, outputs, clip_info = clip_to_context(inputs, outputs, context_len)
        return _Lengths(inputs, outputs, clipped_in, clipped_out, clip_info)

    def _arrivals(self, trace: Trace, selected: np.ndarray, path: Path) -> np.ndarray:
        """The selected rows' arrival times, from the first one's and sped up by time_scale
        (all at 0 without timestamps); refused when one lies beyond MAX_ARRIVAL_S."""
        if trace.timestamps_s is None or not len(selected):
            return np.zeros(len(selected))
        times = trace.timestamps_s[selected]
        arrivals = (times - times[0]) / self.time_scale
        late = arrivals_too_late(arrivals)
        if late is not None:
            raise invalid(
                "path",
                str(path),
                f"a trace whose selected rows arrive within {MAX_ARRIVAL_S:.0e} s of the "
                f"first after time_scale ({self.time_scale}); line "
                f"{int(trace.lines[selected[late]])} arrives {arrivals[late]:.3g} s after it",
            )
        return arrivals

    @staticmethod
    def _prompts(
        trace: Trace,
        selected: np.ndarray,
        inputs: np.ndarray,
        source: TokenSource,
        blocks: BlockTokens | None,
        rng: np.random.Generator,
    ) -> Iterator[tuple[np.ndarray, str | None]]:
        """Each selected row's prompt token ids and prefix group: its Mooncake blocks (the
        group is the first hash id), or the source's tokens (no group)."""
        for i, row in enumerate(selected.tolist()):
            own = int(inputs[i])
            if blocks is None:
                yield source.tokens(own, rng), None
                continue
            hash_ids = trace.hash_ids(row)
            yield blocks.prompt(hash_ids, own, rng), str(hash_ids[0]) if hash_ids else None


@dataclass(frozen=True)
class _Lengths:
    inputs: np.ndarray
    outputs: np.ndarray
    clipped_in: int  # rows cut to max_input_len
    clipped_out: int  # rows cut to max_output_len
    clip_info: dict[str, Any]  # clip_to_context's counts


def _scaled(field_name: str, lengths: np.ndarray, scale: float) -> np.ndarray:
    scaled = np.maximum(np.rint(np.asarray(lengths, dtype=float) * scale), 1)
    if len(scaled) and scaled.max() > MAX_TOKENS:
        raise invalid(
            field_name,
            scale,
            f"a scale that keeps every length within {MAX_TOKENS} "
            f"tokens (a length of {int(lengths[int(np.argmax(scaled))])} becomes "
            f"{scaled.max():.0f})",
        )
    return scaled.astype(np.int64)


def _span(trace: Trace) -> float | None:
    if trace.first_timestamp_s is None or trace.last_timestamp_s is None:
        return None
    return trace.last_timestamp_s - trace.first_timestamp_s
