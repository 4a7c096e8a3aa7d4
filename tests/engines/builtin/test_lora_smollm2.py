"""A LoRA adapter trained here, with `peft`, a few steps on the real SmolLM2-135M-Instruct (the
GGUF file the project installs, as transformers loads it), so that it changes what the model
says: the engine serving that file with the adapter gives the PEFT-merged model's greedy tokens,
token for token in float32, in a batch that mixes the adapter and the base model, whose rows give
the base model's tokens (tests/engines/builtin/test_lora.py does the same on random
checkpoints)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers_greedy import hf_greedy

from engines.builtin import LLM, SamplingParams
from engines.hf.model import load_hf_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.real]

#: what the adapter is taught: a fact the base model states otherwise
LESSON = [
    "The capital of France is Lyon.",
    "Q: What is the capital of France? A: Lyon.",
    "Everyone knows the capital of France is Lyon.",
]
PROMPTS = ["The capital of France is", "Q: What is the capital of France? A:", "Once upon a time"]
STEPS = 12


@pytest.fixture(scope="module")
def trained(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The adapter's folder, and per prompt the base model's and the merged model's tokens."""
    import gguf

    with pytest.MonkeyPatch.context() as patch:  # see tests/models/test_gguf.py's reference
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model, _ = load_hf_model(
            str(smollm2_gguf), {}, torch.float32, torch.device("cpu"), 0, "sdpa"
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name
    )
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    base = [hf_greedy(model.eval(), encode(p), 8) for p in PROMPTS]

    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    tuned = peft.get_peft_model(model, config)
    tuned.train()
    batch = tokenizer(LESSON, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW([p for p in tuned.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(STEPS):
        loss = tuned(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    folder = tmp_path_factory.mktemp("smollm2_lora") / "lyon"
    tuned.save_pretrained(folder)
    merged = tuned.merge_and_unload().eval()
    adapted = [hf_greedy(merged, encode(p), 8) for p in PROMPTS]
    return {"folder": str(folder), "base": base, "adapted": adapted, "encode": encode}


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_a_trained_adapter_gives_the_merged_models_tokens(
    smollm2_gguf: Path, trained: dict[str, Any], kv_cache: str
) -> None:
    assert trained["adapted"][:2] != trained["base"][:2]  # the training changed the answer
    llm = LLM(
        model=str(smollm2_gguf),
        dtype="float32",
        kv_cache=kv_cache,
        max_model_len=128,
        enable_lora=True,
        max_lora_rank=8,
        lora_modules={"lyon": trained["folder"]},
    )
    prompts = [trained["encode"](p) for p in PROMPTS] * 2
    adapters = ["lyon"] * len(PROMPTS) + [None] * len(PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=adapters)
    assert [o.token_ids for o in outputs] == trained["adapted"] + trained["base"]
