"""What the router and the instances send each other (pickled over their control connections),
and what a prefill instance hands a decode instance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engines.sampling_params import SamplingParams

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class InstanceSpec:
    """What an instance process is told when it connects: its role, its engine's options
    (EngineConfig.to_dict() of a colocated engine), its cores, how it reaches the others."""

    role: str
    index: int
    config: dict[str, Any]
    cores: tuple[int, ...] | None  # None: not pinned
    connector: str
    links: Any  # the connector's own setup, made by the router (connectors.py)
    num_prefill: int
    num_decode: int
    kv_transfer_timeout_s: float
    kv_load_failure_policy: str


@dataclass(frozen=True)
class InstanceRequest:
    """A request as one instance runs it. Prefill: `export_kv` set, sampling cut to one token,
    its K/V sent to decode instance `decode`. Decode: `expects_kv`, the K/V then wait for."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    arrival_ns: int
    priority: int = 0
    export_kv: bool = False
    decode: int = 0
    expects_kv: bool = False


@dataclass
class KVHandoff:
    """A prompt's K/V from a prefill instance: the first len(token_ids) - 1 tokens', a row of
    the engine's block bytes per block. `read_ns`: when the prefill instance copied them out
    of its pool (its prefill's end); `received_ns`: when the decode instance had them."""

    request_id: str
    token_ids: list[int]
    payload: torch.Tensor
    read_ns: int
    received_ns: int = 0


@dataclass(frozen=True)
class KVNote:
    """What an instance says of a request's K/V: `received` (decode; `read_ns`: when the
    prefill instance read them out), `sent` or `send_failed` (prefill), `fallback` or
    `kv_failed` (decode: they did not come, `reason` why; it prefilled the prompt itself, or
    failed the request, by kv_load_failure_policy)."""

    request_id: str
    kind: str
    time_ns: int
    num_bytes: int = 0
    read_ns: int = 0
    reason: str = ""
