"""The LoRA delta of one layer (engines/builtin/lora/layer.py) for a batch mixing adapters of
different ranks, one that targets only some parts of a fused layer, and rows of the base model:
the torch formulation, the engine's C kernel (CPU float32) and the Triton shrink / expand
kernels (GPU's, run here under the interpreter) all equal each row's x @ A^T @ B^T * scaling
written out part by part."""

from __future__ import annotations

import pytest
import torch

from engines.builtin import native
from engines.builtin.lora.adapter import LoRAAdapter
from engines.builtin.lora.batch import LoRABatch
from engines.builtin.lora.layer import LoRALayerSlots, LoRAPart

pytest.importorskip("triton")

FAN_IN = 40
PARTS = (LoRAPart("q_proj", 48), LoRAPart("k_proj", 16), LoRAPart("v_proj", 16))


def adapter(name: str, rank: int, modules: tuple[str, ...], seed: int) -> LoRAAdapter:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for part in PARTS:
        if part.module in modules:
            a = torch.randn(rank, FAN_IN, generator=generator)
            b = torch.randn(part.out_size, rank, generator=generator) * 0.3
            weights[(0, part.module)] = (a, b)
    return LoRAAdapter(name, "/", rank, 1.0, modules, weights)


ADAPTERS = [
    adapter("r4", 4, ("q_proj", "k_proj", "v_proj"), 0),
    adapter("r16", 16, ("q_proj", "k_proj", "v_proj"), 1),
    adapter("qv", 8, ("q_proj", "v_proj"), 2),  # k_proj's part stays zero
]


def slots(native: bool = False) -> LoRALayerSlots:
    cpu = torch.device("cpu")
    layer = LoRALayerSlots(0, PARTS, FAN_IN, 4, 16, torch.float32, cpu, native=native)
    for slot, a in enumerate(ADAPTERS):
        layer.write(slot, a)
    return layer


def expected(y: torch.Tensor, x: torch.Tensor, slot_per_row: list[int | None]) -> torch.Tensor:
    out = y.clone()
    for row, slot in enumerate(slot_per_row):
        if slot is None:
            continue
        column = 0
        for part in PARTS:
            pair = ADAPTERS[slot].weights.get((0, part.module))
            if pair is not None:
                a, b = pair
                out[row, column : column + part.out_size] += x[row] @ a.T @ b.T
            column += part.out_size
    return out


@pytest.mark.parametrize(
    "slot_per_row",
    [
        [0, 1, None, 2, 1, 0, None, 2],  # decode rows of every kind
        [1] * 6,  # one slot holds every row
        [None, None, 2],
    ],
    ids=["mixed", "one-slot", "base-and-one"],
)
@pytest.mark.parametrize("path", ["torch", "native", "triton"])
def test_each_rows_delta_is_its_adapters(slot_per_row: list[int | None], path: str) -> None:
    generator = torch.Generator().manual_seed(7)
    rows = len(slot_per_row)
    x = torch.randn(rows, FAN_IN, generator=generator)
    y = torch.randn(rows, sum(p.out_size for p in PARTS), generator=generator)
    batch = LoRABatch.of(slot_per_row, [1] * rows, torch.device("cpu"))
    assert batch is not None
    got = y.clone()
    layer = slots(native=path == "native")
    assert path != "native" or native.reason() is None, native.reason()
    if path in ("torch", "native"):
        layer.add_delta(got, x, batch)
    else:
        layer._add_delta_triton(got, x, batch)
    torch.testing.assert_close(got, expected(y, x, slot_per_row), rtol=1e-4, atol=1e-4)


def test_a_batch_of_base_rows_alone_has_no_lora_batch() -> None:
    assert LoRABatch.of([None, None], [3, 1], torch.device("cpu")) is None
    batch = LoRABatch.of([2, None, 2], [2, 1, 3], torch.device("cpu"))
    assert batch is not None and batch.slot_of_row.tolist() == [2, 2, -1, 2, 2, 2]
    assert [(slot, rows.tolist()) for slot, rows in batch.groups] == [(2, [0, 1, 3, 4, 5])]
