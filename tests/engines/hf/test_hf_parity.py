"""The built-in engine against Hugging Face transformers on small random checkpoints.

Each architecture variant is built as a real `transformers` model with enlarged random weights,
saved with `save_pretrained` (safetensors) and loaded by the engine from the folder. The engine's
logits at every prefill position and every decode step (seen through the engine's
`add_logits_observer`) must match HF's no-cache forward over the same tokens, and its greedy
continuation of a mixed-length batch must equal HF's greedy `generate` on each prompt alone.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import randomize_weights, write_word_tokenizer
from safetensors.torch import load_file, save_file

from engines.builtin import LLM, SamplingParams
from engines.builtin.kv_cache.groups import kv_groups
from engines.builtin.weights import MissingWeightsError
from models.config import UnsupportedCheckpointError, from_hf_config
from models.location import resolve_model

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

transformers = pytest.importorskip("transformers")

VOCAB = 4096
# Prompts of different lengths, several longer than the Mistral window; ids avoid 0..6.
PROMPT_LENS = (5, 12, 19, 27)
# Different lengths per request so requests finish at different steps and a queued one is
# prefilled in the same step as the others' decodes (max_num_seqs=3 below).
MAX_TOKENS = (32, 40, 34, 36)
# Logits must agree to this fraction of the logits' scale (fp32 everywhere).
RTOL_SCALE = 1e-4

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # 64 < 256: with head_dim 16 the wavelengths span the high, medium (blended)
    # and low (scaled) bands of Llama-3.1 scaling.
    "original_max_position_embeddings": 64,
}

QWEN2_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=96,
)

SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    # head_dim 32 with 4 heads: q/k/v are wider than hidden_size (head_dim read from config)
    "llama_mha": ("LlamaConfig", dict(num_key_value_heads=4, num_hidden_layers=3, head_dim=32)),
    "llama_gqa": ("LlamaConfig", dict(rms_norm_eps=1e-5)),
    "llama_mqa": ("LlamaConfig", dict(num_key_value_heads=1)),
    "llama3_rope": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE)),
    "llama_linear_rope": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral_swa": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict()),
    # use_sliding_window: layer 0 global, layers 1 and 2 (from max_window_layers) windowed
    "qwen2_swa": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, num_hidden_layers=3),
    ),
    "qwen3": ("Qwen3Config", dict()),  # q/k norms per head
    # mixture of experts: 4 experts, 2 per token
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    # a gated shared expert, q/k/v biases, the second layer dense
    "qwen2_moe": ("Qwen2MoeConfig", dict(QWEN2_MOE, mlp_only_layers=[1])),
    # every layer sparse, as llama.cpp's qwen2moe files hold them (it has no dense layers)
    "qwen2_moe_sparse": ("Qwen2MoeConfig", QWEN2_MOE),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
    ),
    "olmoe": (
        "OlmoeConfig",
        dict(num_experts=4, num_experts_per_tok=2),
    ),  # q/k norms over all heads
    # packed qkv_proj and gate_up_proj, a sliding window
    "phi3": ("Phi3Config", dict(pad_token_id=0, sliding_window=8)),
    # sandwich norms, GeGLU, scaled embeddings, soft caps on scores and logits, windowed
    # layers 0 and 2 between global 1 and 3, 1/sqrt(query_pre_attn_scalar)
    "gemma2": (
        "Gemma2Config",
        dict(num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0),
    ),
    # q/k norms, a global layer between windowed ones, each kind with its own RoPE
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0},
            },
            pad_token_id=0,
        ),
    ),
    "llama_yarn": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    ),
}

#: Checkpoints only one test reads: llama.cpp scales Gemma's queries by 1/sqrt(head_dim)
#: (GGUF files hold no query_pre_attn_scalar), so their scalar is head_dim; dynamic NTK rope
#: (transformers' cached generate and full forward disagree past the original context, so it
#: is compared with generate alone) with an original context of 32, stretched to 128
ONE_TEST_SPECS = {
    **{
        f"{kind}_gguf": (SPECS[kind][0], {**SPECS[kind][1], "query_pre_attn_scalar": 16})
        for kind in ("gemma2", "gemma3")
    },
    "llama_dynamic": (
        "LlamaConfig",
        dict(
            max_position_embeddings=32,
            rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
        ),
    ),
}

# ---- building checkpoints -----------------------------------------------------------------


# Weight / prompt seed per variant; hf_reference asserts that its greedy steps have no near-ties.
SEEDS = {
    "llama_mha": 0,
    "llama_gqa": 1,
    "llama_mqa": 2,
    "llama3_rope": 3,
    "llama_linear_rope": 4,
    "llama_tied": 1,
    "mistral_swa": 2,
    "qwen2": 0,
    "qwen2_swa": 0,
    "qwen3": 0,
    "mixtral": 1,
    "qwen2_moe": 1,
    "qwen3_moe": 2,
    "qwen2_moe_sparse": 0,
    "olmoe": 0,
    "phi3": 0,
    "llama_yarn": 0,
    "gemma2": 0,
    "gemma3": 0,
    "gemma2_gguf": 0,
    "gemma3_gguf": 0,
    "llama_dynamic": 0,
}


def build_hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    config_cls, extra = {**SPECS, **ONE_TEST_SPECS}[kind]
    config = getattr(transformers, config_cls)(**{**BASE, **extra})
    config._attn_implementation = "eager"  # the plain reference path
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


def save_checkpoint(model: torch.nn.Module, folder: Path, **kwargs: Any) -> Path:
    model.save_pretrained(folder, **kwargs)
    write_word_tokenizer(folder, VOCAB)
    return folder


def make_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(7, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@dataclass
class Reference:
    """HF's greedy continuation of each prompt alone, and HF logits over it (no cache)."""

    folder: Path
    model: torch.nn.Module
    prompts: list[list[int]]
    sequences: list[list[int]] = field(default_factory=list)  # prompt + max(MAX_TOKENS)
    logits: list[torch.Tensor] = field(default_factory=list)  # [len(seq), vocab]


@torch.inference_mode()
def hf_reference(model: torch.nn.Module, folder: Path, prompts: list[list[int]]) -> Reference:
    ref = Reference(folder, model, prompts)
    new = max(MAX_TOKENS)
    # The engine's ignore_eos keeps EOS sampleable (and greedy does pick it at times); HF's
    # min_new_tokens would mask it instead, so HF generates with no EOS at all. (A None
    # eos_token_id passed to generate() falls back to the model's default, hence the copy.)
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    try:
        outs = [
            model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=int),
                do_sample=False,
                max_new_tokens=new,
                pad_token_id=0,
            )
            for p in prompts
        ]
    finally:
        model.generation_config = saved
    for prompt, out in zip(prompts, outs, strict=True):
        seq = out[0].tolist()
        assert len(seq) == len(prompt) + new
        logits = model(torch.tensor([seq])).logits[0].float()
        # No near-ties: a top-2 gap above twice the logits tolerance means that logits within
        # tolerance cannot pick another greedy token (if this fails, pick another seed).
        top2 = logits[len(prompt) - 1 : -1].topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        assert margin > 2 * RTOL_SCALE * float(logits.std()), f"near-tie in greedy: {margin}"
        # The reference is self-consistent: cached greedy generate == argmax of the full forward.
        teacher = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert teacher == seq[len(prompt) :], "HF generate disagrees with its own forward"
        ref.sequences.append(seq)
        ref.logits.append(logits)
    return ref


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[tuple[str, int], Reference] = {}

    def get(kind: str, seed: int | None = None) -> Reference:
        seed = SEEDS[kind] if seed is None else seed
        if (kind, seed) not in cache:
            model = build_hf_model(kind, seed)
            folder = save_checkpoint(model, tmp_path_factory.mktemp(kind))
            cache[kind, seed] = hf_reference(model, folder, make_prompts(seed))
        return cache[kind, seed]

    return get


# ---- running the engine -------------------------------------------------------------------


@dataclass
class EngineRun:
    outputs: list
    max_error: float = 0.0  # max |engine - HF| over every observed logits row
    observed: dict[int, set[int]] = field(default_factory=dict)  # prompt index -> positions
    rows: int = 0
    diverged: list[tuple[int, int]] = field(default_factory=list)


def run_engine(ref: Reference, folder: Path | None = None, **options: Any) -> EngineRun:
    """Generate the batch together; compare every logits row with HF on the fly."""
    llm = LLM(
        model=str(folder or ref.folder),
        dtype="float32",
        **{"max_num_seqs": 3, "max_model_len": 128, **options},
    )
    assert llm.tokenizer.vocab_size == VOCAB
    index = {tuple(p): i for i, p in enumerate(ref.prompts)}
    run = EngineRun(outputs=[])

    def observer(plan, logits: torch.Tensor) -> None:
        assert logits.dtype == torch.float32
        assert logits.shape == (plan.num_tokens, VOCAB)
        row = 0
        for item in plan.scheduled:
            i = index[tuple(item.seq.prompt_token_ids)]
            seq, hf = ref.sequences[i], ref.logits[i]
            for j in range(item.num_new_tokens):
                pos = item.num_computed_before + j
                if item.seq.token_ids[: pos + 1] != seq[: pos + 1]:
                    run.diverged.append((i, pos))  # greedy already went another way
                else:
                    err = (logits[row] - hf[pos]).abs().max().item()
                    run.max_error = max(run.max_error, err)
                    run.observed.setdefault(i, set()).add(pos)
                row += 1
        run.rows += row
        assert row == logits.shape[0]

    llm.engine.add_logits_observer(observer)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    run.outputs = llm.generate(ref.prompts, params)
    return run


def check_against_hf(ref: Reference, run: EngineRun) -> None:
    for i, (prompt, out) in enumerate(zip(ref.prompts, run.outputs, strict=True)):
        assert out.error is None
        assert out.finish_reason == "length"
        expected = ref.sequences[i][len(prompt) : len(prompt) + MAX_TOKENS[i]]
        assert out.token_ids == expected, f"prompt {i}: greedy tokens differ from HF"
    assert not run.diverged
    for i, prompt in enumerate(ref.prompts):
        # every prefill position and every decode step (the last sampled token is never fed)
        needed = set(range(len(prompt) + MAX_TOKENS[i] - 1))
        assert run.observed.get(i, set()) >= needed, f"prompt {i}: positions not observed"
    scale = max(float(lg.std()) for lg in ref.logits)
    assert scale > 0.5, f"logits std {scale} is too small for a meaningful comparison"
    assert run.max_error <= RTOL_SCALE * scale, (
        f"max |engine - HF| logits = {run.max_error:.3g} (logits std {scale:.3g})"
    )


# ---- parity -------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache", ["contiguous", "none"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_logits_and_greedy_match_hf(reference, kind: str, kv_cache: str) -> None:
    ref = reference(kind)
    config = from_hf_config(ref.folder)
    if kind == "mistral_swa":
        assert config.sliding_window == 8 < max(PROMPT_LENS)
    if kind == "llama3_rope":
        assert config.rope_scaling and config.rope_scaling["rope_type"] == "llama3"
        assert config.rope_theta == 50000.0
    if kind == "llama_yarn":  # interpolated frequencies, cos and sin scaled by 0.1 ln 4 + 1
        assert config.rope_scaling and config.rope_scaling["rope_type"] == "yarn"
    if kind == "phi3":
        assert config.sliding_window == 8
    if kind == "llama_linear_rope":
        assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    if kind == "llama_mha":
        assert config.num_kv_heads == config.num_heads and config.head_dim == 32
    if kind == "qwen2":
        assert config.attention_bias
    if kind == "llama_tied":
        assert config.tie_word_embeddings
    run = run_engine(ref, kv_cache=kv_cache)
    check_against_hf(ref, run)


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_swa", "qwen2"])
@pytest.mark.parametrize("kv_cache", ["contiguous", "none"])
def test_torch_attention_backend_matches_hf(reference, kind: str, kv_cache: str) -> None:
    ref = reference(kind)
    check_against_hf(ref, run_engine(ref, kv_cache=kv_cache, attention_backend="torch"))


FAMILIES = [
    "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phi3", "gemma2", "gemma3", "qwen2_swa"
]  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        dict(kv_cache="paged", enable_prefix_caching=True),
        dict(kv_cache="paged", enable_chunked_prefill=True, max_num_batched_tokens=10),
        dict(kv_cache="paged", block_size=4, attention_backend="torch"),
        dict(kv_cache="paged", max_num_seqs=1),
        dict(kv_cache="paged", max_num_seqs=len(PROMPT_LENS)),
    ],
    ids=["prefix", "chunked", "torch", "batch1", "batch_all"],
)
@pytest.mark.parametrize("kind", FAMILIES)
def test_new_families_match_hf_in_paged_modes(reference, kind: str, options) -> None:
    """Qwen3's and OLMoE's q/k norms, the mixture-of-experts layers, Gemma's and windowed
    Qwen's layer kinds (a hybrid KV cache) with paged KV, prefix caching, chunked prefill, the
    torch attention backend, one sequence at a time and every prompt in one batch."""
    ref = reference(kind)
    layer_kinds = kv_groups(from_hf_config(ref.folder))
    assert (layer_kinds is not None) == (kind in ("gemma2", "gemma3", "qwen2_swa"))
    check_against_hf(ref, run_engine(ref, **options))


def test_new_families_read_their_configs(reference) -> None:
    configs = {kind: from_hf_config(reference(kind).folder) for kind in FAMILIES}
    assert configs["qwen3"].qk_norm == "head" and not configs["qwen3"].num_experts
    mixtral = configs["mixtral"]
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (
        4,
        2,
        True,
    )
    qwen2_moe = configs["qwen2_moe"]
    assert qwen2_moe.dense_layers == (1,) and qwen2_moe.attention_bias
    assert (qwen2_moe.moe_intermediate_size, qwen2_moe.shared_expert_intermediate_size) == (64, 96)
    assert configs["qwen3_moe"].qk_norm == "head" and configs["qwen3_moe"].norm_topk_prob
    assert configs["olmoe"].qk_norm == "full" and not configs["olmoe"].norm_topk_prob
    gemma2, gemma3 = configs["gemma2"], configs["gemma3"]
    assert gemma2.full_attention_layers == (1, 3) and gemma2.sliding_window == 8
    assert gemma2.kv_sliding_window is None  # the global layers keep every key
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.attention_scale == 24**-0.5 and gemma2.embedding_multiplier == 8.0
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.sandwich_norms
    assert gemma3.full_attention_layers == (1,) and gemma3.qk_norm == "head"
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (100000.0, 10000.0)
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    qwen2_swa = configs["qwen2_swa"]
    assert (qwen2_swa.sliding_window, qwen2_swa.full_attention_layers) == (8, (0,))
    for kind, config in configs.items():  # the parameters counted are the checkpoint's
        hf = sum(p.numel() for p in reference(kind).model.parameters())
        assert config.num_parameters() == hf, kind
    active = mixtral.num_parameters(active=True)  # 2 of 4 experts' MLPs per token
    assert mixtral.num_parameters() - active == 2 * 2 * 3 * 64 * 128


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize(
    ("kind", "layers"),
    [
        # the experts and the shared expert (the router stays float)
        ("qwen2_moe", ["mlp.experts.3.gate_up_proj", "mlp.experts.0.down_proj",
                       "mlp.shared_expert.down_proj"]),
        ("gemma3", ["mlp.gate_up_proj", "attn.qkv_proj"]),  # GeGLU, sandwich-normed layers
    ],
)  # fmt: skip
def test_quantized_families_run_their_dequantized_weights(
    reference, kind: str, layers: list[str], quantization: str
) -> None:
    """INT8 / INT4 weights give the tokens of the same engine with every quantized layer
    replaced by its dequantized weights."""
    from dequantized_twin import dequantized_twin_tokens

    ref = reference(kind)
    llm = LLM(
        model=str(ref.folder),
        dtype="float32",
        max_model_len=128,
        quantization=quantization,
        quantization_group_size=32,
    )
    kept = llm.engine.runner.model.linear_methods()
    for name in layers:
        assert kept[f"layers.*.{name}"].startswith(quantization), kept
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(ref.prompts, params)]
    assert tokens == dequantized_twin_tokens(llm, ref.prompts, params)


@pytest.mark.parametrize(
    ("kind", "arch"),
    [
        ("qwen2", "qwen2"),
        ("qwen3", "qwen3"),
        ("qwen2_moe_sparse", "qwen2moe"),  # the shared expert and its gate
        ("qwen3_moe", "qwen3moe"),
        ("mixtral", "llama"),  # llama.cpp writes Mixtral as a llama with experts
        ("olmoe", "olmoe"),  # q/k norms over all heads
        ("phi3", "phi3"),  # q/k/v in one tensor, gate and up in one, a sliding window
        ("gemma2_gguf", "gemma2"),  # norms + 1, soft caps, windowed layers
        ("gemma3_gguf", "gemma3"),  # a RoPE per layer kind, the global one scaled
    ],
)
def test_a_gguf_of_another_family_loads_as_the_model_it_was_written_from(
    reference, kind: str, arch: str, tmp_path: Path
) -> None:
    """A GGUF of a non-Llama family, written by the `gguf` package in llama.cpp's layout
    (Qwen2's q/k/v biases, Qwen3's q/k norms, no q/k permutation but for llama; each layer's
    experts stacked per projection) loads as the model it came from: the engine gives that
    model's logits and greedy tokens. For Qwen2, transformers' own GGUF loader reads the file
    as that model too (its Qwen3 reader takes no head_dim from a file, and assumes Qwen3's
    128); `inferlab convert` writes each back as its own family's folder."""
    from checkpoints import write_gguf_of

    ref = reference(kind)
    path = write_gguf_of(ref.model, tmp_path / f"{kind}.gguf", arch, folder=ref.folder)
    if kind == "qwen2":
        reread = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=path.name, dtype=torch.float32
        ).eval()
        tokens = torch.tensor([ref.sequences[3]])
        with torch.inference_mode():
            torch.testing.assert_close(reread(tokens).logits, ref.model(tokens).logits)
    written, read = from_hf_config(ref.folder), resolve_model(str(path))
    fields = ("architecture", "num_layers", "num_kv_heads", "head_dim", "attention_bias")
    fields += ("sliding_window", "norm_topk_prob")
    moe = ("num_experts", "expert_intermediate_size", "shared_expert_intermediate_size")
    for name in (*fields, "qk_norm", "tie_word_embeddings", *moe, "dense_layers"):
        assert getattr(read, name) == getattr(written, name), name
    check_against_hf(ref, run_engine(ref, folder=path))
    # `inferlab convert` writes it back as the family's own Hugging Face folder
    from models.gguf_convert import convert_to_hf

    folder = convert_to_hf(path, tmp_path / "converted")
    converted = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert type(converted) is type(ref.model)
    tokens = torch.tensor([ref.sequences[0]])
    with torch.inference_mode():
        torch.testing.assert_close(converted(tokens).logits, ref.model(tokens).logits)


def test_a_qwen2_gguf_tokenizer_splits_as_transformers_reads_it(reference, tmp_path: Path) -> None:
    """llama.cpp writes tokenizer.ggml.pre = "qwen2" in Qwen2/Qwen3 files: the tokenizer built
    from the file encodes as transformers' own GGUF tokenizer does (single digits, contractions
    of either case, newlines after punctuation)."""
    from checkpoints import write_gguf_of

    from models.gguf import tokenizer_folder
    from models.tokenizer import load_tokenizer

    path = write_gguf_of(reference("qwen2").model, tmp_path / "q.gguf", "qwen2", pre="qwen2")
    ours = load_tokenizer(str(tokenizer_folder(path)))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ("the 12 cats' bell 1234", "He'S here!\n\nthe\tend  ", "tell 'll 12x12"):
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        ), text


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen2_swa"])
def test_inferlab_serve_answers_with_the_families_greedy_tokens(reference, kind: str) -> None:
    """`inferlab serve` on a folder of each new kind of layer: /v1/completions with the prompt's
    token ids returns transformers' greedy continuation."""
    import httpx

    from serving.testing import serve_engine

    ref = reference(kind)
    with (
        serve_engine({"dtype": "float32", "max_model_len": 128}, model=str(ref.folder)) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as client,
    ):
        for prompt, sequence in zip(ref.prompts[:2], ref.sequences[:2], strict=True):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            body["return_token_ids"] = True
            answer = client.post("/v1/completions", json={"model": str(ref.folder), **body})
            assert answer.status_code == 200, answer.text
            tokens = answer.json()["choices"][0]["token_ids"]
            assert tokens == sequence[len(prompt) : len(prompt) + 8]


def test_sdpa_backend_matches_hf(reference) -> None:
    ref = reference("llama_mqa")
    check_against_hf(ref, run_engine(ref, attention_backend="sdpa"))


def test_greedy_through_eos(reference) -> None:
    """With this seed HF's greedy picks EOS (id 2) early in prompt 0: ignore_eos generates
    through it exactly like HF, and without ignore_eos the request stops right there."""
    ref = reference("llama_mqa", seed=0)
    eos = 2
    generated = ref.sequences[0][len(ref.prompts[0]) :]
    assert eos in generated[: MAX_TOKENS[0] - 1]
    check_against_hf(ref, run_engine(ref))
    llm = LLM(model=str(ref.folder), dtype="float32", max_model_len=128)
    assert eos in llm.engine.eos_ids
    out = llm.generate(ref.prompts[0], SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == generated[: generated.index(eos) + 1]


def test_sharded_checkpoint(reference, tmp_path: Path) -> None:
    ref = reference("llama_gqa")
    folder = save_checkpoint(ref.model, tmp_path / "sharded", max_shard_size="300KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert not (folder / "model.safetensors").exists()
    run = run_engine(ref, folder=folder, kv_cache="contiguous")
    check_against_hf(ref, run)


def test_dynamic_ntk_rope_generates_as_transformers(tmp_path: Path) -> None:
    """Dynamic NTK scaling past an original context of 32 (prompts within it, generation to
    position 66): the engine's greedy tokens and logits are those of transformers' cached
    generate, at every step; with plain RoPE the tokens go another way."""
    model = build_hf_model("llama_dynamic")
    folder = save_checkpoint(model, tmp_path / "dynamic")
    prompts = make_prompts(SEEDS["llama_dynamic"])
    assert max(map(len, prompts)) <= 32 < max(map(len, prompts)) + max(MAX_TOKENS)
    model.generation_config.eos_token_id = None
    expected, scores = [], []
    for prompt, n in zip(prompts, MAX_TOKENS, strict=True):
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=int),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        expected.append(out.sequences[0, len(prompt) :].tolist())
        scores.append(torch.cat(out.scores).float())  # [n, vocab]: the logits of each step
    llm = LLM(model=str(folder), dtype="float32", max_num_seqs=3, max_model_len=128)
    errors: list[float] = []

    def observer(plan, logits: torch.Tensor) -> None:
        row = 0
        for item in plan.scheduled:
            i = prompts.index(item.seq.prompt_token_ids)
            for j in range(item.num_new_tokens):
                step = item.num_computed_before + j - (len(prompts[i]) - 1)
                if (
                    0 <= step < MAX_TOKENS[i]
                    and item.seq.token_ids[len(prompts[i]) :][:step] == expected[i][:step]
                ):
                    errors.append((logits[row] - scores[i][step]).abs().max().item())
                row += 1

    llm.engine.add_logits_observer(observer)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    assert [out.token_ids for out in llm.generate(prompts, params)] == expected
    assert len(errors) == sum(MAX_TOKENS)
    assert max(errors) <= RTOL_SCALE * float(torch.cat(scores).std())
    # plain RoPE over the same 128 positions: the same tokens within the original context,
    # others past it
    plain = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=128,
        model_overrides={"rope_scaling": None, "max_position_embeddings": 128},
    )
    got = [out.token_ids for out in plain.generate(prompts, params)]
    for tokens, want, prompt in zip(got, expected, prompts, strict=True):
        assert tokens[: 32 - len(prompt)] == want[: 32 - len(prompt)]
    assert got != expected


def test_legacy_rope_config_format(reference, tmp_path: Path) -> None:
    """transformers 4 wrote `rope_theta` and `rope_scaling` (with `type` or `rope_type`) at the
    top level; the same weights under such a config.json give the same results."""
    ref = reference("llama3_rope")
    for key in ("rope_type", "type"):

        def legacy(cfg: dict[str, Any], key: str = key) -> None:
            params = dict(cfg.pop("rope_parameters"))
            cfg["rope_theta"] = params.pop("rope_theta")
            params[key] = params.pop("rope_type")
            cfg["rope_scaling"] = params

        folder = _edited_copy(ref.folder, tmp_path / key, legacy)
        assert from_hf_config(folder) == from_hf_config(ref.folder)
        check_against_hf(ref, run_engine(ref, folder=folder))


# ---- refusals -----------------------------------------------------------------------------


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _set(**values: Any):
    return lambda cfg: cfg.update(values)


def _longrope(cfg: dict[str, Any]) -> None:  # Phi-3's long-context variants
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}


def _legacy_yarn(cfg: dict[str, Any]) -> None:  # without the context it was trained at
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0}


@pytest.mark.parametrize(
    ("kind", "edit", "names"),
    [
        ("llama_gqa", _set(hidden_act="gelu"), ["hidden_act", "gelu"]),
        ("llama_gqa", _set(mlp_bias=True), ["mlp_bias"]),
        ("llama_gqa", _longrope, ["rope", "longrope"]),
        ("llama_gqa", _legacy_yarn, ["rope_scaling.original_max_position_embeddings"]),
        ("llama_gqa", _set(partial_rotary_factor=0.5), ["partial_rotary_factor"]),
        (
            "llama_gqa",
            _set(architectures=["GPTNeoXForCausalLM"]),
            ["architecture", "GPTNeoXForCausalLM"],
        ),
        (
            "llama_gqa",
            _set(quantization_config={"quant_method": "bitsandbytes"}),
            ["quantization_config.quant_method", "awq|gptq|compressed-tensors"],
        ),
        (
            "qwen2",
            _set(use_sliding_window=True, sliding_window=8, max_window_layers=-1),
            ["max_window_layers", "-1"],
        ),
        ("qwen2", _set(use_sliding_window=True, layer_types=["full_attention"]), ["layer_types"]),
        ("llama_gqa", _set(attention_bias=True), ["attention_bias"]),
        ("llama_gqa", _set(sliding_window=8), ["sliding_window"]),
        ("llama_gqa", _set(pretraining_tp=2), ["pretraining_tp"]),
    ],
)
def test_unsupported_checkpoint_feature_is_named(
    reference, tmp_path: Path, kind: str, edit, names: list[str]
) -> None:
    folder = _edited_copy(reference(kind).folder, tmp_path / "edited", edit)
    with pytest.raises(UnsupportedCheckpointError) as info:
        LLM(model=str(folder), dtype="float32")
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("kind", "drop"),
    [
        ("llama_gqa", "model.layers.1.mlp.down_proj.weight"),
        ("llama_gqa", "model.layers.0.self_attn.k_proj.weight"),  # one part of the fused q/k/v
        ("llama_gqa", "lm_head.weight"),
        ("qwen2", "model.layers.0.self_attn.v_proj.bias"),
    ],
)
def test_missing_tensor_is_named(reference, tmp_path: Path, kind: str, drop: str) -> None:
    src = reference(kind).folder
    folder = tmp_path / "missing"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(src / name, folder / name)
    tensors = load_file(str(src / "model.safetensors"))
    assert drop in tensors
    del tensors[drop]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError) as info:
        LLM(model=str(folder), dtype="float32")
    assert drop in str(info.value)


def test_tied_checkpoint_may_carry_lm_head_copy(reference, tmp_path: Path) -> None:
    """Some tied checkpoints still store lm_head.weight; it is ignored, the result unchanged."""
    ref = reference("llama_tied")
    folder = tmp_path / "tied_copy"
    shutil.copytree(ref.folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    check_against_hf(ref, run_engine(ref, folder=folder))
