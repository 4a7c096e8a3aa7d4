"""GGUF files (llama.cpp's, Ollama's) as checkpoints: the model's config from the file's
metadata in config.json's terms, and its tensors under Hugging Face names, dequantized to fp32
or (`keep_quantized`) each quantized weight as the levels and scales it stores
(models/gguf_blocks.py).
Architectures (`general.architecture`): llama (Mixtral too: a llama with experts), qwen2,
qwen3, qwen2moe and qwen3moe (`GGUF_ARCHITECTURES`). A mixture-of-experts layer's experts are
stacked in one tensor per projection (`ffn_gate_exps` [experts, inter, hidden]...), cut here
into each expert's Hugging Face tensors.

For llama, llama.cpp's converter permutes the rows of q_proj and k_proj so that its rotary
embedding rotates adjacent pairs; the engine (like Hugging Face) rotates the two halves of each
head, so those rows are put back. Qwen's files keep Hugging Face's order (llama.cpp rotates
them NeoX's way, by halves). Dequantization is the `gguf` package's (numpy, every type llama.cpp
writes: F32/F16/BF16, Q8_0, Q4_0, Q4_1, the K-quants...).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.cache import build_folder_once, cache_dir, code_key, file_key
from models.gguf_blocks import KEPT_TYPES, decode_blocks
from models.gguf_header import GGUFHeaderError, check_gguf_header
from models.gguf_sentencepiece import sentencepiece_tokenizer
from models.quantized_weight import QuantizedWeight


class UnsupportedGGUFError(ValueError):
    """A GGUF file the engine cannot run; the message names the file or the key."""


_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k and v in one tensor, as in its checkpoints
    "attn_q_norm": "self_attn.q_norm",  # qwen3, olmoe (over all heads)
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # a mixture-of-experts layer's router (Mixtral: _MIXTRAL)
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: the experts' stacked projections -> each expert's (Qwen's name, Mixtral's name)
_EXPERT_TENSORS = {
    "ffn_gate_exps": ("gate_proj", "w1"),
    "ffn_up_exps": ("up_proj", "w3"),
    "ffn_down_exps": ("down_proj", "w2"),
}
_TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP = re.compile(r"(\w+)\.(weight|bias)$")


def open_gguf(path: str | Path) -> Any:
    import gguf

    try:
        check_gguf_header(path)  # the reader trusts the header's counts and lengths
        return gguf.GGUFReader(str(path))
    except GGUFHeaderError as exc:  # it names the file and the field
        raise UnsupportedGGUFError(str(exc)) from None
    except (ValueError, OSError) as exc:
        raise UnsupportedGGUFError(f"{path}: not a readable GGUF file ({exc})") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except UnicodeDecodeError:  # the header check reads names and strings, not array items
        raise UnsupportedGGUFError(
            f"{reader.data.filename}: {key}: holds a string that is not valid UTF-8"
        ) from None


#: general.architecture -> the Hugging Face architecture, and whether llama.cpp's converter
#: permuted its q/k rows
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),  # MixtralForCausalLM when it has experts
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
    "olmoe": ("OlmoeForCausalLM", False),
    "phi3": ("Phi3ForCausalLM", False),
    "gemma2": ("Gemma2ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
}
#: Gemma's layer norms under llama.cpp's names (its ffn_norm is the norm before the MLP; the
#: one after attention has a name of its own). llama.cpp's converter stores every Gemma norm
#: weight + 1 (its kernels scale by the weight), which the loader takes off again.
_GEMMA_LAYER_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
#: block_count of the 27B Gemma: llama.cpp scales its queries by 1/sqrt(hidden / heads), every
#: other Gemma's by 1/sqrt(head_dim) (files hold no query_pre_attn_scalar)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA = frozenset(_GEMMA_27B_LAYERS)


def gguf_keys(arch: str = "llama") -> dict[str, str]:
    """config.json's keys -> the metadata keys of a GGUF file of `arch` they are read from."""
    per_arch = {
        "vocab_size": "vocab_size",
        "hidden_size": "embedding_length",
        "intermediate_size": "feed_forward_length",
        "num_hidden_layers": "block_count",
        "num_attention_heads": "attention.head_count",
        "num_key_value_heads": "attention.head_count_kv",
        "head_dim": "attention.key_length",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon",
        "rope_theta": "rope.freq_base",
        "max_position_embeddings": "context_length",
        "num_experts": "expert_count",
        "num_experts_per_tok": "expert_used_count",
        "moe_intermediate_size": "expert_feed_forward_length",
        "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
        "norm_topk_prob": "expert_weights_norm",
        "sliding_window": "attention.sliding_window",
    }
    return {
        **{hf: f"{arch}.{key}" for hf, key in per_arch.items()},
        "bos_token_id": "tokenizer.ggml.bos_token_id",
        "eos_token_id": "tokenizer.ggml.eos_token_id",
        # written even when absent: Phi-3's config class defaults to an id past small vocabularies
        "pad_token_id": "tokenizer.ggml.padding_token_id",
    }


def architecture(reader: Any) -> str:
    """The file's general.architecture, one the engine reads (else UnsupportedGGUFError)."""
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"{reader.data.filename}: general.architecture {arch!r} is not supported; "
            f"supported: {'|'.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def hf_config(reader: Any) -> dict[str, Any]:
    """The file's metadata as the fields of a Hugging Face config.json."""
    arch = architecture(reader)
    names = {t.name for t in reader.tensors}
    config = {hf: _field(reader, key) for hf, key in gguf_keys(arch).items()}
    if config["vocab_size"] is None:
        config["vocab_size"] = len(_field(reader, "tokenizer.ggml.tokens", []))
    defaults = {
        "num_key_value_heads": config["num_attention_heads"],
        "head_dim": None,  # the heads split the hidden size
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "sliding_window": None,
    }
    # llama.cpp normalizes Qwen3-MoE's top-k weights unless the file says otherwise
    defaults["norm_topk_prob"] = arch == "qwen3moe"
    experts = config["num_experts"]
    config = {
        "architectures": [
            "MixtralForCausalLM" if arch == "llama" and experts else GGUF_ARCHITECTURES[arch][0]
        ],
        **{hf: defaults.get(hf) if value is None else value for hf, value in config.items()},
        "tie_word_embeddings": "output.weight" not in names,
    }
    if arch in ("qwen2", "qwen2moe"):  # its q/k/v biases are in the file or not
        config["attention_bias" if arch == "qwen2" else "qkv_bias"] = "blk.0.attn_q.bias" in names
    if experts:  # the layers without experts have a dense MLP
        config["mlp_only_layers"] = sorted(
            int(n.split(".")[1]) for n in names if n.endswith(".ffn_gate.weight")
        )
    if arch in _GEMMA:
        return {**config, **_gemma_config(reader, arch, config)}
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise UnsupportedGGUFError(
            f"{reader.data.filename}: {arch}.rope.scaling.type: rope scaling is not supported"
        )
    return config


def _gemma_config(reader: Any, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3's config.json keys as llama.cpp writes and reads them: the soft caps, which
    layers are windowed (`attention.sliding_window_pattern`: a flag per layer, or every n-th
    global; absent: the family's rule), the query scale by llama.cpp's rule, and Gemma 3's
    RoPE, linear scaling on the global layers and `rope.freq_base_swa` on the windowed ones."""
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    big = config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    extra: dict[str, Any] = {
        "query_pre_attn_scalar": config["hidden_size"] // heads if big else head_dim,
    }
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = _field(reader, f"{arch}.{key}")
            if value is not None:
                extra[key] = value
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        extra["layer_types"] = ["sliding_attention" if w else "full_attention" for w in pattern]
    elif pattern is not None:
        extra["sliding_window_pattern"] = pattern
    if arch == "gemma3":
        scaling = _field(reader, f"{arch}.rope.scaling.type")
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
        if scaling == "linear":
            full = {
                **full,
                "rope_type": "linear",
                "factor": _field(reader, f"{arch}.rope.scaling.factor"),
            }
        elif scaling not in (None, "none"):
            raise UnsupportedGGUFError(
                f"{reader.data.filename}: {arch}.rope.scaling.type: {scaling!r} is not "
                "supported; supported: linear, none"
            )
        local = _field(reader, f"{arch}.rope.freq_base_swa", 10000.0)
        extra["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
    return extra


def gguf_source_keys(path: str | Path) -> dict[str, str]:
    """gguf_keys of the file's architecture (the names its errors use)."""
    return gguf_keys(architecture(open_gguf(path)))


def gguf_hf_config(path: str | Path) -> dict[str, Any]:
    return hf_config(open_gguf(path))


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotated halves)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_name(name: str, arch: str = "llama") -> str | None:
    """A GGUF tensor name of a file of `arch` under Hugging Face's name, or None for one the
    model does not use (e.g. rope_freqs, which the engine computes)."""
    if match := _LAYER.match(name):
        layer, part, kind = match.groups()
        gemma = _GEMMA_LAYER_TENSORS if arch in _GEMMA else {}
        hf = gemma.get(part, _LAYER_TENSORS.get(part))
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    if match := _TOP.match(name):
        part, kind = match.groups()
        hf = _TOP_TENSORS.get(part)
        return None if hf is None else f"{hf}.{kind}"
    return None


def iter_gguf_tensors(
    path: str | Path, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, fp32 tensor) for every tensor the model uses; with `keep_quantized`
    a weight of a type models/gguf_blocks.py decodes comes as the QuantizedWeight it stores."""
    reader = open_gguf(path)
    config = hf_config(reader)
    arch = architecture(reader)
    permuted = GGUF_ARCHITECTURES[arch][1]
    mixtral = config["architectures"][0] == "MixtralForCausalLM"
    heads = (
        {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        if permuted
        else {}
    )
    for tensor in reader.tensors:
        match = _LAYER.match(tensor.name)
        if match is not None and match.group(2) in _EXPERT_TENSORS:
            layer, part, kind = match.groups()
            block = "block_sparse_moe" if mixtral else "mlp"
            projection = _EXPERT_TENSORS[part][mixtral]
            stacked = _weight(path, tensor, keep_quantized)  # [experts, out, in]
            experts = int(tensor.shape[-1])  # GGUF lists the dimensions innermost first
            rows = stacked.shape[0] // experts
            for e in range(experts):
                hf = f"model.layers.{layer}.{block}.experts.{e}.{projection}.{kind}"
                if isinstance(stacked, QuantizedWeight):
                    yield hf, stacked[e * rows : (e + 1) * rows]
                else:
                    yield hf, torch.from_numpy(np.ascontiguousarray(stacked[e]))
            continue
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        if mixtral and name.endswith(".mlp.gate.weight"):
            name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        if arch == "phi3" and ".mlp.up_proj." in name:  # gate and up in one, as its checkpoints
            name = name.replace(".mlp.up_proj.", ".mlp.gate_up_proj.")
        array = _weight(path, tensor, keep_quantized)
        part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if isinstance(array, QuantizedWeight):
            if part in heads:
                order = _unpermute(np.arange(array.shape[0]), heads[part])
                array = array[torch.from_numpy(order)]
            yield name, array
            continue
        if part in heads and name.endswith(".weight"):
            array = _unpermute(array, heads[part])
        if part == "ffn_gate_inp_shexp" and array.ndim == 1:  # [hidden]: HF's is [1, hidden]
            array = array[None, :]
        if arch in _GEMMA and tensor.name.endswith("norm.weight"):
            array = array - 1.0  # stored as llama.cpp's kernels use it: 1 + weight
        yield name, torch.from_numpy(np.ascontiguousarray(array))  # a copy: the file is mapped


def _weight(path: str | Path, tensor: Any, keep_quantized: bool) -> np.ndarray | QuantizedWeight:
    """A GGUF tensor as the QuantizedWeight it stores (`keep_quantized`, a 2-D or stacked 3-D
    weight of a kept type: experts stacked by rows), else dequantized."""
    kind = tensor.tensor_type.name
    if not keep_quantized or kind not in KEPT_TYPES or len(tensor.shape) < 2:
        return _dequantized(path, tensor)
    dims = tuple(reversed(tensor.shape.tolist()))
    try:
        return decode_blocks(kind, tensor.data, (int(np.prod(dims[:-1])), dims[-1]))
    except ValueError as exc:
        raise UnsupportedGGUFError(f"{path}: tensor {tensor.name}: {exc}") from None


def _dequantized(path: str | Path, tensor: Any) -> np.ndarray:
    """A GGUF tensor as fp32, in numpy's order (the file lists its dimensions reversed)."""
    import gguf

    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise UnsupportedGGUFError(
            f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
            f"cannot be dequantized ({exc})"
        ) from None
    return np.array(array, dtype=np.float32).reshape(tuple(reversed(tensor.shape)))


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


#: llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) this builds exactly: byte-level BPE
#: after GPT-2's split, with digits split one by one first where the model was trained so
#: (smollm), or after Qwen2's split (its tokenizer.json's regex: single digits, no
#: contractions across cases, newlines kept with the punctuation before them).
_DIGIT_SPLIT = {"smollm": True, "gpt2": False, "default": False}
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = (*_DIGIT_SPLIT, "qwen2")


def _string_list(reader: Any, key: str) -> list[str]:
    values = _field(reader, key)
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise UnsupportedGGUFError(
            f"{reader.data.filename}: {key}: allowed: a non-empty array of strings"
        )
    return values


def write_hf_tokenizer(path: str | Path, folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json (special tokens, chat template, add_bos) of a
    GGUF file's vocabulary, built with `tokenizers` from the file's metadata: a byte-level BPE
    (tokenizer.ggml.model `gpt2`) or SentencePiece's (`llama`, models/gguf_sentencepiece.py)."""
    reader = open_gguf(path)
    kind = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if kind != "llama" and (kind != "gpt2" or pre not in PRE_TOKENIZERS):
        raise UnsupportedGGUFError(
            f"{path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported; "
            f"supported: llama (SentencePiece), gpt2 with {'|'.join(PRE_TOKENIZERS)}; or give "
            "the model's tokenizer folder as model.tokenizer"
        )
    tokens = _string_list(reader, "tokenizer.ggml.tokens")
    types = _numbers(reader, "tokenizer.ggml.token_type", len(tokens))
    if kind == "llama":
        backend = sentencepiece_tokenizer(
            str(_field(reader, "general.architecture")),
            tokens,
            [int(t) for t in types],
            _numbers(reader, "tokenizer.ggml.scores", len(tokens)),
            bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)),
        )
    else:
        backend = _byte_level_tokenizer(reader, pre, tokens, types)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = _field(reader, key)
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    config = {
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _numbers(reader: Any, key: str, count: int) -> list[float]:
    """An array of one number per token (token types, scores)."""
    values = list(_field(reader, key) or [])
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if len(values) != count or not numbers:
        raise UnsupportedGGUFError(
            f"{reader.data.filename}: {key}: {len(values)} values for {count} tokens; allowed: "
            "one number per token"
        )
    return values


def _byte_level_tokenizer(reader: Any, pre: str, tokens: list[str], types: list[float]) -> Any:
    """The byte-level BPE of a `gpt2` vocabulary: the file's merges, GPT-2's split (or the one
    `pre` names), the control tokens kept whole."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    path = reader.data.filename
    merges = []
    for merge in _field(reader, "tokenizer.ggml.merges") or []:
        pair = tuple(merge.split(" ", 1)) if isinstance(merge, str) else ()
        if len(pair) != 2:
            raise UnsupportedGGUFError(
                f"{path}: tokenizer.ggml.merges: {merge!r} is invalid; allowed: two tokens "
                "separated by a space"
            )
        merges.append(pair)
    backend = Tokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    if pre == "qwen2":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if _DIGIT_SPLIT[pre]
            else byte_level
        )
    backend.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp's token types: 1 normal, 3 control, 4 user-defined
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == control
        ]
    )
    return backend


def tokenizer_cache_folder(path: str | Path) -> Path:
    """Where tokenizer_folder keeps the GGUF file's tokenizer: keyed by the file's content
    and by this module's code, which writes it."""
    return cache_dir() / "gguf-tokenizers" / f"{file_key(path)}-{code_key(sys.modules[__name__])}"


def tokenizer_folder(path: str | Path) -> Path:
    """A Hugging Face tokenizer folder for the GGUF file, built once into the shared cache
    and reused."""
    return build_folder_once(
        tokenizer_cache_folder(path),
        "tokenizer_config.json",
        lambda out: write_hf_tokenizer(path, out),
        "GGUF tokenizer cache",
    )
