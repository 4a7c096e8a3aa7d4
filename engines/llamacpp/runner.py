"""llama.cpp's low-level C API (through llama-cpp-python's ctypes bindings): one model, one
context holding `max_num_seqs` sequences' KV, and a `llama_batch` that mixes prompt chunks and
decode tokens of several sequences in one `llama_decode` call, as llama.cpp's own server does.

llama-cpp-python's high-level `Llama` object runs one sequence at a time; the C API underneath
keys the KV cache by sequence id, so any set of sequences can advance together and a finished
one is dropped with `llama_memory_seq_rm` while the others go on (continuous batching).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.gguf_quantize import quiet_llama_cpp

SETUP_HINT = (
    "engine=llamacpp needs llama-cpp-python: run `make setup-peer` (it builds llama.cpp for "
    "this CPU: python -m engines.llamacpp.peer_build)"
)

GGUF_MAGIC = b"GGUF"


def import_llama_cpp() -> Any:
    """The ctypes bindings, or a one-line error naming the make target."""
    try:
        from llama_cpp import llama_cpp
    except ImportError as exc:
        raise RuntimeError(SETUP_HINT) from exc
    return llama_cpp


def check_gguf(path: str) -> Path:
    """`path` as a GGUF file, or a one-line ValueError naming the field."""
    file = Path(path)
    hint = "allowed: a .gguf file (model=smollm2-135m, or model=hf model.path=FILE.gguf)"
    if not file.is_file():
        raise ValueError(f"model: {path!r} is not a file; engine=llamacpp runs GGUF files; {hint}")
    with file.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"model: {path!r} is not a GGUF file (no GGUF magic); {hint}")
    return file


@dataclass(frozen=True)
class BatchToken:
    seq_id: int
    token: int
    pos: int
    wants_logits: bool


class LlamaCppRunner:
    """A loaded GGUF model and a context for `num_seqs` sequences of up to `seq_len` tokens."""

    def __init__(
        self,
        path: Path,
        num_seqs: int,
        seq_len: int | None,
        batch_tokens: int,
        threads: int,
        threads_batch: int,
        flash_attn: str,
    ) -> None:
        lib = self.lib = import_llama_cpp()
        quiet_llama_cpp(lib)
        self.path = path
        params = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"model: llama.cpp could not load {str(path)!r}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(self.model))
        self.seq_len = seq_len or min(self.n_ctx_train, 2048)
        self.num_seqs = num_seqs
        self.batch_tokens = batch_tokens
        ctx = lib.llama_context_default_params()
        # kv_unified off: each sequence owns seq_len cells and attends over its own only
        ctx.n_ctx = num_seqs * self.seq_len
        ctx.n_seq_max = num_seqs
        ctx.kv_unified = False
        ctx.n_batch = ctx.n_ubatch = batch_tokens
        ctx.n_threads, ctx.n_threads_batch = threads, threads_batch
        ctx.flash_attn_type = {
            "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
            "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash_attn]
        ctx.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, ctx)
        if not self.ctx:
            self.close()
            raise ValueError(
                f"engine: llama.cpp could not create a context of {num_seqs} x {self.seq_len} "
                "tokens (engine.max_num_seqs x engine.max_model_len)"
            )
        self.n_ctx = int(lib.llama_n_ctx(self.ctx))
        self.memory = lib.llama_get_memory(self.ctx)
        self.threads, self.threads_batch = threads, threads_batch
        self.batch = lib.llama_batch_init(batch_tokens, 0, 1)
        self._batch_live = True
        # numpy views of the batch's arrays: filling a 512-token chunk costs microseconds
        self._tokens = np.ctypeslib.as_array(self.batch.token, shape=(batch_tokens,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(batch_tokens,))
        self._n_seq_id = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(batch_tokens,))
        self._logits = np.ctypeslib.as_array(self.batch.logits, shape=(batch_tokens,))
        self._n_seq_id[:] = 1

    # ---- facts -------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        lib = self.lib
        desc = ctypes.create_string_buffer(256)
        lib.llama_model_desc(self.model, desc, len(desc))
        layers = int(lib.llama_model_n_layer(self.model))
        return {
            "model_desc": desc.value.decode(errors="replace"),
            "num_parameters": int(lib.llama_model_n_params(self.model)),
            "weight_bytes": int(lib.llama_model_size(self.model)),
            "num_layers": layers,
            "n_vocab": self.n_vocab,
            "n_ctx": self.n_ctx,
            "n_ctx_train": self.n_ctx_train,
            "num_threads": self.threads,
            "num_threads_batch": self.threads_batch,
            "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
            "system_info": lib.llama_print_system_info().decode(errors="replace").strip(),
        }

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, at llama.cpp's default f16 cache."""
        lib = self.lib
        layers = int(lib.llama_model_n_layer(self.model))
        heads = int(lib.llama_model_n_head(self.model))
        kv_heads = int(lib.llama_model_n_head_kv(self.model))
        head_dim = int(lib.llama_model_n_embd(self.model)) // max(1, heads)
        return 2 * layers * kv_heads * head_dim * 2

    # ---- compute -----------------------------------------------------------------------------

    def decode(self, tokens: list[BatchToken]) -> None:
        """One `llama_decode` over `tokens` (at most batch_tokens); rows with wants_logits then
        have logits, read with `logits(row)` in the order of the list."""
        n = len(tokens)
        if not 0 < n <= self.batch_tokens:
            raise ValueError(f"llama.cpp batch: {n} tokens, allowed 1..{self.batch_tokens}")
        self._tokens[:n] = [t.token for t in tokens]
        self._pos[:n] = [t.pos for t in tokens]
        self._logits[:n] = [t.wants_logits for t in tokens]
        seq_ids = self.batch.seq_id
        for i, t in enumerate(tokens):
            seq_ids[i][0] = t.seq_id
        self.batch.n_tokens = n
        code = self.lib.llama_decode(self.ctx, self.batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for a batch of {n} tokens")

    def logits(self, row: int) -> np.ndarray:
        """float32 logits [n_vocab] of batch row `row` of the last decode: a view into
        llama.cpp's buffer (valid until the next decode; writes to it reach its samplers)."""
        pointer = self.lib.llama_get_logits_ith(self.ctx, row)
        if not pointer:
            raise RuntimeError(f"llama.cpp has no logits for batch row {row}")
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def new_sampler(self, temperature: float, top_k: int, top_p: float, seed: int) -> Any:
        """llama.cpp's own sampler chain for one sequence (top-k, top-p, temperature, then a
        seeded draw), the order llama.cpp's server applies them in; free with free_sampler."""
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if top_k > 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(top_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(temperature))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def sample(self, sampler: Any, row: int) -> int:
        return int(self.lib.llama_sampler_sample(sampler, self.ctx, row))

    def free_sampler(self, sampler: Any) -> None:
        self.lib.llama_sampler_free(sampler)

    def free_seq(self, seq_id: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def move_seq(self, src: int, dst: int) -> None:
        """Sequence `src`'s KV cells become free sequence `dst`'s; with one stream per
        sequence llama.cpp copies the stream's buffer at the next decode."""
        self.lib.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
        self.lib.llama_memory_seq_rm(self.memory, src, -1, -1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def close(self) -> None:
        lib = self.lib
        if getattr(self, "_batch_live", False):
            lib.llama_batch_free(self.batch)
            self._batch_live = False
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None
