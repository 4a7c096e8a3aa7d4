"""A weight a checkpoint stores quantized, kept so from the file to the engine's kernels: integer
levels and a float scale and minimum per group of inputs, W = q * scale + min, the one form
every GGUF type llama.cpp writes for weights takes exactly (models/gguf_blocks.py says how each
maps), and AWQ's, GPTQ's and compressed-tensors' integer weights too (models/hf_quantized.py);
FP8 weights keep their float8 values as the levels (W = value * scale). The loader cuts,
permutes and fuses it as it does a float tensor (rows, whole groups of columns, concatenation),
and the engine's quantized linear method packs it for its kernels
(engines/builtin/layers/checkpoint_quant.py); `dequantize` is the float weight it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    """[out, in] weight: `q` uint8 [out, in] levels below 2**bits (or float8_e4m3fn values,
    8 bits), `scales` and `mins` float32 [out, in / group_size]. `source`: the file's types,
    e.g. "Q4_K" (joined with "+" where a fused layer's parts differ); `dtype`: the dtype a
    dequantized copy takes. `input_order`: where the groups are not contiguous runs of inputs
    (GPTQ's act-order), the inputs sorted by group: column j of `q` multiplies input
    input_order[j]."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    group_size: int
    bits: int
    source: str
    dtype: torch.dtype = torch.float32
    input_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        out, k = self.q.shape
        g = self.group_size
        if (
            self.q.dtype not in (torch.uint8, torch.float8_e4m3fn)
            or self.bits not in (4, 8)
            or (self.is_fp8 and self.bits != 8)
            or (self.input_order is not None and tuple(self.input_order.shape) != (k,))
            or g < 1
            or k % g
            or tuple(self.scales.shape) != (out, k // g)
            or tuple(self.mins.shape) != (out, k // g)
        ):
            raise ValueError(
                f"QuantizedWeight ({self.source}): q {self.q.dtype} {tuple(self.q.shape)}, "
                f"{self.bits} bits, groups of {self.group_size}, scales "
                f"{tuple(self.scales.shape)} and mins {tuple(self.mins.shape)} do not fit"
            )

    @property
    def is_fp8(self) -> bool:
        return self.q.dtype == torch.float8_e4m3fn

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dim(self) -> int:
        return 2

    def __getitem__(self, rows: slice | torch.Tensor) -> QuantizedWeight:
        """Output rows (a tensor-parallel shard, a packed tensor's part, a permutation)."""
        return replace(self, q=self.q[rows], scales=self.scales[rows], mins=self.mins[rows])

    def columns(self, columns: slice) -> QuantizedWeight:
        """Input columns `columns` (a row-parallel shard): whole groups only (one group a row
        is cut to the shard's width)."""
        start, stop, step = columns.indices(self.shape[1])
        if (start, stop, step) == (0, self.shape[1], 1):
            return self
        if self.input_order is not None:
            raise ValueError(
                f"columns {start}:{stop} of a {self.source} weight: its inputs are permuted "
                "(act-order), so a row-parallel shard is not a run of its columns; allowed: "
                "the whole width (the engine dequantizes such a shard at load)"
            )
        g = self.group_size
        if self.scales.shape[1] == 1 and step == 1:
            return replace(self, q=self.q[:, start:stop], group_size=stop - start)
        if step != 1 or start % g or stop % g:
            raise ValueError(
                f"columns {start}:{stop} of a {self.source} weight split its groups of {g} "
                "inputs; allowed: a tensor-parallel size whose shards hold whole groups"
            )
        groups = slice(start // g, stop // g)
        return replace(
            self,
            q=self.q[:, start:stop],
            scales=self.scales[:, groups],
            mins=self.mins[:, groups],
        )

    def padded_rows(self, rows: int) -> QuantizedWeight:
        """`rows` rows: these, then rows of zeros (levels, scales and minima 0)."""
        extra = rows - self.shape[0]

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(extra, t.shape[1])])

        return replace(self, q=pad(self.q), scales=pad(self.scales), mins=pad(self.mins))

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> QuantizedWeight:
        """The levels, scales and minima on `device`; `dtype` is what `dequantize` gives."""
        return replace(
            self,
            q=self.q.to(device),
            scales=self.scales.to(device),
            mins=self.mins.to(device),
            dtype=dtype or self.dtype,
            input_order=None if self.input_order is None else self.input_order.to(device),
        )

    def with_group_size(self, group_size: int) -> QuantizedWeight:
        """The same weight with smaller groups (`group_size` divides this one): each scale and
        minimum repeated, exactly."""
        if self.group_size % group_size:
            raise ValueError(f"group_size {group_size} does not divide {self.group_size}")
        times = self.group_size // group_size
        return replace(
            self,
            scales=self.scales.repeat_interleave(times, dim=1),
            mins=self.mins.repeat_interleave(times, dim=1),
            group_size=group_size,
        )

    def dequantize(self) -> torch.Tensor:
        """The float weight, [out, in] in `dtype` (computed in float32: q * scale + min), its
        columns in the inputs' order."""
        out, k = self.shape
        levels = self.q.float().reshape(out, k // self.group_size, self.group_size)
        weight = (levels * self.scales[..., None] + self.mins[..., None]).reshape(out, k)
        if self.input_order is not None:
            weight = torch.empty_like(weight).index_copy_(1, self.input_order, weight)
        return weight.to(self.dtype)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Parts stacked by rows (q/k/v, gate/up), in one form: the widest levels and the
        smallest groups of the parts, both exact (4-bit levels are 8-bit levels below 16)."""
        order = parts[0].input_order
        if (
            not all(_same_order(p.input_order, order) for p in parts)
            or len({p.is_fp8 for p in parts}) > 1
        ):
            raise ValueError(
                "fused parts of different input orders or of FP8 and integer levels; "
                "allowed: parts quantized alike"
            )
        group = min(p.group_size for p in parts)
        if any(p.group_size % group for p in parts):
            raise ValueError(
                f"fused parts' groups {[p.group_size for p in parts]} do not nest; "
                "allowed: group sizes that divide one another"
            )
        parts = [p.with_group_size(group) for p in parts]
        sources = list(dict.fromkeys(p.source for p in parts))
        return QuantizedWeight(
            q=torch.cat([p.q for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            mins=torch.cat([p.mins for p in parts]),
            group_size=group,
            bits=max(p.bits for p in parts),
            source="+".join(sources),
            dtype=parts[0].dtype,
            input_order=order,
        )


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a, b)


#: what the loader hands a layer: a float tensor, or a weight as its checkpoint quantized it
Weight = torch.Tensor | QuantizedWeight
