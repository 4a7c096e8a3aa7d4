"""The model runner executes a step plan: it packs the scheduled tokens (and static batching's
padding), fills the attention metadata into preallocated buffers (one host-to-device copy per
step), runs the model, and samples the sequences that reached the end of their known tokens."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engines.builtin.attention import AttentionMetadata, make_attention
from engines.builtin.config import EngineConfig
from engines.builtin.kv_cache import KVCacheManager, LayerKVCache
from engines.builtin.layers.linear import DenseMethod, make_linear_method
from engines.builtin.model import Transformer
from engines.builtin.model_config import ModelConfig
from engines.builtin.platform import Platform
from engines.builtin.sampler import Sampler, SamplingBatch
from engines.builtin.scheduler import StepPlan
from engines.builtin.weights import dummy_state_dict, iter_checkpoint, load_weights

#: The token id of static batching's padding (its compute is real, its output is dropped).
PAD_TOKEN_ID = 0


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, platform: Platform,
                 dtype: torch.dtype, max_model_len: int, max_num_batched_tokens: int,
                 max_num_seqs: int, sample_vocab_size: int, eos_ids: list[int]) -> None:
        self.model_config = model_config
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.sample_vocab_size = sample_vocab_size
        self.eos_ids = eos_ids

        with torch.device("meta"):
            linear = make_linear_method(config.quantization, config.quantization_group_size)
            # The LM head stays dense unless quantize_lm_head asks otherwise.
            lm_head = linear if config.quantize_lm_head else DenseMethod()
            self.model = Transformer(model_config, linear,
                                     make_attention(config.attention_backend),
                                     max_model_len, self.device, lm_head_method=lm_head)
        self.model.eval()
        self._load_weights()
        self.sampler = Sampler(config.seed, self.device)
        self.forward_timer = platform.timer()
        self.last_forward_ns = 0  # model forward + sampling of the last step, device time
        self.last_gather_ns = 0  # of which gathering K/V out of the cache (dense attention)
        self.kv_caches: list[LayerKVCache] = []
        # Sees the logits of every token of every step (packed, plan order): for parity tests
        # and the quality probe. None in normal runs, where only sampled rows are computed.
        self.logits_observer: Callable[[StepPlan, torch.Tensor], None] | None = None

        # Preallocated metadata buffers at the largest step; each step uses a prefix.
        def buffer(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=self.device)

        self.input_ids_buf = buffer(max_num_batched_tokens, torch.int64)
        self.positions_buf = buffer(max_num_batched_tokens, torch.int64)
        self.slots_buf = buffer(max_num_batched_tokens, torch.int64)
        self.qsl_buf = buffer(max_num_seqs + 1, torch.int32)
        self.seq_lens_buf = buffer(max_num_seqs, torch.int32)
        self.max_blocks_per_seq = 1
        self.ring = False
        self._real_token_index: torch.Tensor | None = None  # packed rows of real tokens

    def _load_weights(self) -> None:
        cfg, config = self.model_config, self.config
        use_dummy = config.load_format == "dummy" or (
            config.load_format == "auto" and not _is_checkpoint(config.model))
        if use_dummy:
            tensors = dummy_state_dict(cfg, config.seed, self.dtype, self.device).items()
        else:
            tensors = iter_checkpoint(config.model)
        load_weights(self.model, tensors, self.dtype, self.device)
        self.weights_source = "dummy" if use_dummy else "checkpoint"

    def allocate_kv_cache(self, kv: KVCacheManager) -> None:
        layout = kv.layout
        self.ring = bool(getattr(kv, "ring", False))
        self.block_size = layout.block_size
        self.max_blocks_per_seq = max(1, -(-self.max_model_len // layout.block_size))
        self.block_tables_buf = torch.zeros(
            (self.qsl_buf.numel() - 1, self.max_blocks_per_seq), dtype=torch.int32,
            device=self.device)
        self.kv_caches = []
        for layer in self.model.layers:
            cache = None
            if layout.num_blocks:
                cache = LayerKVCache(layout.num_blocks, layout.block_size,
                                     self.model_config.num_kv_heads, self.model_config.head_dim,
                                     self.dtype, self.device,
                                     quantized=self.config.kv_cache_dtype == "int8")
                self.kv_caches.append(cache)
            layer.attn.cache = cache

    # ---- one step ---------------------------------------------------------------------------

    def prepare(self, plan: StepPlan, kv: KVCacheManager) -> tuple[torch.Tensor,
                                                                    AttentionMetadata,
                                                                    torch.Tensor]:
        """Pack the plan into rows: real decodes, static batching's padding decodes, real
        prefills (each followed by its padding tokens, if any), then padding-only rows. Padding
        tokens are pad id 0 at the positions after their row's real tokens; they are computed
        (the cost static batching pays) but their K/V are never stored and they are never
        sampled."""
        items = plan.scheduled
        num_decodes = plan.num_decodes
        pads = plan.padding_rows
        pad_decodes = [r for r in pads if r.is_decode]
        pad_rows = [r for r in pads if not r.is_decode]
        # (seq_id, first position, real tokens, padding tokens) per row, in packing order
        rows: list[tuple[int, int, list[int], int]] = []
        for s in items[:num_decodes]:
            rows.append((s.seq.seq_id, s.num_computed_before,
                         s.seq.token_ids[s.num_computed_before:s.num_computed_before + 1], 0))
        for r in pad_decodes:
            rows.append((r.seq.seq_id, r.start, [], 1))
        for s in items[num_decodes:]:
            start = s.num_computed_before
            rows.append((s.seq.seq_id, start,
                         s.seq.token_ids[start:start + s.num_new_tokens], s.num_padding_tokens))
        for r in pad_rows:
            rows.append((r.seq.seq_id, r.start, [], r.num_tokens))

        num_seqs = len(rows)
        real_lens = np.fromiter((len(r[2]) for r in rows), np.int64, num_seqs)
        query_lens = real_lens + np.fromiter((r[3] for r in rows), np.int64, num_seqs)
        starts = np.fromiter((r[1] for r in rows), np.int64, num_seqs)
        seq_lens = starts + query_lens
        qsl = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])

        token_ids: list[int] = []
        for _, _, ids, num_pad in rows:
            token_ids.extend(ids)
            token_ids.extend([PAD_TOKEN_ID] * num_pad)
        # positions = start of the chunk + offset within it, for every packed token
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        offsets = np.arange(num_tokens) - qsl[:-1][seq_index]
        positions = starts[seq_index] + offsets

        use_cache = kv.retains_kv
        write_index = None
        n = num_tokens
        self.input_ids_buf[:n].copy_(torch.from_numpy(np.asarray(token_ids, np.int64)))
        self.positions_buf[:n].copy_(torch.from_numpy(positions))
        self.qsl_buf[:num_seqs + 1].copy_(torch.from_numpy(qsl))
        self.seq_lens_buf[:num_seqs].copy_(torch.from_numpy(seq_lens))
        if use_cache:
            tables = np.zeros((num_seqs, self.max_blocks_per_seq), np.int64)
            for row, r in enumerate(rows):
                table = kv.block_table(r[0])
                tables[row, :len(table)] = table
            bs = self.block_size
            # Padding (static batching) is computed but its K/V never stored: nothing reads it,
            # and a padded row may reach past the blocks its sequence owns.
            keep = offsets < real_lens[seq_index]
            if self.ring:
                # One window-sized region per sequence, written round-robin; of a prompt
                # longer than the window only the last `window` tokens are kept.
                slots = tables[seq_index, 0] * bs + positions % bs
                keep &= positions >= (starts + real_lens)[seq_index] - bs
            else:
                blocks = np.minimum(positions // bs, self.max_blocks_per_seq - 1)
                slots = tables[seq_index, blocks] * bs + positions % bs
            if not keep.all():
                write_index = torch.as_tensor(np.flatnonzero(keep), device=self.device)
            self.slots_buf[:n].copy_(torch.from_numpy(slots))
            self.block_tables_buf[:num_seqs].copy_(torch.from_numpy(tables))

        meta = AttentionMetadata(
            positions=self.positions_buf[:n],
            slot_mapping=self.slots_buf[:n],
            query_start_loc=self.qsl_buf[:num_seqs + 1],
            seq_lens=self.seq_lens_buf[:num_seqs],
            block_tables=self.block_tables_buf[:num_seqs],
            query_start_loc_host=qsl.tolist(),
            seq_lens_host=seq_lens.tolist(),
            num_decodes=num_decodes + len(pad_decodes),
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
            sliding_window=self.model_config.sliding_window,
            use_cache=use_cache,
            ring=self.ring,
            write_index=write_index,
        )
        # Real rows in plan order: decodes are rows 0..num_decodes-1, prefills follow the
        # padding decodes. A sampling row's logits are at its last real token.
        first_prefill = num_decodes + len(pad_decodes)
        real_rows = [*range(num_decodes),
                     *range(first_prefill, first_prefill + len(items) - num_decodes)]
        sample_rows = [row for row, s in zip(real_rows, items, strict=True) if s.samples]
        logits_indices = torch.as_tensor(qsl[:-1][sample_rows] + real_lens[sample_rows] - 1,
                                         device=self.device)
        self._real_token_index = None
        if plan.padding_tokens:
            real = offsets < real_lens[seq_index]
            self._real_token_index = torch.as_tensor(np.flatnonzero(real), device=self.device)
        return self.input_ids_buf[:n], meta, logits_indices

    @torch.inference_mode()
    def execute(self, plan: StepPlan, kv: KVCacheManager) -> list[int]:
        """Run the plan; return one sampled token per sequence that samples, in plan order."""
        input_ids, meta, logits_indices = self.prepare(plan, kv)
        if plan.copied_blocks:
            self.copy_blocks(plan.copied_blocks)
        for cache in self.kv_caches:
            cache.gather_ns = 0
        self.forward_timer.start()
        tokens = self._forward_and_sample(plan, input_ids, meta, logits_indices)
        self.forward_timer.stop()
        result = tokens.tolist()  # the step's one device-to-host sync
        self.last_forward_ns = self.forward_timer.elapsed_ns()
        self.last_gather_ns = sum(cache.gather_ns for cache in self.kv_caches)
        return result

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: give a sequence its own copy of a shared, partially filled block."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.kv_caches:
            cache.copy_blocks(src, dst)

    def _forward_and_sample(self, plan: StepPlan, input_ids: torch.Tensor,
                            meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids, meta)
        if self.logits_observer is not None:
            real = hidden if self._real_token_index is None else hidden[self._real_token_index]
            self.logits_observer(plan, self.model.compute_logits(real).float())
        if logits_indices.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        logits = self.model.compute_logits(hidden[logits_indices])
        # Ids past the tokenizer's vocabulary (a dummy model's padding rows) are never sampled.
        logits = logits[:, :self.sample_vocab_size]
        seqs = [s.seq for s in plan.scheduled if s.samples]
        if any(seq.pending_forks for seq in seqs):
            # Parallel sampling: the first token of each of a request's n samples is drawn
            # from the same prompt logits; the engine forks a sequence for each extra one.
            rows = [i for i, seq in enumerate(seqs) for _ in range(1 + seq.pending_forks)]
            logits = logits[rows]
            seqs = [seqs[i] for i in rows]
        if all(s.sampling.temperature == 0.0 and not s.sampling.min_tokens for s in seqs):
            tokens = logits.argmax(dim=-1)
        else:
            batch = SamplingBatch.from_sequences(seqs, self.eos_ids, self.device)
            tokens = self.sampler(logits, batch)
        return tokens


def _is_checkpoint(model: str) -> bool:
    from pathlib import Path

    return Path(model).is_dir()
