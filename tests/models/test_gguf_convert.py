"""`inferlab convert SRC.gguf DST.gguf` (models.gguf_convert.convert_to_gguf) on a tiny synthetic
GGUF file written with the `gguf` package's GGUFWriter (tests/checkpoints.py): a 2-layer llama
(hidden 64) with the metadata keys and value types of SmolLM2-135M-Instruct's file (strings,
string and int32 arrays, uint32, float32, bool) and its tensor types (Q8_0 embedding, Q4_1
linear layers, F32 norms), a few KB. Re-encoding touches every tensor and key the same way
whatever their size, so the behaviour is checked here in a fraction of a second;
tests/models/test_gguf.py keeps the real file's parity checks (config, tokenizer, generation,
the converted folder)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from checkpoints import CHAT_TEMPLATE, write_tiny_gguf

from harness.cli import main as inferlab
from models.gguf import open_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf")


def test_the_tiny_file_has_the_real_files_kinds(tiny_gguf: Path) -> None:
    """What the re-encoding below must carry over: every value type SmolLM2's file uses and
    its three tensor types, 1-D and 2-D."""
    import gguf

    reader = open_gguf(tiny_gguf)
    kinds = {tuple(t.name for t in field.types) for field in reader.fields.values()}
    assert kinds >= {("STRING",), ("ARRAY", "STRING"), ("ARRAY", "INT32"), ("UINT32",),
                     ("FLOAT32",), ("BOOL",)}  # fmt: skip
    assert {t.tensor_type for t in reader.tensors} == {
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.F32,
    }
    assert reader.fields["tokenizer.chat_template"].contents() == CHAT_TEMPLATE


def test_reencoded_gguf_keeps_metadata_and_weights(tiny_gguf: Path, tmp_path: Path) -> None:
    import gguf

    out = tmp_path / "tiny-f16.gguf"
    assert inferlab(["convert", str(tiny_gguf), str(out), "--dtype", "f16"]) == 0
    source, copy = open_gguf(tiny_gguf), open_gguf(out)
    skip = {"general.file_type"}
    assert {k for k in source.fields if not k.startswith("GGUF.")} == {
        k for k in copy.fields if not k.startswith("GGUF.")
    }
    for key, field in source.fields.items():
        if not key.startswith("GGUF.") and key not in skip:
            assert copy.fields[key].contents() == field.contents(), key
    assert copy.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_F16)
    originals = {t.name: t for t in source.tensors}
    assert sorted(originals) == sorted(t.name for t in copy.tensors)
    for tensor in copy.tensors:
        want = gguf.quants.dequantize(
            originals[tensor.name].data, originals[tensor.name].tensor_type
        )
        got = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        kind = tensor.tensor_type.name
        assert kind == ("F16" if len(tensor.shape) > 1 else "F32"), tensor.name
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6, err_msg=tensor.name)


def test_convert_refuses_bad_input(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert inferlab(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2
    assert "src: " in capsys.readouterr().err
    assert inferlab(["convert", str(tiny_gguf), str(tmp_path / "x.gguf"), "--dtype", "q3"]) == 2
    err = capsys.readouterr().err
    assert "--dtype: 'q3' is invalid" in err and "q4_1" in err and "\n" not in err.strip()
    assert not (tmp_path / "x.gguf").exists()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_convert_writes_over_nothing_unless_forced(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inferlab convert m.gguf ~/models/Llama` replaced the config.json, model.safetensors
    and tokenizer.json of the checkpoint already in that folder (they are the very names a
    converted folder has), and `convert m.gguf old.gguf` replaced old.gguf; each is now
    refused, naming DST and --force, exit 2, unless --force asks for it."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (checkpoint / name).write_text(f"the user's own {name}")
    old = tmp_path / "old.gguf"
    old.write_bytes(b"the user's own gguf")
    run = tmp_path / "run"  # a run folder's own files, directly and through links
    run.mkdir()
    for name in ("summary.json", "config.yaml", "requests.parquet"):
        (run / name).write_text(name)
    (tmp_path / "linked.gguf").symlink_to(run / "summary.json")
    (tmp_path / "linked-run").symlink_to(run)
    before = {folder: _snapshot(folder) for folder in (checkpoint, run)}
    for dst in (
        checkpoint,
        old,
        tmp_path / "linked.gguf",
        run / "summary.json",
        run / "config.yaml",
        tmp_path / "linked-run" / "summary.json",
    ):
        assert inferlab(["convert", str(tiny_gguf), str(dst)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"inferlab convert: dst: {dst} exists") and err.count("\n") == 1
    assert {folder: _snapshot(folder) for folder in (checkpoint, run)} == before
    assert old.read_bytes() == b"the user's own gguf"
    assert (tmp_path / "linked.gguf").is_symlink()

    assert inferlab(["convert", str(tiny_gguf), str(old), "--force"]) == 0
    assert open_gguf(old).tensors  # replaced, as asked
    assert inferlab(["convert", str(tiny_gguf), str(tmp_path / "linked.gguf"), "--force"]) == 0
    assert not (tmp_path / "linked.gguf").is_symlink()  # the link is replaced, not its target
    assert _snapshot(run) == before[run]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert inferlab(["convert", str(tiny_gguf), str(empty)]) == 0  # an empty folder is fine
    assert (empty / "config.json").is_file()


def test_tokenizer_only_writes_a_folder_transformers_reads_as_the_engine_tokenizes(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inferlab convert m.gguf DIR --tokenizer-only`: the folder a client (guidellm, AIPerf,
    lm-eval's `tokenizer=`) needs to tokenize as the served GGUF model does."""
    transformers = pytest.importorskip("transformers")
    from models.tokenizer import tokenizer_for_model

    out = tmp_path / "tokenizer"
    assert inferlab(["convert", str(tiny_gguf), str(out), "--tokenizer-only"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = tokenizer_for_model(str(tiny_gguf))
    for text in ("Hello world", "numbers 12345 and  spaces", "ünïcödé text!"):
        assert theirs(text)["input_ids"] == ours.encode(text)
    capsys.readouterr()
    for dst, extra in ((tmp_path / "t2", ["--dtype", "float16"]), (tmp_path / "t.gguf", [])):
        assert inferlab(["convert", str(tiny_gguf), str(dst), "--tokenizer-only", *extra]) == 2
        assert "--tokenizer-only:" in capsys.readouterr().err
        assert not dst.exists()
    # a folder that holds something is written over only with --force
    assert inferlab(["convert", str(tiny_gguf), str(out), "--tokenizer-only"]) == 2
    assert inferlab(["convert", str(tiny_gguf), str(out), "--tokenizer-only", "--force"]) == 0
