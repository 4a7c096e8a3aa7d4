"""KV cache groups: how a model whose layers keep different windows (Gemma 2/3's windowed
layers between global ones, Qwen's `max_window_layers`) shares one block pool, so that each
layer kind holds only the blocks it can still read.

The layers of each kind (a window, or None for global) are cut into groups of `group_size`
layers, the greatest common divisor of the kinds' layer counts; the j-th layer of every group
stores its K/V in the same tensor pair (slot j). A block id from the pool is then
`group_size` layers' memory, and each group keeps its own block table: a global group's table
grows with the sequence, a windowed group's releases blocks that fell out of its window.
Gemma 2 (alternating): two groups of half the layers; a sequence of n tokens holds about
n + window blocks' worth of half the layers, against n of all of them with one table. This is
vLLM v1's hybrid KV cache manager (`KVCacheGroupSpec`), with the same equal-sized groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from models.config import ModelConfig


@dataclass(frozen=True)
class KVGroups:
    #: each group's window (None: global), global groups first
    windows: tuple[int | None, ...]
    #: per model layer: its group, and the tensor pair (slot) it stores into
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @property
    def group_size(self) -> int:
        return max(self.layer_slot) + 1

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_groups(config: ModelConfig) -> KVGroups | None:
    """The groups of a model whose layers keep different windows; None when every layer keeps
    the same (one block table serves them all, as before)."""
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # global first
    if len(kinds) < 2:
        return None
    members = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in kinds}
    size = math.gcd(*(len(layers) for layers in members.values()))
    group_windows: list[int | None] = []
    layer_group = [0] * config.num_layers
    layer_slot = [0] * config.num_layers
    for kind in kinds:
        layers = members[kind]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(kind)
    return KVGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot))
