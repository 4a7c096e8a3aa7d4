"""train-tiny (a tiny real Llama trained on CPU) and the quality probe (KL, top-1, perplexity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engines.builtin import LLM, SamplingParams
from harness.measuring.quality import (
    perplexity,
    probe_prompts,
    prompt_set_format,
    prompt_set_texts,
    quality_probe,
    run_quality,
)
from models.train_tiny import cached_tiny_model, corpus_text, train_tiny

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

transformers = pytest.importorskip("transformers")

# Small enough to train in a few seconds, trained enough that its logits carry signal.
TINY = dict(
    steps=60,
    seed=0,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    seq_len=64,
    batch=8,
    lr=3e-3,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny(None, tmp_path_factory.mktemp("tiny") / "model", **TINY)


@pytest.fixture(scope="module")
def prompts(trained: Path) -> list[list[int]]:
    ids = LLM(model=str(trained), dtype="float32").tokenizer.encode(
        corpus_text(), add_special_tokens=False
    )
    return [ids[i : i + 40] for i in range(0, 40 * 6, 40)]


def test_train_tiny_is_deterministic_and_learns(trained: Path, tmp_path: Path) -> None:
    log = json.loads((trained / "train_log.json").read_text())
    assert log["steps"] == TINY["steps"]
    assert log["first_loss"] > 7.5  # ~ln(vocab) at initialisation
    assert log["final_loss"] < log["first_loss"] - 1.5
    again = train_tiny(None, tmp_path / "again", **TINY)
    a = load_file(trained / "model.safetensors")
    b = load_file(again / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = train_tiny(None, tmp_path / "other", **{**TINY, "steps": 2, "seed": 1})
    c = load_file(other / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_engine_greedy_matches_hf(trained: Path, prompts: list[list[int]]) -> None:
    llm = LLM(model=str(trained), dtype="float32")
    assert llm.engine.runner.weights_source == "checkpoint"
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    n = 12
    outs = llm.generate(prompts[:3], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts[:3], outs, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[len(prompt) :]


def test_probe_identical_engines(trained: Path, prompts: list[list[int]]) -> None:
    a = LLM(model=str(trained), dtype="float32")
    b = LLM(model=str(trained), dtype="float32")
    r = quality_probe(a, b, prompts)
    assert r["kl_mean"] == 0.0 and r["max_abs_logit_error"] == 0.0
    assert r["top1_agreement"] == 1.0
    assert r["positions"] == sum(map(len, prompts))
    assert r["counted_positions"] + r["excluded_positions"] == r["positions"]
    # the probe's perplexity: each prompt's next tokens, as perplexity() of that one window
    assert r["perplexity"] == r["reference_perplexity"]
    one = quality_probe(a, b, prompts[:1])
    text = a.tokenizer.decode(prompts[0])
    assert a.tokenizer.encode(text, add_special_tokens=False) == list(prompts[0])
    assert one["perplexity"] == pytest.approx(perplexity(a, text), rel=1e-9)


def test_probe_bf16_small_and_broken_large(trained: Path, prompts: list[list[int]]) -> None:
    ref = LLM(model=str(trained), dtype="float32")
    bf16 = quality_probe(ref, LLM(model=str(trained), dtype="bfloat16"), prompts)
    assert 0.0 < bf16["kl_mean"] < 0.01
    assert bf16["top1_agreement"] >= 0.9
    broken = LLM(model=str(trained), dtype="float32", model_overrides={"rope_theta": 30.0})
    bad = quality_probe(ref, broken, prompts)
    assert bad["kl_mean"] > 20 * bf16["kl_mean"]
    dummy = quality_probe(
        ref, LLM(model=str(trained), dtype="float32", load_format="dummy"), prompts
    )
    assert dummy["kl_mean"] > 1.0
    assert dummy["top1_agreement"] < 0.5


def test_perplexity_trained_below_untrained(trained: Path) -> None:
    text = corpus_text()
    llm = LLM(model=str(trained), dtype="float32")
    ppl = perplexity(llm, text)
    untrained = perplexity(LLM(model=str(trained), dtype="float32", load_format="dummy"), text)
    assert ppl < llm.tokenizer.vocab_size / 10
    assert ppl < untrained / 5
    # windows are an upper bound on context: a shorter window cannot help much
    assert perplexity(llm, text, window=16) > 0.9 * ppl


def test_cached_model_and_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness import cli

    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(tmp_path / "cache"))
    small = {**TINY, "steps": 2}
    first = cached_tiny_model(**small)
    assert first.parent == tmp_path / "cache" and first.name.startswith("tiny-trained-")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_tiny_model(**small) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert cached_tiny_model(**{**small, "seed": 1}) != first
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert (
        cli.main(
            ["train-tiny", "--text", str(text), "--out", str(tmp_path / "cli"), "--steps", "2"]
        )
        == 0
    )
    LLM(model=str(tmp_path / "cli"), dtype="float32")  # loads in the engine


def test_train_tiny_writes_over_a_model_only_when_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`train-tiny --out FOLDER` replaced the config.json and model.safetensors of the
    checkpoint in FOLDER; it is now refused before training, naming --out and --force."""
    from harness import cli

    out = tmp_path / "checkpoint"
    out.mkdir()
    (out / "model.safetensors").write_text("the user's own weights")
    assert cli.main(["train-tiny", "--steps", "1", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"inferlab train-tiny: --out: {out} exists (a folder that is not empty) and would be "
        "written over; give --force to replace what is there, or name a path that does not "
        "exist\n"
    )
    assert (out / "model.safetensors").read_text() == "the user's own weights"
    assert cli.main(["train-tiny", "--steps", "1", "--out", str(out), "--force"]) == 0
    LLM(model=str(out), dtype="float32")  # replaced, as asked


def test_run_quality_sees_the_int8_kv_cache() -> None:
    results = {}
    for kv_dtype in ("auto", "int8"):
        options = {
            "model": "tiny",
            "dtype": "float32",
            "kv_cache": "paged",
            "kv_cache_dtype": kv_dtype,
        }
        candidate = LLM(**options)
        results[kv_dtype] = run_quality(
            candidate.engine.config.to_dict(), candidate, {"num_prompts": 2, "prompt_len": 48}
        )
    assert results["auto"]["kl_mean"] == 0.0  # fp32 against fp32: the same numbers
    assert results["int8"]["kl_mean"] > 0.0  # chunks read the quantized cache back
    assert "perplexity" not in results["int8"]  # dummy weights: no perplexity


def test_probe_prompts_add_real_chat_text_from_prompt_sets() -> None:
    traces = Path(__file__).resolve().parents[3] / "data" / "traces"
    sets = [str(traces / "sharegpt_v3_filtered_500.json"), str(traces / "mt_bench_questions.jsonl")]
    assert [prompt_set_format(p) for p in sets] == ["sharegpt", "mt_bench"]
    assert prompt_set_format("prompts.txt.gz") == "text"
    llm = LLM(model="tiny", dtype="float32", max_model_len=128)
    settings = {"num_prompts": 3, "prompt_len": 40, "prompt_sets": sets}
    prompts = probe_prompts(llm.tokenizer, llm.engine.limits.max_model_len, settings)
    assert len(prompts) == 3 * 3 and all(2 <= len(p) <= 40 for p in prompts)
    chats = prompt_set_texts(sets[0], 3)
    assert chats[0].startswith("How to stop automatic updates")  # items 0, 166, 333 of 500
    # MT-Bench: both turns of a question
    assert "\n\n" in prompt_set_texts(sets[1], 1)[0]
    assert prompts[3] == llm.tokenizer.encode(chats[0], add_special_tokens=False)[:40]
    assert (
        prompts[6]
        == llm.tokenizer.encode(prompt_set_texts(sets[1], 3)[0], add_special_tokens=False)[:40]
    )


def test_run_quality_of_int4_with_int8_activations_builds_its_float_reference() -> None:
    """The reference drops the quantization and the options that only go with it (INT8
    activations need INT4 weights), and the probe sees the weights' and activations' error."""
    options = {
        "model": "tiny",
        "dtype": "float32",
        "quantization": "int4",
        "quantization_group_size": 32,
        "quantization_activations": "int8",
        "model_overrides": {"intermediate_size": 192},
    }
    candidate = LLM(**options)
    result = run_quality(
        candidate.engine.config.to_dict(), candidate, {"num_prompts": 2, "prompt_len": 48}
    )
    assert result["kl_mean"] is not None and result["kl_mean"] > 0.0


def test_run_quality_of_a_tensor_parallel_engine() -> None:
    """The reference runs on one rank, the candidate is the measured engine: no second
    tensor-parallel engine (a second torch.distributed world) in the process."""
    candidate = LLM(model="tiny", dtype="float32", tensor_parallel_size=2, num_threads=1)
    try:
        result = run_quality(
            candidate.engine.config.to_dict(), candidate, {"num_prompts": 2, "prompt_len": 48}
        )
    finally:
        candidate.engine.close()
    # float32 on two ranks against one: the all-reduce's summation order only
    assert result["top1_agreement"] == 1.0
    assert result["kl_mean"] is not None and result["kl_mean"] < 1e-6
