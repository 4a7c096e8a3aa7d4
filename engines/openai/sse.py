"""An incremental Server-Sent Events parser: bytes in, whole events out.

Follows the WHATWG event-stream rules: lines end in CRLF, LF or CR; `field: value` lines build
an event (one leading space after the colon is dropped); `data` lines are joined with "\\n"; a
blank line dispatches the event; lines starting with ":" are comments (keep-alive pings). Bytes
are split into lines before decoding, so a UTF-8 character cut between two network reads is
never garbled.

Two leniencies that real inference servers need: a field name the standard does not know is
kept (llama.cpp's server reports errors as an `error: {...}` line, not as `data`), and an event
still pending when the stream closes is returned by `close()` instead of being dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_KNOWN = ("event", "data", "id", "retry")


@dataclass
class SSEEvent:
    data: str = ""
    event: str = "message"
    id: str | None = None
    # fields outside the standard, e.g. {"error": "..."} from llama.cpp
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def is_done(self) -> bool:
        """OpenAI's end-of-stream sentinel, `data: [DONE]`."""
        return self.data.strip() == "[DONE]"


class SSEParser:
    """Feed it network reads with `feed`; it returns the events those bytes completed."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._extra: dict[str, str] = {}
        self._has_fields = False
        self._skip_lf = False  # the previous read ended in CR: a leading LF belongs to it

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        buffer = self._buffer + chunk
        events: list[SSEEvent] = []
        start = 0
        length = len(buffer)
        while start < length:
            lf = buffer.find(b"\n", start)
            cr = buffer.find(b"\r", start, lf if lf >= 0 else length)
            if cr >= 0:
                end, next_start = cr, cr + 1
                if next_start < length and buffer[next_start : next_start + 1] == b"\n":
                    next_start += 1
                elif next_start == length:
                    self._skip_lf = True
            elif lf >= 0:
                end, next_start = lf, lf + 1
            else:
                break
            event = self._line(buffer[start:end].decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
            start = next_start
        self._buffer = buffer[start:]
        return events

    def close(self) -> list[SSEEvent]:
        """The event the stream was still building when it closed, if any."""
        events = []
        if self._buffer:
            event = self._line(self._buffer.decode("utf-8", errors="replace"))
            self._buffer = b""
            if event is not None:
                events.append(event)
        if self._has_fields:
            events.append(self._dispatch())
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch() if self._has_fields else None
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        self._has_fields = True
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        elif name not in _KNOWN:
            self._extra[name] = value
        return None

    def _dispatch(self) -> SSEEvent:
        event = SSEEvent("\n".join(self._data), self._event or "message", self._id, self._extra)
        self._data, self._event, self._extra, self._has_fields = [], "", {}, False
        return event
