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
