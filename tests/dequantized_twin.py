"""The dequantize-then-float32 reference of a quantized engine, for tests of the quantized
kernels (tests/engines/builtin/layers/test_quant*.py)."""

from __future__ import annotations

from engines.builtin import LLM, SamplingParams
from engines.builtin.layers import make_linear_method


def dequantized_twin_tokens(
    llm: LLM, prompts: list, params: SamplingParams, lora_request: list | None = None
) -> list[list[int]]:
    """Greedy tokens of the dequantize-then-float32 reference: every quantized layer of `llm`
    replaced, in place, by a dense one holding the weight its stored form represents (its
    LoRA slots, if any, stay: `lora_request` runs the prompts under adapters)."""
    runner = llm.engine.runner
    for layer in runner.model.linear_layers().values():
        if layer.method.name in ("int8", "int4"):
            weight = layer.method.dequantize(layer)
            bias = None if layer.bias is None else layer.bias.data.float()
            for name in ("qweight", "scales", "mins", "scales_and_zeros"):
                layer._buffers.pop(name, None)
            layer.method = make_linear_method("none", prepack=runner.prepacked)
            layer.load(weight, bias)
    runner._setup_layer_program()  # the program reads the new layers
    outputs = llm.generate(prompts, params, lora_request=lora_request)
    return [o.outputs[0].token_ids for o in outputs]
