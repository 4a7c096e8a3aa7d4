"""A quantized GGUF file run as stored (`engine.quantization=auto`, the default): every layer
kept in the file's own types by the engine's kernels, giving the dequantize-then-float32
engine's greedy tokens and its logits to float32 rounding; on files llama.cpp's own quantizer
made (its K-quant mixes, with their fallbacks) and on SmolLM2's real ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_gguf_of

from engines.builtin import LLM, SamplingParams
from harness.measuring.quality import prompt_logits
from models.gguf_quantize import llama_quantize
from models.gguf_reencode import GGUF_TYPES, convert_to_gguf

PROMPTS = [[5, 17, 99, 3, 250, 31], [7, 8, 9], [200, 100, 50, 25, 12, 6, 3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with K-quant-sized rows (256 inputs) as llama.cpp's converter writes it, F32."""
    import transformers

    folder = tmp_path_factory.mktemp("llama256")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.08 if p.dim() > 1 else 0.2) + (p.dim() == 1))
    model.save_pretrained(folder)
    return write_gguf_of(model, folder / "f32.gguf", "llama", folder=folder)


def quantized(f32: Path, kind: str) -> Path:
    out = f32.with_name(f"{kind}.gguf")
    if not out.exists():
        if kind in GGUF_TYPES:  # the gguf package's own encoders
            convert_to_gguf(f32, out, kind)
        else:
            pytest.importorskip("llama_cpp", reason="llama.cpp's quantizer: make setup-peer")
            llama_quantize(f32, out, kind)
    return out


def engine(path: Path, **options: object) -> LLM:
    return LLM(model=str(path), max_model_len=128, max_num_seqs=4, kv_cache_prefault=False,
               **options)  # fmt: skip


def assert_kept_as_stored(llm: LLM) -> set[str]:
    """Every linear layer runs its file's types through a C kernel; those types."""
    methods = llm.engine.describe()["linear_methods"]
    assert all("(exact); kernel native" in m for m in methods.values()), methods
    return {t for m in methods.values() for t in m.split(" as ")[0].split("+")}


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    ("kind", "types"),
    [
        ("q8_0", {"Q8_0"}),
        ("q4_0", {"Q4_0"}),
        ("q4_1", {"Q4_1"}),
        ("q5_0", {"Q5_0"}),
        ("q5_1", {"Q5_1"}),
        ("q4_k_m", {"Q4_K", "Q6_K"}),
        ("q5_k_m", {"Q5_K", "Q6_K"}),
        ("q6_k", {"Q6_K"}),
    ],
)
def test_a_quantized_file_runs_as_stored_and_equals_its_dequantized_model(
    f32_gguf: Path, kind: str, types: set[str]
) -> None:
    path = quantized(f32_gguf, kind)
    with engine(path) as kept, engine(path, quantization="none") as dense:
        assert types <= assert_kept_as_stored(kept)
        assert greedy(kept) == greedy(dense)
        for got, want in zip(
            prompt_logits(kept, PROMPTS), prompt_logits(dense, PROMPTS), strict=True
        ):
            spread = want.abs().max().item()
            torch.testing.assert_close(got / spread, want / spread, rtol=0, atol=2e-5)
        # the stored form is what is read: fewer bytes than the float32 weights
        kept_bytes = kept.engine.describe()["linear_weight_bytes"]
        assert kept_bytes < dense.engine.describe()["linear_weight_bytes"] / 2


@pytest.mark.parametrize(("kind", "layout"), [("q4_k_m", "int4"), ("q5_1", "int5 blocks")])
def test_int8_activations_and_the_torch_path_stay_near_the_file(
    f32_gguf: Path, kind: str, layout: str
) -> None:
    path = quantized(f32_gguf, kind)
    with engine(path, quantization="none") as dense:
        want = prompt_logits(dense, PROMPTS)
    for options in ({"quantization_activations": "int8"}, {"native_kernels": False}):
        with engine(path, **options) as llm:
            methods = llm.engine.describe()["linear_methods"].values()
            expected = "int8 activations" if options.get("native_kernels", True) else "dequantize"
            assert all(expected in m for m in methods), methods
            if "quantization_activations" in options:  # INT5 blocks beside INT8 activations
                assert any(f"as {layout} " in m for m in methods), methods
            for got, ref in zip(prompt_logits(llm, PROMPTS), want, strict=True):
                assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.peer
@pytest.mark.parametrize("name", ["smollm2-135m-q8_0", "smollm2-135m-q4_k_m"])
def test_smollm2_files_give_the_dequantized_model_s_greedy_tokens(name: str) -> None:
    pytest.importorskip("llama_cpp", reason="llama.cpp's quantizer: make setup-peer")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for quantization in ("auto", "none"):
        with LLM(model=name, quantization=quantization, max_model_len=256) as llm:
            outputs[quantization] = [o.token_ids for o in llm.generate(prompts, params)]
            if quantization == "auto":
                kept = assert_kept_as_stored(llm)
    assert outputs["auto"] == outputs["none"]
    assert kept == ({"Q8_0"} if name.endswith("q8_0") else {"Q4_K", "Q5_0", "Q6_K", "Q8_0"})


@pytest.mark.slow
@pytest.mark.serial
def test_two_tensor_parallel_ranks_cut_a_quantized_file_as_one_runs_it(f32_gguf: Path) -> None:
    """Row-parallel layers keep whole groups of the file's columns; each rank's tokens are one
    rank's."""
    path = quantized(f32_gguf, "q4_k_m")
    tokens = {}
    for ranks in (1, 2):
        with engine(path, tensor_parallel_size=ranks, num_threads=1) as llm:
            assert_kept_as_stored(llm)
            tokens[ranks] = greedy(llm)
    assert tokens[2] == tokens[1]
