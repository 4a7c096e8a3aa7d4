"""The quantized GGUF files people download, made here from a file the lab already has: its
tensors re-encoded to F16 (`inferlab convert`'s code), then quantized by llama.cpp's own
quantizer (`llama_model_quantize`, exposed by llama-cpp-python: `make setup-peer`) to a K-quant
mix (Q4_K_M, Q5_K_M, Q6_K) or Q8_0, exactly as `llama-quantize` writes them. Built once into
the shared cache, keyed by the source file, and reused (`derived_gguf`).

llama.cpp picks each tensor's type itself: a mix keeps some tensors at a higher type
(Q4_K_M's attn_v and half of ffn_down at Q6_K), and a tensor whose rows are not a multiple of
256 values falls back to another type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0: SmolLM2's 576).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import sys
from pathlib import Path
from typing import Any

from models import gguf_reencode
from models.cache import (
    cache_dir,
    check_trusted,
    code_key,
    drop_group_write,
    file_key,
    make_folder,
)
from models.gguf_reencode import GGUF_TYPES, convert_to_gguf

#: the mixes llama.cpp's quantizer makes here -> its LLAMA_FTYPE_MOSTLY_* name (Q8_0, Q5_0/Q5_1
#: and Q4_0/Q4_1, which mix nothing, `inferlab convert` writes alike: GGUF_TYPES)
LLAMA_QUANT_TYPES = {"q6_k": "Q6_K", "q5_k_m": "Q5_K_M", "q4_k_m": "Q4_K_M"}
#: every derived type: `inferlab convert`'s re-encodings, then llama.cpp's mixes
DERIVED_TYPES = (*GGUF_TYPES, *LLAMA_QUANT_TYPES)
SETUP_HINT = "llama.cpp's quantizer comes with llama-cpp-python: make setup-peer"


_silence: Any = None  # the log callback must outlive every call into the library


def quiet_llama_cpp(llama_cpp: Any) -> None:
    """llama.cpp logs every load, context and quantized tensor to stderr; failures are return
    codes here."""
    global _silence
    if _silence is None:
        _silence = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_silence, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()


def llama_quantize(src: str | Path, dst: str | Path, kind: str, threads: int = 0) -> Path:
    """`src` (an F16 or F32 GGUF) quantized by llama.cpp to `kind` (LLAMA_QUANT_TYPES) at
    `dst`, written to a temporary name and renamed, so `dst` is whole or absent."""
    if kind not in LLAMA_QUANT_TYPES:
        raise ValueError(f"kind: {kind!r}; allowed: {'|'.join(LLAMA_QUANT_TYPES)}")
    try:
        from llama_cpp import llama_cpp
    except ImportError as exc:
        raise ValueError(f"quantizing to {kind}: {SETUP_HINT}") from exc  # a setup step: named
    quiet_llama_cpp(llama_cpp)
    out = Path(dst)
    tmp = out.with_name(out.name + ".tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{LLAMA_QUANT_TYPES[kind]}")
    params.nthread = threads
    try:
        code = llama_cpp.llama_model_quantize(
            str(src).encode(), str(tmp).encode(), ctypes.byref(params)
        )
        if code != 0:
            raise ValueError(f"{src}: llama.cpp's quantizer failed to make {kind} (code {code})")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    return out


def derived_gguf_path(source: Path, kind: str) -> Path:
    """Where derived_gguf keeps `source` as `kind`: keyed by the file's content and by the code
    that makes it (the re-encoder, and llama.cpp's version for its mixes)."""
    maker = ""
    if kind not in GGUF_TYPES:
        try:
            maker = importlib.metadata.version("llama-cpp-python")
        except importlib.metadata.PackageNotFoundError:
            maker = "none"  # llama_quantize names the setup step
    code = code_key(gguf_reencode, sys.modules[__name__], extra=maker)
    return cache_dir() / "gguf-converted" / f"{source.stem}-{kind}-{file_key(source)}-{code}.gguf"


def derived_gguf(path: str | Path, kind: str) -> Path:
    """`path` re-encoded to `kind` (DERIVED_TYPES): GGUF_TYPES by `inferlab convert`'s code,
    llama.cpp's mixes quantized by llama.cpp from the F16 file; each built once into the cache,
    keyed by the source file's content."""
    if kind not in DERIVED_TYPES:
        raise ValueError(f"kind: {kind!r}; allowed: {'|'.join(DERIVED_TYPES)}")
    source = Path(path)
    out = derived_gguf_path(source, kind)
    check_trusted(out, "converted GGUF cache")
    if not out.is_file():  # both builders write a temporary file and rename it
        make_folder(out.parent)
        if kind in GGUF_TYPES:
            convert_to_gguf(source, out, kind)
        else:
            llama_quantize(derived_gguf(source, "f16"), out, kind)
        drop_group_write(out)
    return out
