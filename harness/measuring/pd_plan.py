"""`inferlab pd-plan`: what prefill/decode disaggregation would do for a model on a GPU, before
running it: each phase's predicted time (the roofline of kv-calc), the K/V hand-off over each
link the hardware preset states, and every split of a GPU budget into x prefill and y decode
instances beside as many colocated ones.

    inferlab pd-plan model=llama3-8b hardware=h100 engine.dtype=bf16 prompt_len=2048 \\
        output_len=256 gpus=8
    inferlab pd-plan model=llama3-70b hardware=h200 engine.dtype=bf16 \\
        engine.tensor_parallel_size=2 prompt_len=4096 output_len=512

The model is DistServe's first-order one, with the roofline's step times:
- a prefill instance computes one prompt at a time (prefill is compute-bound: batching prompts
  adds no speed), so it serves 1 / prefill_s requests per second;
- a decode instance runs the largest batch its KV memory holds (kv-calc's plan, at the mean
  context of a decode: prompt_len + output_len / 2), so it serves batch / (output_len x
  step_s) requests per second, with an ITL of step_s;
- a request's K/V leave the prefill instance once: each tensor-parallel rank sends its share
  over its own link (NVLink within a node, PCIe through the host, the network between nodes);
- x prefill + y decode instances serve min(x x prefill rate, y x decode rate); a request's
  TTFT is prefill_s + the hand-off + one decode step (its last prompt token joins the decode
  instance's batch), where a colocated one's is prefill_s + one decode step (its prompt joins
  the running batch);
- a colocated instance spends prefill_s + output_len x step_s / batch of GPU time per request,
  and a decode step that takes in a whole prompt waits step_s + prefill_s (its worst ITL;
  chunked prefill trades that for a longer TTFT).
Queueing is not modelled: the rates are capacities, the TTFTs without waiting in a queue.
"""

from __future__ import annotations

import sys
from typing import Any

import configs
from harness.measuring import kv_calc
from harness.measuring.hardware import HardwareSpec
from models.config import ModelConfig
from models.location import model_group_name, resolve_model
from models.tensor_parallel import tp_shard

#: the links a KV hand-off can take, and the spec field that states each one's bandwidth
LINKS = {"nvlink": "link_bandwidth", "pcie": "pcie_bandwidth", "network": "network_bandwidth"}
OWN_KEYS = {"prompt_len": 2048, "output_len": 256, "gpus": 8}


def pd_plan(
    cfg: ModelConfig,
    report: dict[str, Any],
    spec: HardwareSpec,
    prompt_len: int,
    output_len: int,
    gpus: int,
) -> dict[str, Any]:
    """The plan from kv-calc's `report` (made at context_len = prompt_len + output_len / 2)
    of `cfg` on `spec`."""
    shard = tp_shard(cfg, report["tensor_parallel_size"], expert_parallel=report["expert_parallel"])
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    # causal attention over the prompt, per layer on average (a windowed layer sees its window)
    pairs = sum(_causal_pairs(prompt_len, w) for w in windows) / len(windows)
    step = {
        "prefill_tokens": prompt_len,
        "decode_tokens": 0,
        "logits_tokens": 1,
        "attention_pairs": pairs,
        "kv_tokens_read": 0,
        "kv_tokens_written": prompt_len,
    }
    element = kv_calc.DTYPE_BYTES[report["dtype"]]
    prefill = kv_calc.predict_step(cfg, shard, element, report["dtype"], spec, report, step)
    prefill_s = prefill["step_s"]
    decode_s, batch = report["step_s"], report["batch"]
    kv_device = prompt_len * report["kv_bytes_per_token_per_device"]
    handoff = {
        link: None if getattr(spec, field) is None else kv_device / getattr(spec, field)
        for link, field in LINKS.items()
    }
    tp = report["tensor_parallel_size"]
    instances = gpus // tp
    prefill_rate = 1.0 / prefill_s
    decode_rate = batch / (output_len * decode_s)
    colocated_rate = 1.0 / (prefill_s + output_len * decode_s / batch)
    splits = [
        {
            "prefill_instances": x,
            "decode_instances": instances - x,
            "req_per_s": min(x * prefill_rate, (instances - x) * decode_rate),
            "bound": "prefill" if x * prefill_rate < (instances - x) * decode_rate else "decode",
            "ttft_s": {
                link: None if moved is None else prefill_s + moved + decode_s
                for link, moved in handoff.items()
            },
        }
        for x in range(1, instances)
    ]
    return {
        "model": report["model"],
        "hardware": spec.name,
        "dtype": report["dtype"],
        "tensor_parallel_size": tp,
        "gpus": gpus,
        "instances": instances,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "prefill_s": prefill_s,
        "prefill_compute_s": prefill["compute_s"],
        "prefill_memory_s": prefill["memory_s"],
        "decode_step_s": decode_s,
        "decode_batch": batch,
        "decode_batch_bound": report["batch_bound"],
        "kv_bytes_per_prompt": prompt_len * report["kv_bytes_per_token_per_device"] * tp,
        "handoff_s": handoff,
        "prefill_req_per_s": prefill_rate,
        "decode_req_per_s": decode_rate,
        "colocated_req_per_s": instances * colocated_rate,
        "colocated_ttft_s": prefill_s + decode_s,
        "colocated_itl_max_s": decode_s + prefill_s,
        "splits": splits,
    }


def _causal_pairs(length: int, window: int | None) -> float:
    """(query, key) pairs of causal attention over `length` tokens, within `window` keys."""
    if window is None or window >= length:
        return length * (length + 1) / 2
    return window * (window + 1) / 2 + (length - window) * window


def format_plan(p: dict[str, Any]) -> str:
    ms = kv_calc._ms
    tp = p["tensor_parallel_size"]
    on = f"{tp} GPUs" if tp > 1 else "one GPU"
    lines = [
        f"{p['model']} on {p['hardware']} ({p['dtype']}), each instance on {on}; "
        f"{p['gpus']} GPUs: {p['instances']} instances",
        f"requests: {p['prompt_len']} prompt + {p['output_len']} output tokens",
        "",
        f"prefill of one prompt  {ms(p['prefill_s'])} (compute {ms(p['prefill_compute_s'])}, "
        f"memory {ms(p['prefill_memory_s'])}): {p['prefill_req_per_s']:,.2f} req/s per instance",
        f"decode step            {ms(p['decode_step_s'])} at batch {p['decode_batch']} (bound "
        f"by {p['decode_batch_bound']}): {p['decode_req_per_s']:,.2f} req/s per instance",
        f"K/V per prompt         {p['kv_bytes_per_prompt'] / 2**20:,.1f} MiB; the hand-off: "
        + ", ".join(f"{link} {ms(s)}" for link, s in p["handoff_s"].items()),
        "",
        f"colocated x{p['instances']}: {p['colocated_req_per_s']:,.2f} req/s, TTFT "
        f"{ms(p['colocated_ttft_s'])}, worst ITL {ms(p['colocated_itl_max_s'])} "
        "(a step that takes in a whole prompt)",
        "",
        "split   req/s   vs colocated  bound    TTFT nvlink / pcie / network   ITL",
    ]
    for s in p["splits"]:
        ttft = " / ".join(ms(t) for t in s["ttft_s"].values())
        ratio = s["req_per_s"] / p["colocated_req_per_s"]
        lines.append(
            f"{s['prefill_instances']}P+{s['decode_instances']}D  {s['req_per_s']:7.2f}  "
            f"{ratio:11.2f}x  {s['bound']:7}  {ttft:29}  {ms(p['decode_step_s'])}"
        )
    return "\n".join(lines)


USAGE = """usage: inferlab pd-plan [overrides...]

  model=NAME hardware=NAME engine.dtype=T       as for kv-calc (hardware: a datasheet preset)
  engine.tensor_parallel_size=N                 GPUs per instance
  engine.max_num_seqs=N engine.max_model_len=N  a decode instance's limits
  prompt_len=N output_len=N                     the requests (default 2048 and 256)
  gpus=N                                        the GPU budget split into instances (default 8)

e.g. inferlab pd-plan model=llama3-8b hardware=h100 engine.dtype=bf16 prompt_len=2048"""


def _own_values(args: list[str]) -> tuple[dict[str, int], list[str]]:
    own, rest = dict(OWN_KEYS), []
    for arg in args:
        key, _, value = arg.partition("=")
        if key not in OWN_KEYS:
            rest.append(arg)
            continue
        if not (value.isascii() and value.isdigit() and len(value) <= 9) or int(value) < 1:
            raise ValueError(f"{key}: {value!r} is invalid; allowed: an integer >= 1")
        own[key] = int(value)
    return own, rest


def main(args: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in args):
        print(USAGE)
        return 0
    try:
        own, rest = _own_values(args)
        model, engine, spec = kv_calc.composed(rest)
        if spec is None:
            raise ValueError("hardware: a datasheet preset is needed; allowed: h100|h200|a100|l4")
        name, overrides = model_group_name(model), model.get("overrides")
        report = kv_calc.kv_calc(
            name,
            overrides,
            engine.get("max_model_len"),
            engine.get("dtype", "auto"),
            gpu_memory_utilization=engine.get("gpu_memory_utilization", 0.9),
            tensor_parallel_size=engine.get("tensor_parallel_size", 1),
            spec=spec,
            context_len=own["prompt_len"] + own["output_len"] // 2,
            max_num_seqs=engine.get("max_num_seqs"),
            expert_parallel=bool(engine.get("enable_expert_parallel", False)),
            kv_cache_dtype=engine.get("kv_cache_dtype", "auto"),
        )
        tp = report["tensor_parallel_size"]
        if own["gpus"] < 2 * tp:
            raise ValueError(
                f"gpus: {own['gpus']} do not make two instances of "
                f"engine.tensor_parallel_size={tp}; allowed: at least {2 * tp}"
            )
        if report["batch"] < 1:
            raise ValueError(
                f"engine.tensor_parallel_size: {tp} GPU(s) of {spec.name} hold no sequence of "
                f"{report['model']} beside its weights; allowed: more GPUs per instance "
                f"({', '.join(map(str, report['allowed_tensor_parallel_sizes']))})"
            )
        cfg = resolve_model(name, overrides)
        plan = pd_plan(cfg, report, spec, own["prompt_len"], own["output_len"], own["gpus"])
    except (configs.ComposeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0
