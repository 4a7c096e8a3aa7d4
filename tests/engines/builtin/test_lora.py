"""LoRA adapters in the built-in engine (issue 41) against Hugging Face `peft`, the definition:
adapters written by `peft` on a random checkpoint (random A and B, so each changes the output),
each request's greedy tokens equal the PEFT-merged model's, token for token in float32, for a
batch that mixes four adapters and the base model, in every KV mode, with chunked prefill and
with fewer slots than adapters (slots evicted and written again). A prefix cached under one
adapter is never reused by another. Bad adapters are one-line errors naming them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from math import inf, nan
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import write_tiny_checkpoint
from dequantized_twin import dequantized_twin_tokens

from engines.builtin.llm import LLM
from engines.builtin.lora.adapter import LoRAError
from engines.sampling_params import SamplingParams
from models.tokenizer import default_tokenizer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# (name, rank, alpha, targets, rslora): different ranks, modules and scalings
ADAPTERS = [
    ("attn", 4, 8, ["q_proj", "v_proj"], False),
    ("mlp", 8, 16, ["gate_proj", "up_proj", "down_proj"], False),
    ("all", 8, 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
     True),
    ("wide", 16, 32, ["k_proj", "o_proj", "down_proj"], False),
]  # fmt: skip
PROMPTS = [[5, 9, 13, 2, 7], [11, 4, 4, 8, 3, 21, 6, 1, 19, 30, 2], [40, 41, 42]]
MAX_TOKENS = 12


def hf_model(folder: Path) -> Any:
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    """Greedy over the tokenizer's ids, as the engine samples (the model's vocabulary rows
    past them are padding no text can hold)."""
    samplable = default_tokenizer().vocab_size
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            min_new_tokens=MAX_TOKENS,
            pad_token_id=0,
            suppress_tokens=list(range(samplable, model.config.vocab_size)),
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The base checkpoint, the four adapters' folders and the reference tokens of each
    (adapter or None) for every prompt, from the PEFT-merged model."""
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_checkpoint(root / "base")
    folders: dict[str, str] = {}
    reference: dict[str | None, list[list[int]]] = {
        None: [hf_greedy(hf_model(base), p) for p in PROMPTS]
    }
    for seed, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        torch.manual_seed(seed)
        config = peft.LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=targets,
            use_rslora=rslora,
            init_lora_weights=False,  # random B too: the adapter changes the output
        )
        model = peft.get_peft_model(hf_model(base), config)
        with torch.no_grad():  # large enough to change the greedy tokens of random weights
            for key, tensor in model.named_parameters():
                if "lora_B" in key:
                    tensor.mul_(20.0)
        folder = root / name
        model.save_pretrained(folder)
        folders[name] = str(folder)
        merged = peft.PeftModel.from_pretrained(hf_model(base), folder).merge_and_unload()
        reference[name] = [hf_greedy(merged, p) for p in PROMPTS]
    for name, _, _, _, _ in ADAPTERS:  # each adapter changes what the model says
        assert reference[name] != reference[None], name
    return {"base": str(base), "folders": folders, "reference": reference}


def engine(checkpoint: dict[str, Any], **options: Any) -> LLM:
    return LLM(
        model=checkpoint["base"],
        dtype="float32",
        enable_lora=True,
        lora_modules=checkpoint["folders"],
        max_lora_rank=16,
        max_model_len=64,
        **options,
    )


def mixed_batch(llm: LLM, checkpoint: dict[str, Any]) -> None:
    """Every prompt under every adapter and the base, all in one call (one batch)."""
    names: list[str | None] = [None, *checkpoint["folders"]]
    prompts = [p for _ in names for p in PROMPTS]
    adapters = [name for name in names for _ in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=adapters)
    for out, name, prompt_index in zip(
        outputs, adapters, [i for _ in names for i in range(len(PROMPTS))], strict=True
    ):
        expected = checkpoint["reference"][name][prompt_index]
        assert out.outputs[0].token_ids == expected, (name, prompt_index)


@pytest.mark.parametrize(
    "options",
    [
        {"kv_cache": "paged", "max_loras": 4},
        {"kv_cache": "contiguous", "max_loras": 4},
        {"kv_cache": "none", "max_loras": 4},
        {"kv_cache": "paged", "max_loras": 2, "max_cpu_loras": 2},  # slots evicted
        {"kv_cache": "paged", "max_loras": 4, "enable_chunked_prefill": True,
         "max_num_batched_tokens": 8, "long_prefill_token_threshold": 4},
        {"kv_cache": "paged", "max_loras": 4, "enable_prefix_caching": True},
    ],
    ids=["paged", "contiguous", "none", "two-slots", "chunked", "prefix-cache"],
)  # fmt: skip
def test_a_batch_mixing_four_adapters_and_the_base_gives_the_merged_models_tokens(
    checkpoint: dict[str, Any], options: dict[str, Any]
) -> None:
    with engine(checkpoint, **options) as llm:
        mixed_batch(llm, checkpoint)
        if options.get("max_loras") == 2:  # four adapters through two slots
            stats = llm.engine.runner.lora.stats
            assert stats.slot_evictions >= 2 and stats.slot_writes >= 4


def test_a_prefix_cached_under_one_adapter_is_not_reused_by_another(
    checkpoint: dict[str, Any],
) -> None:
    """The same 40-token prompt under adapter attn, then mlp, then the base, then attn
    again: only the last finds its prefix cached, and each gives its own model's tokens."""
    prompt = list(range(3, 43))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with engine(checkpoint, kv_cache="paged", max_loras=4, enable_prefix_caching=True) as llm:
        hits = []  # the engine's cached prompt tokens so far, after each request
        tokens: dict[str | None, list[list[int]]] = {}
        for name in ("attn", "mlp", None, "attn"):
            out = llm.generate([prompt], params, lora_request=name)[0]
            hits.append(llm.engine.scheduler.prefix_cache_hits)
            tokens.setdefault(name, []).append(out.outputs[0].token_ids)
    assert hits[:3] == [0, 0, 0] and hits[3] > 0  # only the second attn request hit
    assert tokens["attn"][0] == tokens["attn"][1]
    merged = {}
    for name in ("attn", "mlp"):
        model = peft.PeftModel.from_pretrained(
            hf_model(Path(checkpoint["base"])), checkpoint["folders"][name]
        ).merge_and_unload()
        merged[name] = hf_greedy(model, prompt)[:4]
    assert tokens["attn"][0] == merged["attn"] and tokens["mlp"][0] == merged["mlp"]


def write_adapter(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


@pytest.fixture
def bad_adapters(tmp_path: Path) -> Iterator[dict[str, tuple[str, str]]]:
    """name -> (folder, the error's words)."""
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    good = {f"{q}.lora_A.weight": torch.zeros(4, 64), f"{q}.lora_B.weight": torch.zeros(64, 4)}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (tmp_path / "file").write_text("not an adapter")
    yield {
        "missing": (str(tmp_path / "nowhere"), "no such folder"),
        "a_file": (str(tmp_path / "file"), "not a folder"),
        "too_wide": (
            write_adapter(tmp_path / "w", {**config, "r": 32}, good),
            "rank 32 exceeds engine.max_lora_rank=16",
        ),
        "other_model": (
            write_adapter(
                tmp_path / "o",
                config,
                {
                    f"{q}.lora_A.weight": torch.zeros(4, 96),
                    f"{q}.lora_B.weight": torch.zeros(96, 4),
                },
            ),
            "do not fit the base model's",
        ),
        "no_module": (
            write_adapter(tmp_path / "n", {**config, "target_modules": ["c_attn"]}, good),
            "target_modules: ['c_attn'] are not modules of this model",
        ),
        "deep": (
            write_adapter(
                tmp_path / "d",
                config,
                {k.replace("layers.0", "layers.9"): v for k, v in good.items()},
            ),
            "layer 9 does not exist",
        ),
        "dora": (
            write_adapter(tmp_path / "r", {**config, "use_dora": True}, good),
            "use_dora=True is not supported",
        ),
        # a NaN in one adapter would fail every request of the batches it runs in
        "nan_weight": (
            write_adapter(
                tmp_path / "nan", config, {**good, f"{q}.lora_B.weight": torch.full((64, 4), nan)}
            ),
            "holds NaN or infinity",
        ),
        "inf_alpha": (
            write_adapter(tmp_path / "inf", {**config, "lora_alpha": inf}, good),
            "lora_alpha=inf is invalid",
        ),
        "bool_rank": (
            write_adapter(tmp_path / "b", {**config, "r": True}, good),
            "r=True is invalid",
        ),
        "int_weights": (
            write_adapter(
                tmp_path / "i",
                config,
                {**good, f"{q}.lora_A.weight": torch.zeros(4, 64, dtype=torch.int8)},
            ),
            "is torch.int8; allowed: a floating-point dtype",
        ),
        "replicated": (
            write_adapter(tmp_path / "l", {**config, "layer_replication": [[0, 1]]}, good),
            "layer_replication=[[0, 1]] is not supported",
        ),
    }


BAD = ["missing", "a_file", "too_wide", "other_model", "no_module", "deep", "dora"]
BAD += ["nan_weight", "inf_alpha", "bool_rank", "int_weights", "replicated"]


@pytest.mark.parametrize("name", BAD)
def test_a_bad_adapter_is_a_one_line_error_naming_it(
    tmp_path: Path, bad_adapters: dict[str, tuple[str, str]], name: str
) -> None:
    base = write_tiny_checkpoint(tmp_path / "base")
    folder, words = bad_adapters[name]
    with pytest.raises(LoRAError) as info:
        LLM(model=str(base), enable_lora=True, lora_modules={name: folder}, max_lora_rank=16)
    message = str(info.value)
    assert message.startswith(f"lora_modules.{name}: ") and words in message
    assert "\n" not in message


def test_a_request_for_an_unknown_adapter_names_the_known_ones(
    checkpoint: dict[str, Any],
) -> None:
    unknown = r"lora: 'nope' is not a loaded adapter; allowed: all, attn, mlp, wide"
    with engine(checkpoint, max_loras=1) as llm, pytest.raises(ValueError, match=unknown):
        llm.generate([PROMPTS[0]], lora_request="nope")
    plain = LLM(model=checkpoint["base"])
    with plain, pytest.raises(ValueError, match=r"engine\.enable_lora=true"):
        plain.generate([PROMPTS[0]], lora_request="attn")


def test_int8_base_weights_with_float_adapters_are_the_int8_model_plus_the_delta(
    checkpoint: dict[str, Any],
) -> None:
    """QLoRA's serving case: the base kept INT8, the adapters float; the tokens are those of
    the dequantized INT8 weights with the same adapters in float32."""
    names: list[str | None] = [None, *checkpoint["folders"]]
    prompts = [p for _ in names for p in PROMPTS]
    adapters = [name for name in names for _ in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with engine(checkpoint, max_loras=4, quantization="int8") as llm:
        quantized = [o.token_ids for o in llm.generate(prompts, params, lora_request=adapters)]
        assert dequantized_twin_tokens(llm, prompts, params, adapters) == quantized
    # and the adapters still change what the INT8 model says
    assert quantized[len(PROMPTS) :] != quantized[: len(PROMPTS)] * 4


def test_ngram_speculative_decoding_under_adapters_gives_the_same_tokens(
    checkpoint: dict[str, Any],
) -> None:
    """Drafts verified with each row's adapter: the tokens without speculation."""
    repetitive = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], [4, 5, 4, 5, 4, 5, 4, 5]]
    names: list[str | None] = ["attn", "all", None, "wide"]
    prompts = [p for _ in names for p in repetitive]
    adapters = [name for name in names for _ in repetitive]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with engine(checkpoint, max_loras=4) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params, lora_request=adapters)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with engine(checkpoint, max_loras=4, speculative_config=spec) as llm:
        outputs = llm.generate(prompts, params, lora_request=adapters)
        assert [o.token_ids for o in outputs] == expected
        assert sum(o.metrics.spec_draft_tokens for o in outputs) > 0


@pytest.mark.slow
def test_two_tensor_parallel_ranks_give_the_merged_models_tokens(
    checkpoint: dict[str, Any],
) -> None:
    """Each rank keeps its shard of A or B, as of its base layer (B's rows of q/k/v and
    gate/up, A's columns of o and down): the tokens of one rank, the PEFT-merged model's."""
    with engine(checkpoint, max_loras=4, tensor_parallel_size=2, num_threads=1) as llm:
        mixed_batch(llm, checkpoint)


FOUR_TOKENS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def one_host_place_for_two(tmp_path: Path) -> tuple[dict[str, Path], LLM]:
    """Adapters a and b (their folders) and an engine with one slot and one host-memory place
    for them, a's request already run: b, read at start, is evicted, so its next use reads its
    folder again."""
    from checkpoints import write_random_lora

    folders = {name: write_random_lora(tmp_path / name, seed=k) for k, name in enumerate("ab")}
    modules = {name: str(path) for name, path in folders.items()}
    llm = LLM(model="tiny", enable_lora=True, max_loras=1, max_cpu_loras=1, lora_modules=modules)
    assert llm.generate([PROMPTS[0]], FOUR_TOKENS, lora_request="a")[0].error is None
    return folders, llm


def test_an_adapter_whose_folder_is_gone_fails_its_requests_alone(tmp_path: Path) -> None:
    """b's folder removed after the start: a request for b fails naming it, beside one for a
    that completes."""
    import shutil

    folders, llm = one_host_place_for_two(tmp_path)
    with llm:
        shutil.rmtree(folders["b"])
        gone, fine = llm.generate([PROMPTS[0], PROMPTS[1]], FOUR_TOKENS, lora_request=["b", "a"])
    assert gone.error is not None and gone.error.startswith("lora_modules.b: no such folder")
    assert fine.error is None and len(fine.outputs[0].token_ids) == 4


def test_an_adapter_loaded_again_under_its_name_never_finds_the_old_ones_cache(
    checkpoint: dict[str, Any],
) -> None:
    """x is `attn`, its prompt's blocks cached under it; x unloaded and loaded again as `all`
    (a read of `attn` still going when it was unloaded is dropped): the prompt under x gives
    `all`'s tokens, not those of `attn`'s cached K/V."""
    folders, reference = checkpoint["folders"], checkpoint["reference"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(model=checkpoint["base"], dtype="float32", enable_lora=True, max_lora_rank=16,
              lora_modules={"x": folders["attn"]}, kv_cache="paged", block_size=4,
              enable_prefix_caching=True, max_model_len=64)  # fmt: skip
    with llm:
        assert (
            llm.generate([PROMPTS[1]], params, lora_request="x")[0].token_ids
            == (reference["attn"][1])
        )
        lora = llm.engine.runner.lora
        lora.prefetch("x")  # in host memory already: nothing to read
        lora._host.clear()
        lora.prefetch("x")  # a read of `attn` on its way
        llm.engine.remove_lora("x")
        lora.add(lora.read("x", folders["all"]))
        time.sleep(0.2)  # the dropped read would have finished by now
        out = llm.generate([PROMPTS[1]], params, lora_request="x")[0]
        assert out.token_ids == reference["all"][1]
        assert lora.describe()["adapters"]["x"]["path"] == folders["all"]


def test_a_changed_adapter_folder_fails_its_requests(tmp_path: Path) -> None:
    """The folder rewritten after the start (another adapter under the same name): a later
    read fails the requests for it, naming it, instead of serving other weights than the
    running requests and the prefix cache were computed with."""
    import shutil

    from checkpoints import write_random_lora

    folders, llm = one_host_place_for_two(tmp_path)
    with llm:
        shutil.rmtree(folders["b"])
        write_random_lora(folders["b"], seed=7)
        changed = llm.generate([PROMPTS[0]], FOUR_TOKENS, lora_request="b")[0]
    assert changed.error is not None
    assert changed.error.startswith("lora_modules.b: ") and "changed since it was loaded" in (
        changed.error
    )


def test_a_request_waiting_for_a_slot_is_not_starved_by_a_running_adapter() -> None:
    """One slot: requests for dummy-0 keep coming while a dummy-1 request waits; after
    ADAPTER_PATIENCE_STEPS later ones under an adapter wait behind it, dummy-0 drains, and it
    runs (before, it waited as long as the stream lasted)."""
    from engines.builtin.scheduler import ADAPTER_PATIENCE_STEPS

    llm = LLM(model="tiny", enable_lora=True, max_loras=1, max_cpu_loras=2,
              lora_dummy_adapters=2, lora_dummy_rank=4, max_num_seqs=8)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with llm:
        for i in range(4):
            engine.add_request(f"hot{i}", PROMPTS[0], params, lora_name="dummy-0")
        engine.step()
        engine.add_request("cold", PROMPTS[1], params, lora_name="dummy-1")
        cold = engine.sequences["cold"]
        for step in range(200):
            if step % 3 == 0:
                engine.add_request(f"more{step}", PROMPTS[0], params, lora_name="dummy-0")
            engine.step()
            if cold.num_output_tokens > 0:
                break
        assert cold.num_output_tokens > 0 and step < ADAPTER_PATIENCE_STEPS + 2 * 10, step


def test_adapters_waiting_for_a_slot_are_not_read_from_disk_again_and_again() -> None:
    """Three adapters, one slot, host memory for one (the default): an adapter is read when
    a slot can take it, not while it waits, so reads follow the slot writes (before: 44 reads
    for 3 writes; now 11 for 8)."""
    llm = LLM(model="tiny", enable_lora=True, max_loras=1, lora_dummy_adapters=3,
              lora_dummy_rank=4)  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with llm:
        adapters = [f"dummy-{i % 3}" for i in range(24)]
        prompts = [[5 + i, 6, 7] for i in range(24)]
        outputs = llm.generate(prompts, params, lora_request=adapters)
        facts = llm.engine.runner.lora.describe()
    assert all(o.error is None for o in outputs)
    started = 3  # read_all reads each once at the start
    assert facts["lora_disk_loads"] - started <= facts["lora_slot_writes"], facts


@pytest.mark.parametrize("bad", [5, b"g", {"lora_name": "g"}, ["dummy-0", 3]])
def test_a_lora_request_of_the_wrong_type_is_named(bad: Any) -> None:
    llm = LLM(model="tiny", enable_lora=True, lora_dummy_adapters=1)
    with llm, pytest.raises(ValueError, match=r"^lora_request: "):
        llm.generate([PROMPTS[0], PROMPTS[1]], lora_request=bad)


@pytest.mark.parametrize(("name", "words"), [("dummy-0", "the name of a dummy adapter"),
                                             ("a\nb", "1 to 256 printable"),
                                             ("x" * 300, "1 to 256 printable")])  # fmt: skip
def test_an_adapter_name_that_clashes_or_cannot_be_a_model_name_is_refused(
    tmp_path: Path, name: str, words: str
) -> None:
    from checkpoints import write_random_lora

    folder = str(write_random_lora(tmp_path / "a", seed=0))
    with pytest.raises(LoRAError, match=words):
        LLM(model="tiny", enable_lora=True, lora_dummy_adapters=1, lora_modules={name: folder})
