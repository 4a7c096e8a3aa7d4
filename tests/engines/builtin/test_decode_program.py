"""The decode program (engines/builtin/decode_program.py): a decode step's layers in one call
into the C kernels must compute what the modules compute layer by layer: bit-identical logits
for quantized layers (the same kernels on the same values), float32 rounding for dense ones
(the GEMM instead of torch's GEMV at one row); identical greedy tokens either way. Steps it
does not take (prefills, rings, an INT8 KV cache) go layer by layer, and describe() says
whether it runs and why not."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from engines.builtin import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# three requests at once, so decode steps hold 1-3 rows, next to prefill steps
PROMPTS = [list(range(5, 12)), list(range(40, 80)), [7, 7, 7]]
WIDER = {"intermediate_size": 192}  # int4 g32 divides every layer


def run(
    make_tiny, program: bool, lora_request: list[str | None] | None = None, **options: Any
) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Greedy tokens, every step's logits, and how many steps the program ran."""
    llm: LLM = make_tiny(native_decode_program=program, **options)
    logits: list[torch.Tensor] = []
    llm.engine.add_logits_observer(lambda plan, every: logits.append(every.clone()))
    program_steps = []
    if program:  # count the steps it ran
        layer_program = llm.engine.runner.model.layer_program
        original = layer_program.run
        layer_program.run = lambda x, meta: program_steps.append(1) or original(x, meta)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=lora_request)]
    facts = llm.engine.describe()
    assert facts["native_decode_program"] is program, facts["native_decode_program_reason"]
    return tokens, logits, len(program_steps)


@pytest.mark.parametrize(
    ("options", "exact"),
    [
        (dict(quantization="int8"), True),
        (dict(quantization="int4", quantization_group_size=32, model_overrides=WIDER), True),
        (
            dict(
                quantization="int4",
                quantization_group_size=32,
                quantization_activations="int8",
                quantize_lm_head=True,
                model_overrides=WIDER,
            ),
            True,
        ),
        # Qwen2's q/k/v biases, a sliding window over paged blocks, INT8 fallback layers
        (
            dict(
                quantization="int4",
                quantization_group_size=64,
                kv_cache="paged",
                model_overrides={"attention_bias": True, "sliding_window": 6},
            ),
            True,
        ),
        (dict(), False),  # dense: the panel GEMM at one row instead of torch's GEMV
        (dict(quantization="int8", model_overrides={"qk_norm": "head"}), True),  # Qwen3's norms
        (dict(kv_cache="paged", block_size=4), False),
    ],
)
def test_the_program_computes_what_the_modules_compute(make_tiny, options, exact) -> None:
    tokens, logits, program_steps = run(make_tiny, True, **options)
    expected_tokens, expected_logits, _ = run(make_tiny, False, **options)
    assert tokens == expected_tokens
    assert program_steps == len(logits) - 1  # every step but the one prefill
    assert len(logits) == len(expected_logits) == GREEDY.max_tokens
    for got, expected in zip(logits, expected_logits, strict=True):
        if exact:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qk_norm", ["none", "head"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_mixture_of_experts_layers_run_in_the_program(quantization: str, qk_norm: str) -> None:
    """tiny-moe's layers (Qwen3-MoE's per-head q/k norms, and without them Mixtral's): the
    router, the top-2 and the experts inside the program give the modules' tokens, logits to
    float32 rounding (the router's GEMM: the engine's panels against torch's), and the same
    routing per step."""

    def generate(program: bool) -> tuple[list[list[int]], list[torch.Tensor], list[tuple]]:
        llm = LLM(
            model="tiny-moe", dtype="float32", max_model_len=128, quantization=quantization,
            quantization_group_size=32, model_overrides={"qk_norm": qk_norm},
            native_decode_program=program,
        )  # fmt: skip
        assert llm.engine.describe()["native_decode_program"] is program
        logits: list[torch.Tensor] = []
        llm.engine.add_logits_observer(lambda plan, every: logits.append(every.clone()))
        routing: list[tuple] = []
        llm.engine.step_observers.append(lambda r: routing.append(r.moe_expert_tokens))
        outputs = llm.generate(PROMPTS, GREEDY)
        return [o.outputs[0].token_ids for o in outputs], logits, routing

    tokens, logits, routing = generate(True)
    expected_tokens, expected_logits, expected_routing = generate(False)
    assert tokens == expected_tokens and routing == expected_routing
    for got, expected in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("quantization", "exact"), [(None, False), ("int8", True)], ids=["fp32", "int8"]
)
def test_lora_rows_run_in_the_program_as_the_modules_run_them(
    make_tiny, quantization, exact
) -> None:
    """A batch mixing two adapters and the base: each linear adds its rows' deltas inside the
    one call, with the kernel the modules call (lora_bgmv_f32's halves), so the logits are the
    module path's (bit for bit over INT8 base weights), and the adapters do change them."""
    options: dict[str, Any] = dict(
        quantization=quantization, enable_lora=True, max_loras=2, lora_dummy_adapters=2
    )
    adapters = ["dummy-0", None, "dummy-1"]
    tokens, logits, program_steps = run(make_tiny, True, adapters, **options)
    expected_tokens, expected_logits, _ = run(make_tiny, False, adapters, **options)
    _, base_logits, _ = run(make_tiny, True, [None, None, None], **options)
    assert tokens == expected_tokens
    assert program_steps == len(logits) - 1  # every step but the one prefill
    for got, expected in zip(logits, expected_logits, strict=True):
        if exact:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for got, base in zip(logits[1:], base_logits[1:], strict=True):  # the decodes: a row each
        assert torch.equal(got[1], base[1])  # the base model's row
        assert not torch.allclose(got[0], base[0]) and not torch.allclose(got[2], base[2])


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        (dict(kv_cache_dtype="int8"), "attention backend 'sdpa'"),  # auto: no C kernel
        (dict(kv_cache_dtype="int8", attention_backend="cpu"), "KV cache is not float32"),
        (dict(attention_backend="torch"), "attention backend 'torch'"),
        (dict(dtype="bfloat16"), "dtype bfloat16"),
        (dict(native_kernels=False), "engine.native_kernels=false"),
        (dict(prepack_weights=False), "kept as 'none'"),
        (dict(kv_cache="none"), "no KV cache"),
    ],
)
def test_engines_it_cannot_take_run_layer_by_layer_and_say_why(make_tiny, options, reason) -> None:
    llm = make_tiny(**options)
    facts = llm.engine.describe()
    assert facts["native_decode_program"] is False
    assert reason in facts["native_decode_program_reason"]
    assert len(llm.generate(PROMPTS[:1], GREEDY)[0].token_ids) == 10


def test_a_ring_step_goes_layer_by_layer(make_tiny) -> None:
    """Contiguous KV with a sliding window keeps a ring of slots: not the program's layout;
    those steps take the modules, and the tokens are the same as with no program."""
    options: dict[str, Any] = dict(
        quantization="int8", kv_cache="contiguous", model_overrides={"sliding_window": 4}
    )
    tokens, _, program_steps = run(make_tiny, True, **options)
    assert program_steps == 0 and tokens == run(make_tiny, False, **options)[0]


def test_a_layer_loaded_again_keeps_the_old_program_memory_alive(make_tiny) -> None:
    """The program points into the tensors it was built from; loading a layer again must not
    free them under it (a crash), and a new program reads the new weights."""
    llm = make_tiny(quantization="int8")
    runner = llm.engine.runner
    layer = runner.model.layers[0].mlp.down_proj
    old = layer.qweight
    layer.load(torch.zeros(layer.out_features, layer.in_features))
    assert any(t is old for t in runner.model.layer_program.keep)
    llm.generate(PROMPTS[:1], GREEDY)  # reads the old weights, from memory still held
    runner._setup_layer_program()
    assert any(t is layer.qweight for t in runner.model.layer_program.keep)


@pytest.fixture
def keep_torch_threads():
    """num_threads sets torch's thread count for the process: put it back afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("policy", ["auto", "active", "passive"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("options", "prompts"),
    [
        # 3 rows: the rows kernels (INT8, INT4 with INT8 activations)
        (dict(quantization="int8"), PROMPTS),
        (
            dict(
                quantization="int4",
                quantization_group_size=32,
                quantization_activations="int8",
                model_overrides=WIDER,
            ),
            PROMPTS,
        ),
        # 6 and 14 rows: past rows_max (4 for INT4, 12 for INT8), the tile kernels
        (
            dict(quantization="int4", quantization_group_size=32, model_overrides=WIDER),
            [list(range(5 + i, 12 + 2 * i)) for i in range(6)],
        ),
        (dict(quantization="int8", max_num_seqs=16), [[9 + i] * (3 + i) for i in range(14)]),
    ],
)
def test_every_team_size_and_wait_policy_computes_what_the_modules_compute(
    make_tiny, keep_torch_threads, policy, threads, options, prompts
) -> None:
    """One parallel region per step, its members sharing each op and meeting at the team's
    barriers: bit-identical logits to the layer-by-layer path at the same thread count, with
    threads spinning (active), sleeping at once (passive), or both (auto), and with more
    threads than this machine may have cores (members descheduled while others wait)."""

    def step_logits(program: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        llm = make_tiny(
            native_decode_program=program, num_threads=threads, cpu_wait_policy=policy, **options
        )
        assert llm.engine.describe()["cpu_wait_policy"] == policy
        logits: list[torch.Tensor] = []
        llm.engine.add_logits_observer(lambda plan, every: logits.append(every.clone()))
        rows: list[int] = []
        if program:
            layer_program = llm.engine.runner.model.layer_program
            original = layer_program.run
            layer_program.run = lambda x, meta: rows.append(x.shape[0]) or original(x, meta)
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.describe()["native_decode_program"] is program
        if program:  # every step after the prefill, all the rows at once
            assert rows == [len(prompts)] * (GREEDY.max_tokens - 1)
        return tokens, logits

    tokens, logits = step_logits(True)
    expected_tokens, expected_logits = step_logits(False)
    assert tokens == expected_tokens
    assert len(logits) == len(expected_logits)
    for got, expected in zip(logits, expected_logits, strict=True):
        assert torch.equal(got, expected)


def test_a_team_resized_between_steps_computes_the_same(make_tiny, keep_torch_threads) -> None:
    """cpu_wait_policy=auto measures the team's size as it runs (team_size.py): steps of
    different sizes, probes every other step here, give the same logits as the modules."""
    options: dict[str, Any] = dict(
        quantization="int4", quantization_group_size=32, model_overrides=WIDER, num_threads=3
    )
    llm = make_tiny(**options)
    sizer = llm.engine.runner.decode_program.sizer
    sizer.first_interval = sizer.longest_interval = 2
    sizer.interval, sizer.probe_steps = 2, 1
    sizes: list[int] = []
    original = sizer.next_size
    sizer.next_size = lambda: sizes.append(original()) or sizes[-1]
    logits: list[torch.Tensor] = []
    llm.engine.add_logits_observer(lambda plan, every: logits.append(every.clone()))
    tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert len(set(sizes)) > 1 and llm.engine.describe()["decode_team"]["probes"] > 0
    expected_tokens, expected_logits, _ = run(make_tiny, False, **options)
    assert tokens == expected_tokens
    for got, expected in zip(logits, expected_logits, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("policy", ["active", "passive"])
def test_a_fixed_policy_keeps_every_thread(make_tiny, policy) -> None:
    llm = make_tiny(quantization="int8", cpu_wait_policy=policy)
    assert llm.engine.runner.decode_program.sizer is None
    assert llm.engine.describe()["decode_team"] is None


@pytest.mark.parametrize(
    "target", [dict(quantization="int4", quantization_group_size=32), dict()], ids=["int4", "fp32"]
)
def test_speculative_verify_steps_run_as_decodes_in_the_program(make_tiny, target) -> None:
    """A verify step brings a sequence's last token and its drafts, laid out as one decode row
    per position (engines/builtin/spec_decode): the program runs them like any decode rows, in
    its one region; greedy tokens equal the plain engine's and the layer-by-layer verify's."""
    prompts = [list(range(5 + i, 30 + 3 * i)) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # a draft that mostly agrees with its target: the same dummy weights in float32
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": "tiny"}

    def tokens(program: bool, speculative: bool) -> tuple[list[list[int]], list[tuple[int, int]]]:
        llm = make_tiny(
            native_decode_program=program,
            speculative_config=spec if speculative else None,
            **target,
        )
        shapes: list[tuple[int, int]] = []  # (rows, decode rows) of each step the program ran
        if program:
            layer_program = llm.engine.runner.decode_program
            original = layer_program.run
            layer_program.run = lambda x, meta: (
                shapes.append((x.shape[0], meta.num_decodes)) or original(x, meta)
            )
        return [o.token_ids for o in llm.generate(prompts, params)], shapes

    verified, shapes = tokens(program=True, speculative=True)
    # verify steps (more rows than requests) went through the program, every row a decode
    assert any(rows > len(prompts) for rows, _ in shapes)
    assert all(rows == decodes for rows, decodes in shapes)
    assert verified == tokens(program=False, speculative=True)[0]
    assert verified == tokens(program=True, speculative=False)[0]


def test_active_waiting_on_more_threads_than_cpus_is_warned(
    make_tiny, keep_torch_threads, caplog
) -> None:
    """Spinning threads beyond the CPUs hold the cores the others need (hostile pass, issue
    36: 64 threads on 2 CPUs took 45 s for 30 tokens): the engine says so when built."""
    cpus = len(os.sched_getaffinity(0))
    with caplog.at_level("WARNING", logger="engines.builtin.decode_program"):
        make_tiny(quantization="int8", cpu_wait_policy="active", num_threads=cpus + 1)
    assert f"cpu_wait_policy=active on {cpus + 1} threads and {cpus} CPUs" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="engines.builtin.decode_program"):
        make_tiny(quantization="int8", cpu_wait_policy="auto", num_threads=cpus + 1)
    assert "cpu_wait_policy" not in caplog.text
