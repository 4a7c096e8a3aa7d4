"""A GGUF file re-encoded into another GGUF file (`inferlab convert SRC.gguf DST.gguf`, and the
derived files of models/gguf_quantize.py): the metadata as it is, every 2-D tensor in one type
(F32/F16/BF16 for an equal-precision llama.cpp peer, Q8_0/Q4_0/Q4_1 to compare its formats) by
the `gguf` package's encoders, one tensor at a time so memory stays near one tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from models.gguf import open_gguf

#: GGUF target types: the name (as llama.cpp's tools spell it) -> gguf's enum member name.
GGUF_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q5_1": "Q5_1",
              "q5_0": "Q5_0", "q4_1": "Q4_1", "q4_0": "Q4_0"}  # fmt: skip
#: llama.cpp's general.file_type for each target (the LlamaFileType enum's names).
_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16",
               "q8_0": "MOSTLY_Q8_0", "q5_1": "MOSTLY_Q5_1", "q5_0": "MOSTLY_Q5_0",
               "q4_1": "MOSTLY_Q4_1", "q4_0": "MOSTLY_Q4_0"}  # fmt: skip


def convert_to_gguf(src: str | Path, dst: str | Path, kind: str = "f16") -> Path:
    """A GGUF file with the metadata of `src` and its tensors re-encoded as `kind`: 2-D weights
    take the type, 1-D ones (norms, biases) stay F32 as llama.cpp's own converter keeps them.
    Tensor names and llama.cpp's q/k row order are kept as they are."""
    import gguf

    if kind not in GGUF_TYPES:
        raise ValueError(f"--dtype: {kind!r} is invalid for a .gguf target; allowed: "
                         f"{'|'.join(GGUF_TYPES)}")  # fmt: skip
    target = gguf.GGMLQuantizationType[GGUF_TYPES[kind]]
    reader = open_gguf(src)
    arch = reader.fields["general.architecture"].contents()
    out = Path(dst)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=arch)
    try:
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue  # the writer writes these itself
            if field.name == "general.file_type":
                value = int(gguf.LlamaFileType[_FILE_TYPES[kind]])
                writer.add_key_value(field.name, value, gguf.GGUFValueType.UINT32)
                continue
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
        # Tensor infos first, then the data one tensor at a time: memory stays near one tensor.
        kinds = {}
        for tensor in reader.tensors:
            shape = tuple(reversed(tensor.shape.tolist()))
            kinds[tensor.name] = target if len(shape) > 1 else gguf.GGMLQuantizationType.F32
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, kinds[tensor.name])
            writer.add_tensor_info(
                tensor.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                raw_dtype=kinds[tensor.name],
            )  # fmt: skip
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in reader.tensors:
            array = np.asarray(
                gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32
            ).reshape(tuple(reversed(tensor.shape.tolist())))
            writer.write_tensor_data(_encode(array, kinds[tensor.name]).view(np.uint8))
        writer.close()
    except BaseException:  # a full disk or ^C leaves no partial file behind
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    return out


def _encode(array: np.ndarray, kind: Any) -> np.ndarray:
    import gguf

    if kind == gguf.GGMLQuantizationType.F32:
        return array
    if kind == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array, kind)
