"""A checkpoint's config.json (or a GGUF file's metadata) holding a value the engine cannot run
is refused at load, in one line naming the file, the key and what is allowed: NaN or infinity
anywhere (Python's json reads them), a wrong type, a size out of range or one that does not
divide. Before, a NaN rms_norm_eps ran to a "complete" run of all-zero token ids,
max_position_embeddings 10**12 tried to allocate terabytes and hidden_size "576" was a bare
TypeError."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from checkpoints import run_on_checkpoint, tiny_config_json, write_tiny_checkpoint, write_tiny_gguf

from harness import cli
from models.config import ModelFieldError, UnsupportedCheckpointError
from models.location import resolve_model

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        ({"rms_norm_eps": NAN}, "rms_norm_eps: nan is invalid; allowed: a finite number"),
        ({"rope_theta": INF}, "rope_theta: inf is invalid; allowed: a finite number"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": NAN}},
            "rope_scaling.factor: nan is invalid; allowed: a finite number",
        ),
        ({"initializer_range": -INF}, "initializer_range: -inf is invalid"),  # unused, still
        (
            {"max_position_embeddings": 10**12},
            "max_position_embeddings: 1000000000000 is invalid; allowed: an integer in "
            "[1, 16777216]",
        ),
        (
            {"max_position_embeddings": 1e12},
            "max_position_embeddings: 1000000000000.0 is invalid; allowed: an integer",
        ),
        ({"hidden_size": "576"}, "hidden_size: '576' is invalid; allowed: an integer in [1, "),
        ({"num_hidden_layers": 2.0}, "num_hidden_layers: 2.0 is invalid; allowed: an integer"),
        ({"intermediate_size": 0}, "intermediate_size: 0 is invalid; allowed: an integer in"),
        ({"vocab_size": -1}, "vocab_size: -1 is invalid; allowed: an integer in [1, "),
        (
            {"hidden_size": 66},
            "hidden_size: 66 is invalid; it must be a multiple of num_attention_heads (4)",
        ),
        (
            {"num_key_value_heads": 3},
            "num_key_value_heads: 3 is invalid; it must divide the number of attention heads (4)",
        ),
        ({"rms_norm_eps": 0}, "rms_norm_eps: 0 is invalid; allowed: a finite number > 0"),
        ({"rope_theta": "1e4"}, "rope_theta: '1e4' is invalid; allowed: a finite number > 0"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 0}},
            "rope_scaling.factor: 0 is invalid; allowed: a finite number > 0 (linear scaling",
        ),
        (
            {"tie_word_embeddings": "false"},
            "tie_word_embeddings: 'false' is invalid; allowed: true|false",
        ),
        ({"eos_token_id": "2"}, "eos_token_id: ('2',) is invalid; allowed: integers >= 0"),
    ],
)
def test_an_impossible_config_value_is_refused_naming_file_and_key(
    tmp_path: Path, edit: dict[str, Any], says: str
) -> None:
    assert_refused(tmp_path, {**tiny_config_json(), **edit}, says)


def assert_refused(tmp_path: Path, config: dict[str, Any], says: str) -> None:
    """Loading a folder of `config` fails in one line: the file, then `says`."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpointError) as refused:
        resolve_model(str(folder))
    message = str(refused.value)
    assert message.startswith(f"{folder / 'config.json'}: {says}"), message
    assert "\n" not in message


def test_the_unedited_config_loads(tmp_path: Path) -> None:
    """The refused configs above differ from this one only in the key each edits."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_config_json()))
    assert resolve_model(str(folder)) == resolve_model("tiny").with_overrides(
        {"max_position_embeddings": 256}
    )


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"rms_norm_eps": NAN}, "model.rms_norm_eps: nan is invalid; allowed: a finite number > 0"),
        (
            {"max_position_embeddings": 10**12},
            "model.max_position_embeddings: 1000000000000 is invalid; allowed: an integer in",
        ),
        ({"sliding_window": "4"}, "model.sliding_window: '4' is invalid; allowed: null or an"),
        ({"hidden_act": "relu"}, "model.hidden_act: 'relu' is invalid; allowed: silu|gelu_pytorch"),
        (
            {"full_attention_layers": [1]},
            "model.full_attention_layers: (1,) is invalid; it needs a sliding_window",
        ),
        (
            {"sliding_window": 8, "full_attention_layers": [2]},
            "model.full_attention_layers: (2,) is invalid; allowed: layer indices in [0, 2)",
        ),
        (
            {"attn_logit_softcapping": 0},
            "model.attn_logit_softcapping: 0 is invalid; allowed: null or a finite number > 0",
        ),
        ({"norm_weight_offset": 2}, "model.norm_weight_offset: 2 is invalid; allowed: 0|1"),
        ({"full_attention_layers": 3}, "model.full_attention_layers: 3 is invalid; allowed"),
        (
            {"sliding_window": 8, "full_attention_layers": [1, 1]},
            "model.full_attention_layers: (1, 1) is invalid; allowed: distinct layer indices",
        ),
        ({"architecture": "Nope"}, "model.architecture: 'Nope' is invalid; allowed: Llama"),
    ],
)
def test_model_overrides_meet_the_same_rules(overrides: dict[str, Any], says: str) -> None:
    with pytest.raises(ModelFieldError, match="^" + re.escape(says)):
        resolve_model("tiny", overrides)


GEMMA2 = {
    **tiny_config_json(),
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 8,
}


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (
            {"architectures": ["Gemma3ForConditionalGeneration"]},
            "architecture 'Gemma3ForConditionalGeneration' is not supported; supported: "
            "LlamaForCausalLM, ",
        ),
        (
            {"hidden_activation": "relu"},
            "hidden_act 'relu' is not supported; allowed: silu|gelu_pytorch_tanh",
        ),
        (
            {"layer_types": ["full_attention"]},
            "layer_types: ['full_attention'] is invalid; allowed: a list of 2 of "
            "sliding_attention|full_attention",
        ),
        (
            {"layer_types": ["sliding_attention", "chunked_attention"]},
            "layer_types: ['sliding_attention', 'chunked_attention'] is invalid",
        ),
        ({"attn_logit_softcapping": -1}, "attn_logit_softcapping: -1 is invalid; allowed: null"),
        # its 1/sqrt scales the scores: this one would make them infinite
        ({"query_pre_attn_scalar": 1e-320}, "query_pre_attn_scalar: 1e-320 is invalid; allowed"),
        (  # refused before a list per layer is built
            {"num_hidden_layers": 10**12},
            "num_hidden_layers: 1000000000000 is invalid; allowed: an integer in [1, 4096]",
        ),
        ({"num_hidden_layers": "4"}, "num_hidden_layers: '4' is invalid; allowed: an integer"),
        ({"architectures": "Gemma2ForCausalLM"}, "architectures: 'Gemma2ForCausalLM' is invalid"),
        ({"use_bidirectional_attention": "false"}, "use_bidirectional_attention: 'false' is"),
        (
            {"architectures": ["Gemma3ForCausalLM"], "rope_local_base_freq": 0},
            "rope_local_base_freq: 0.0 is invalid",
        ),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true (an encoder)"),
    ],
)
def test_a_gemma_config_the_engine_cannot_run_is_named(
    tmp_path: Path, edit: dict[str, Any], says: str
) -> None:
    assert_refused(tmp_path, {**GEMMA2, **edit}, says)


def test_an_moe_or_qwen_config_with_a_huge_layer_count_is_refused_at_once(tmp_path: Path) -> None:
    for edit in (
        {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2},
        {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 8},
    ):
        folder = tmp_path / edit["architectures"][0]
        folder.mkdir()
        config = {**tiny_config_json(), **edit, "num_hidden_layers": 10**12}
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsupportedCheckpointError, match="num_hidden_layers: 1000000000000"):
            resolve_model(str(folder))


def test_a_gemma_config_leaving_keys_out_gets_transformers_defaults(tmp_path: Path) -> None:
    """An absent hidden_activation is GeGLU, as transformers' Gemma config classes say; an
    absent head_dim 256 and rope_theta Gemma 3's 1e6."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    bare = {k: v for k, v in GEMMA2.items() if k not in ("hidden_activation", "head_dim")}
    bare = {**bare, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
    bare.pop("rope_theta", None)
    (folder / "config.json").write_text(json.dumps(bare))
    config = resolve_model(str(folder))
    assert (config.hidden_act, config.head_dim, config.rope_theta) == (
        "gelu_pytorch_tanh",
        256,
        1e6,
    )


def test_a_gemma2_config_without_layer_types_alternates_windowed_and_global_layers(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**GEMMA2, "num_hidden_layers": 4}))
    config = resolve_model(str(folder))
    assert [config.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert config.kv_sliding_window is None
    assert (config.attn_logit_softcapping, config.query_pre_attn_scalar) == (50.0, 256)


def test_inferlab_run_on_a_nan_config_fails_with_the_reason(tmp_path: Path) -> None:
    """Before: a run marked complete, with a throughput, of all-zero token ids. (A process of
    its own: Hydra's logging setup would outlive an in-process run.)"""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", {"rms_norm_eps": NAN})
    run_dir = tmp_path / "run"
    result = run_on_checkpoint(folder, run_dir)
    reason = f"{folder / 'config.json'}: rms_norm_eps: nan is invalid; allowed: a finite number"
    assert result.returncode == 2  # the configuration refused at load (was exit 1)
    # the project's form, as at composition: no 'models.config.UnsupportedCheckpointError: '
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {folder / 'config.json'}: ") and line.endswith(reason), line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].endswith(reason), summary
    assert summary["error_kind"] == "config"
    assert summary["metrics"]["output_tok_per_s"] is None


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda tmp: tmp, "model.path: no config.json at {tmp}/config.json"),
        (
            lambda tmp: os.mkfifo(tmp / "config.json") or tmp,
            "{tmp}/config.json: is a FIFO (named pipe), not a regular file",
        ),
    ],
    ids=["no config.json", "config.json a FIFO"],
)
def test_inferlab_run_on_a_folder_without_a_config_is_a_configuration_error(
    tmp_path: Path, make: Any, says: str
) -> None:
    """Before: exit 1, a failed run ('FileNotFoundError: model.path: no config.json at ...'),
    where every other configuration the loader refuses exits 2; a config.json that is a FIFO
    was reported as missing."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    make(folder)
    result = run_on_checkpoint(folder, tmp_path / "run")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(says.format(tmp=folder))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error_kind"] == "config"


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        (
            {"llama.attention.layer_norm_rms_epsilon": NAN},
            "llama.attention.layer_norm_rms_epsilon: nan is invalid; allowed: a finite number",
        ),
        (
            {"llama.context_length": 2**32 - 1},
            "llama.context_length: 4294967295 is invalid; allowed: an integer in [1, 16777216]",
        ),
        (
            {"llama.attention.head_count": 3},
            "llama.embedding_length: 64 is invalid; it must be a multiple of "
            "llama.attention.head_count (3)",
        ),
        (
            {"llama.attention.head_count_kv": 3},
            "llama.attention.head_count_kv: 3 is invalid; it must divide the number of "
            "attention heads (4)",
        ),
    ],
)
def test_an_impossible_gguf_metadata_value_is_refused_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], metadata: dict[str, Any], says: str
) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", metadata)
    with pytest.raises(UnsupportedCheckpointError) as refused:
        resolve_model(str(path))
    assert str(refused.value) == f"{path}: {says}"
    # `inferlab convert` refuses it too, before writing anything
    assert cli.main(["convert", str(path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"inferlab convert: {path}: {says}\n"
    assert not (tmp_path / "out").exists()
    resolve_model(str(write_tiny_gguf(tmp_path / "good.gguf")))  # the unedited file loads
