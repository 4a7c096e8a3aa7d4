"""A checkpoint tensor stored as integers or booleans is refused at load, naming the file, the
tensor and its dtype. Before, `q_proj.weight` saved as int32 (a float tensor cast to int: all
zeros) was cast back to float without a word, and the run was complete with a broken model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_tiny_checkpoint
from safetensors.torch import load_file, save_file

from models.weights import iter_checkpoint

NAME = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.uint8, torch.bool])
def test_a_tensor_that_is_not_floating_point_is_refused(tmp_path: Path, dtype: torch.dtype) -> None:
    folder = write_tiny_checkpoint(tmp_path / "ckpt")
    weights = load_file(str(folder / "model.safetensors"))
    weights[NAME] = weights[NAME].to(dtype)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError) as refused:
        list(iter_checkpoint(folder))
    message = str(refused.value)
    assert message.startswith(f"{folder / 'model.safetensors'}: tensor {NAME!r} is {dtype}")
    assert "floating-point" in message and "\n" not in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_floating_point_tensors_load(tmp_path: Path, dtype: torch.dtype) -> None:
    folder = write_tiny_checkpoint(tmp_path / "ckpt")
    weights = load_file(str(folder / "model.safetensors"))
    weights[NAME] = weights[NAME].to(dtype)
    save_file(weights, str(folder / "model.safetensors"))
    assert dict(iter_checkpoint(folder))[NAME].dtype == dtype
