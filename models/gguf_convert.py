"""`inferlab convert`: a GGUF file as a Hugging Face folder (config.json, safetensors, tokenizer,
chat template) for tools that want one, or as another GGUF file with its tensors re-encoded
(F32/F16/BF16 for an equal-precision llama.cpp peer, Q8_0/Q4_0/Q4_1 to compare its formats).

Both stream one tensor at a time, so memory stays near one tensor plus one safetensors shard.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from models.config import MODEL_TYPES, from_hf_dict
from models.files import check_model_output
from models.gguf import (
    architecture,
    gguf_keys,
    hf_config,
    is_gguf,
    iter_gguf_tensors,
    open_gguf,
    write_hf_tokenizer,
)
from models.gguf_reencode import GGUF_TYPES, convert_to_gguf

HF_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SHARD_BYTES = 2 * 1024**3  # as transformers' save_pretrained does by default (its 5 GB is larger)


def _float_tensors(src: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `src` dequantized (a Hugging Face folder holds float weights)."""
    for name, tensor in iter_gguf_tensors(src):
        assert isinstance(tensor, torch.Tensor)  # not asked to keep them quantized
        yield name, tensor


def _shards(
    tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        tensor = tensor.to(dtype).contiguous()
        if shard and size + tensor.nbytes > SHARD_BYTES:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor
        size += tensor.nbytes
    if shard:
        yield shard


def convert_to_hf(src: str | Path, dst: str | Path, dtype: str = "float32") -> Path:
    """A Hugging Face folder (of the file's architecture, models/gguf.py) from the GGUF
    file `src`; `dtype` of the safetensors: float32 (exact: the file's quantized weights
    dequantized), float16 or bfloat16."""
    from safetensors.torch import save_file

    if dtype not in HF_DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is invalid; allowed: {'|'.join(HF_DTYPES)}")
    reader = open_gguf(src)
    config = _runnable_config(reader, src)
    # transformers picks the class by model_type (Gemma 3's text model is gemma3_text)
    model_types = {arch: model_type for model_type, arch in MODEL_TYPES.items()}
    config["model_type"] = model_types[config["architectures"][0]]
    config["torch_dtype"] = dtype
    folder = Path(dst)
    folder.mkdir(parents=True, exist_ok=True)
    # Shards are written as they fill, then named once their count is known.
    written: list[tuple[Path, list[str]]] = []
    try:
        for i, shard in enumerate(_shards(_float_tensors(src), HF_DTYPES[dtype])):
            path = folder / f"model-part-{i:05d}.safetensors.tmp"
            written.append((path, list(shard)))
            save_file(shard, str(path), metadata={"format": "pt"})
            path.chmod(0o644)  # safetensors creates it owner-only, unlike the other files
    except BaseException:  # a full disk or ^C leaves no partial shard behind
        for path, _ in written:
            path.unlink(missing_ok=True)
        raise
    if len(written) == 1:  # the plain name transformers looks for first
        written[0][0].replace(folder / "model.safetensors")
    else:
        weight_map, total = {}, 0
        for i, (path, names) in enumerate(written, 1):
            final = folder / f"model-{i:05d}-of-{len(written):05d}.safetensors"
            total += path.stat().st_size
            path.replace(final)
            weight_map.update(dict.fromkeys(names, final.name))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_hf_tokenizer(src, folder)
    return folder


def _runnable_config(reader: Any, src: str | Path) -> dict[str, Any]:
    """The file's config.json fields, once the engine's loader accepts them: a metadata value
    it would refuse (NaN, a size out of range) is refused before anything is written."""
    config = hf_config(reader)
    from_hf_dict(config, str(src), gguf_keys(architecture(reader)))
    return config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="inferlab convert",
        description="A GGUF file -> a Hugging Face folder (DST not ending in .gguf) or another "
        "GGUF file with its tensors re-encoded (DST ending in .gguf).",
    )
    parser.add_argument("src", help="the .gguf file")
    parser.add_argument("dst", help="a folder (Hugging Face checkpoint) or a .gguf file")
    parser.add_argument(
        "--dtype",
        help=f"folder: {'|'.join(HF_DTYPES)} (default float32); "
        f".gguf: {'|'.join(GGUF_TYPES)} (default f16)",
    )
    parser.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="DST folder: the tokenizer alone (tokenizer.json, tokenizer_config.json), for "
        "clients that size prompts with a Hugging Face tokenizer (guidellm, AIPerf, lm-eval)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="write over a DST that exists (a .gguf file, or a folder that is not empty)",
    )
    args = parser.parse_args(argv)
    try:
        if not is_gguf(args.src):
            raise ValueError(f"src: {args.src!r} is not an existing .gguf file")
        if args.tokenizer_only and (args.dst.endswith(".gguf") or args.dtype):
            raise ValueError(
                "--tokenizer-only: writes a folder of the tokenizer alone; allowed: a DST "
                "folder (not .gguf) and no --dtype"
            )
        # a DST folder of the user's own checkpoint has the very names written here
        # (config.json, model.safetensors, tokenizer.json): replaced only when asked
        check_model_output(args.dst, "dst", folder=not args.dst.endswith(".gguf"), force=args.force)
        if args.tokenizer_only:
            out = Path(args.dst)
            out.mkdir(parents=True, exist_ok=True)
            write_hf_tokenizer(args.src, out)
        elif args.dst.endswith(".gguf"):
            _runnable_config(open_gguf(args.src), args.src)  # refused before anything is written
            out = convert_to_gguf(args.src, args.dst, args.dtype or "f16")
        else:
            out = convert_to_hf(args.src, args.dst, args.dtype or "float32")
    except (ValueError, OSError) as exc:  # bad input, an unwritable or full destination
        print(f"inferlab convert: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
