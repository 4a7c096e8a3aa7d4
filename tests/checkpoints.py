"""Tiny checkpoints written on the spot. A Hugging Face folder: the `tiny` preset's shape in
config.json, its dummy weights in model.safetensors and the project tokenizer in
tokenizer.json, with any config.json key changed or a weight set to NaN or inf (the hostile inputs
the loader and the engine must refuse). A GGUF file: a 2-layer llama with the metadata keys and
value types of SmolLM2-135M-Instruct's file and its tensor types, a few KB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import save_file

from models.location import resolve_model
from models.tokenizer import default_tokenizer
from models.weights import dummy_state_dict


def tiny_config_json() -> dict[str, Any]:
    cfg = resolve_model("tiny")
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": 256,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def write_tiny_checkpoint(
    folder: Path, config: dict[str, Any] | None = None, poisoned: dict[str, float] | None = None
) -> Path:
    """`config`: config.json's keys to change; `poisoned`: tensor name -> the value its first
    element is set to (NaN, inf)."""
    folder.mkdir(parents=True, exist_ok=True)
    # Python's json writes (and reads) NaN and Infinity, as a hand-edited file may hold them
    (folder / "config.json").write_text(json.dumps({**tiny_config_json(), **(config or {})}))
    weights = dummy_state_dict(resolve_model("tiny"))
    for name, value in (poisoned or {}).items():
        weights[name].view(-1)[0] = value
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    default_tokenizer().backend.save(str(folder / "tokenizer.json"))
    return folder


HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(
    path: Path, metadata: dict[str, int | float] | None = None, alignment: int | None = None
) -> Path:
    """A llama GGUF with SmolLM2's keys and tensor types at toy sizes (seeded weights);
    `metadata`: numeric keys to change (llama.context_length, ...), each of its own type;
    `alignment`: general.alignment (default: none, the format's 32)."""
    import gguf
    from tokenizers import pre_tokenizers

    tokens = SPECIAL + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value in {
        "general.type": "model",
        "general.name": "Tiny Synthetic",
        "general.organization": "inferlab-tests",
        "general.finetune": "none",
        "general.basename": "tiny",
        "general.size_label": "50K",
        "general.license": "apache-2.0",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }.items():
        writer.add_string(key, value)
    writer.add_array("general.languages", ["en"])
    numbers = {
        "llama.block_count": LAYERS,
        "llama.context_length": 256,
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q4_1),
        "llama.vocab_size": len(tokens),
        "llama.rope.dimension_count": HIDDEN // HEADS,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "general.quantization_version": 2,
    }
    floats = {"llama.rope.freq_base": 100000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5}
    for key, value in {**numbers, **floats, **(metadata or {})}.items():
        (writer.add_float32 if key in floats else writer.add_uint32)(key, value)
    writer.add_bool("tokenizer.ggml.add_space_prefix", False)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    control, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)
    writer.add_array(
        "tokenizer.ggml.token_type", [control if t in SPECIAL else normal for t in tokens]
    )
    writer.add_array("tokenizer.ggml.merges", MERGES)

    rng = np.random.default_rng(0)
    q8, q4, f32 = (gguf.GGMLQuantizationType[n] for n in ("Q8_0", "Q4_1", "F32"))

    def add(name: str, shape: tuple[int, ...], kind: gguf.GGMLQuantizationType) -> None:
        values = rng.standard_normal(shape).astype(np.float32) * 0.1
        if kind == f32:
            writer.add_tensor(name, values + 1.0)  # norm weights sit near 1
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", (len(tokens), HIDDEN), q8)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), f32)
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), q4)
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), q4)
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), q4)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), f32)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN), q4)
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), q4)
        add(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), q4)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN), q4)
    add("output_norm.weight", (HIDDEN,), f32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf_of(
    model: Any, path: Path, arch: str, pre: str = "default", folder: Path | None = None
) -> Path:
    """A Hugging Face model (Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, OLMoE, Phi-3, Gemma 2/3;
    Mixtral as `llama`) as llama.cpp's converter writes it, F32, by the `gguf` package:
    `{arch}.*` metadata, tensors under the names the package's own map gives
    (`gguf.get_tensor_name_map`), each layer's experts stacked into one tensor per projection,
    q/k rows permuted for llama (llama.cpp's converter's permutation; the others keep Hugging
    Face's order), Gemma's norms + 1, a byte-level vocabulary of the model's size with a few
    merges (`pre`: its tokenizer.ggml.pre). `folder`: the model's save_pretrained folder,
    whose tensors are written (transformers fuses an MoE layer's experts in memory; the
    checkpoint keeps them apart, as the converter reads them)."""
    import gguf
    from safetensors.torch import load_file
    from tokenizers import pre_tokenizers

    cfg = model.config
    names = gguf.get_tensor_name_map(
        next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch),
        cfg.num_hidden_layers,
    )
    writer = gguf.GGUFWriter(str(path), arch=arch)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = ["Ġt", "he", "Ġthe", "12", "Ġ1", "'s", "ll"]
    tokens = SPECIAL + alphabet + merged
    tokens += [f"w{i}" for i in range(cfg.vocab_size - len(tokens))]
    for key, value in {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "expert_count": getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0),
        "expert_used_count": getattr(cfg, "num_experts_per_tok", 0),
        "expert_feed_forward_length": getattr(cfg, "moe_intermediate_size", 0),
        "expert_shared_feed_forward_length": getattr(cfg, "shared_expert_intermediate_size", 0),
    }.items():
        if value:
            writer.add_uint32(f"{arch}.{key}", value)
    if getattr(cfg, "norm_topk_prob", None) is not None and arch != "llama":
        writer.add_bool(f"{arch}.expert_weights_norm", cfg.norm_topk_prob)
    gemma = arch in ("gemma2", "gemma3")
    if getattr(cfg, "sliding_window", None) and (arch == "phi3" or gemma):
        writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    if arch == "gemma3":  # a RoPE per layer kind: the global one may be scaled
        rope, local = rope["full_attention"], rope["sliding_attention"]
        writer.add_float32(f"{arch}.rope.freq_base_swa", local["rope_theta"])
        if rope.get("rope_type") == "linear":
            writer.add_string(f"{arch}.rope.scaling.type", "linear")
            writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        windowed = [kind == "sliding_attention" for kind in cfg.layer_types]
        writer.add_array(f"{arch}.attention.sliding_window_pattern", windowed)
    if arch == "gemma2":
        writer.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        writer.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    writer.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    control, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)
    writer.add_array(
        "tokenizer.ggml.token_type", [control if t in SPECIAL else normal for t in tokens]
    )
    writer.add_array("tokenizer.ggml.merges", ["Ġ t", "h e", "Ġt he", "1 2", "Ġ 1", "' s", "l l"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", cfg.bos_token_id)
    writer.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_id)
    stacked: dict[str, list[np.ndarray]] = {}
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    state = model.state_dict() if folder is None else load_file(str(folder / "model.safetensors"))
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, kind = name.rsplit(".", 1)
        array = tensor.detach().float().numpy()
        parts = stem.split(".")
        if "experts" in parts:  # ...experts.E.proj: stacked under ...experts.proj
            at = parts.index("experts")
            stacked.setdefault(".".join(parts[: at + 1] + parts[at + 2 :]) + "." + kind, []).append(
                array
            )
            continue
        if gemma and parts[-1].endswith("norm"):  # llama.cpp's converter stores 1 + weight
            array = array + 1.0
        if arch == "llama" and parts[-1] in heads and kind == "weight":  # llama.cpp's permute
            n = heads[parts[-1]]
            array = array.reshape(n, 2, array.shape[0] // n // 2, *array.shape[1:])
            array = array.swapaxes(1, 2).reshape(tensor.shape)
        writer.add_tensor(f"{names.get_name(stem)}.{kind}", array)
    for name, experts in stacked.items():
        stem, kind = name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(stem)}.{kind}", np.stack(experts))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


REPO = Path(__file__).resolve().parents[1]


def run_on_checkpoint(
    path: Path, run_dir: Path, num_requests: int = 2
) -> subprocess.CompletedProcess[str]:
    """`inferlab run model=hf model.path=PATH` into `run_dir`, in a process of its own (Hydra's
    logging setup would outlive an in-process run)."""
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "model=hf", f"model.path={path}",
         f"workload.num_requests={num_requests}", "run.warmup_requests=0",
         f"hydra.run.dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def randomize_weights(model: Any, seed: int) -> None:
    """A transformers model's weights far from HF's tiny init, so logits spread out and greedy
    never sees a tie."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)  # non-trivial norm weights are checked too
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.15 * noise)


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json covering every id below `vocab_size` (`t0 t1 ...`), so the
    engine samples the whole vocabulary (the built-in tokenizer has fewer ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def random_hf_llama(folder: Path, vocab_size: int, seed: int) -> Any:
    """A small Llama (2 layers, GQA 4/2, hidden 64) as a transformers model with weights far
    from HF's init, saved in `folder` with a word-level tokenizer over its whole vocabulary; the
    model is returned for reference computations (fp32, eager attention)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = "eager"  # the plain reference path
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_weights(model, seed)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, vocab_size)
    return model


def write_random_lora(
    folder: Path, rank: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0
) -> Path:
    """A PEFT-layout LoRA adapter for the `tiny` preset: random A and B (large enough to
    change the output) on every layer's `targets`, as `peft`'s save_pretrained writes it."""
    import torch

    cfg = resolve_model("tiny")
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "q_proj": (q, cfg.hidden_size), "k_proj": (kv, cfg.hidden_size),
        "v_proj": (kv, cfg.hidden_size), "o_proj": (cfg.hidden_size, q),
        "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
        "up_proj": (cfg.intermediate_size, cfg.hidden_size),
        "down_proj": (cfg.hidden_size, cfg.intermediate_size),
    }  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in targets:
            out, fan_in = shapes[module]
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.5
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
