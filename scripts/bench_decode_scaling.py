"""The built-in engine's batch-B decode step beside llama.cpp's own loop on the same GGUF file,
per thread count and batch size: how each scales with cores (issue 36).

    .venv/bin/python scripts/bench_decode_scaling.py                   # 1 and 2 threads, batch 1
    .venv/bin/python scripts/bench_decode_scaling.py --batches 1,4,16 --rounds 5
    .venv/bin/python scripts/bench_decode_scaling.py --threads 2 --busy-core 1 \\
        --variants llamacpp,int4_g32_a8 --engine-option native_decode_program=false
    .venv/bin/python scripts/bench_decode_scaling.py --busy-core 1 \\
        --variants llamacpp,int4_g32_fp32,int4_g32_fp32@passive,int4_g32_fp32@active
    .venv/bin/python scripts/bench_decode_scaling.py --json scaling.csv     # every measurement

On SmolLM2-135M's GGUF file (model=smollm2-135m, Q4_1 linear layers): the built-in engine in
the variants' settings (configs/variant/: int4_g32_fp32, int4_g32_a8, int8_fp32, fp32, composed
as `inferlab run model=smollm2-135m variant=NAME` composes them) through its Python API
(engines/builtin/llm.py), and llama.cpp's raw loop (scripts/bench_llamacpp_overhead.py's
run_raw: llama_decode + argmax of every row per step) on the file as it is (`llamacpp`, Q4_1)
and re-encoded to Q8_0 (`llamacpp_q8_0`, the row int8 compares with).

Each (variant, threads) runs in a fresh process (OpenMP's wait policy and thread pool are a
process's own), round by round with the variants in rotated order, so that a change in the
machine's load hits them alike. A process builds its engine once (max_num_seqs = the largest
batch), runs one warm-up, then per batch size B: B prompts of `--input-len` tokens (the same
token ids for every variant: windows of the shipped corpus, tokenized by the GGUF file's
tokenizer), greedy, EOS ignored, `--output-len` decode steps after the first token. Measured:
the median full decode step (every one of the B sequences decoding, no prompt tokens), in ms.
For the built-in engine that is the step as its StepRecord times it (scheduling, the forward,
sampling and the step's bookkeeping; detokenization is off, as the raw loop has none), beside
its step period (one step's start to the next's: with LLM.generate's Python between steps);
for llama.cpp, llama_decode plus the argmax of every row. tok/s is B / step.

Printed: one line per process, then the medians over rounds per (threads, batch, variant), with
each built-in variant's per-token speed against llama.cpp's (Q4_1 for the int4 variants and
fp32, Q8_0 for int8_fp32: llama.cpp's step / the variant's; above 1 is faster), and each
variant's tok/s per thread count against its fewest threads. A study, no verdict: exit 0, or 1
when a measuring process failed.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# the environment as the user gave it, before any of the lab's imports sets OpenMP's wait
# policy in it (engines/openmp.py): every measuring process chooses for itself
USER_ENV = dict(os.environ)

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
# variant -> the llama.cpp variant its per-token speed is compared with (None: llama.cpp)
VARIANTS: dict[str, str | None] = {
    "llamacpp": None,  # the GGUF file as it is: Q4_1 linear layers
    "int4_g32_fp32": "llamacpp",
    "int4_g32_a8": "llamacpp",
    "int8_fp32": "llamacpp_q8_0",
    "llamacpp_q8_0": None,  # the same weights re-encoded as Q8_0 (converted once, cached)
    "fp32": "llamacpp",
}
REFERENCE_LABELS = {"llamacpp": "Q4_1", "llamacpp_q8_0": "Q8_0"}
# a built-in variant@policy runs with engine.cpu_wait_policy=policy (e.g. int4_g32_fp32@passive)
WAIT_POLICIES = ("auto", "active", "passive")


def base_variant(name: str) -> str:
    """The configs/variant/ name of a --variants entry (its @policy dropped)."""
    return name.split("@", 1)[0]


# engine options the script sets itself, per measuring process
SET_BY_SCRIPT = {
    "model": "--variants (model=smollm2-135m)",
    "num_threads": "--threads",
    "max_num_seqs": "--batches (the largest)",
    "max_model_len": "--input-len and --output-len",
}
# the context the presets use (experiment=vs_llamacpp*), longer when the request needs it
MAX_MODEL_LEN = 512
WARMUP_TOKENS = 4


# ---- a measuring process (--child) -----------------------------------------------------------


def overhead_script() -> Any:
    """scripts/bench_llamacpp_overhead.py, whose raw loop, prompts and full-step filter this
    script reuses; imported by name, so that mypy checks it on its own, not as part of this."""
    return importlib.import_module("bench_llamacpp_overhead")


def digest(prompt_ids: list[list[int]]) -> str:
    """A short fingerprint of the prompts, so that the rows show both engines got the same."""
    return hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:12]


def measure_llamacpp(spec: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's raw loop (run_raw) on the runner engine=llamacpp builds for these options."""
    overhead = overhead_script()
    prompts, run_raw = overhead.prompts, overhead.run_raw

    from engines.backends import build_backend
    from engines.llamacpp.backend import LlamaCppBackend
    from engines.llamacpp.peer_build import build_record

    backend = build_backend(spec["engine"], spec["model"])
    assert isinstance(backend, LlamaCppBackend)
    backend.load()
    runner = backend.runner
    assert runner is not None
    batches: list[int] = spec["batches"]
    batch_tokens = int(spec["engine"]["max_num_batched_tokens"])
    prompt_ids = prompts(backend, max(batches), spec["input_len"])
    run_raw(runner, prompt_ids, WARMUP_TOKENS, len(prompt_ids), batch_tokens)  # warm-up
    results = []
    for batch in batches:
        ids = prompt_ids[:batch]
        # output_len + 1 tokens: the first from the prompt, then output_len timed steps
        [step_ms] = run_raw(runner, ids, spec["output_len"] + 1, batch, batch_tokens)
        results.append(
            {
                "batch": batch,
                "step_ms": step_ms,
                "period_ms": None,
                "forward_ms": None,
                "full_steps": spec["output_len"],
                "prompt_digest": digest(ids),
            }
        )
    described = runner.describe()
    record = build_record() or {}
    info = {
        "gguf_file": str(backend.gguf_file),
        "model_desc": described["model_desc"],
        "llama_cpp_python": described["llama_cpp_python"],
        "system_info": described["system_info"],
        "build_isa": record.get("isa"),
        "build_cmake_args": record.get("cmake_args"),
    }
    backend.close()
    return {"results": results, "info": info}


def measure_builtin(spec: dict[str, Any]) -> dict[str, Any]:
    """The built-in engine through LLM.generate, its full decode steps from its StepRecords."""
    overhead = overhead_script()
    prompts, backend_times = overhead.prompts, overhead.backend_times

    from engines.base import StepRecord
    from engines.builtin import native
    from engines.builtin.llm import LLM
    from engines.openmp import wait_policy
    from engines.sampling_params import SamplingParams

    options = {k: v for k, v in spec["engine"].items() if k != "backend"}
    model = spec["model"]
    llm = LLM(
        model=model["name"],
        model_overrides=dict(model.get("overrides") or {}),
        tokenizer=model.get("tokenizer"),
        **options,
    )
    steps: list[StepRecord] = []
    llm.engine.step_observers.append(steps.append)
    batches: list[int] = spec["batches"]
    # prompts() reads only `.tokenizer`: the built-in engine's, built from the same GGUF file
    # as engine=llamacpp's (the rows' prompt_digest shows the ids are the same)
    prompt_ids = prompts(llm, max(batches), spec["input_len"])

    def params(tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)

    llm.generate(prompt_ids, params(WARMUP_TOKENS))  # warm-up
    results = []
    for batch in batches:
        ids = prompt_ids[:batch]
        steps.clear()
        outputs = llm.generate(ids, params(spec["output_len"] + 1))
        wanted = spec["output_len"] + 1
        bad = [o.error or len(o.token_ids) for o in outputs if len(o.token_ids) != wanted]
        if bad:
            raise RuntimeError(f"batch {batch}: requests ended early: {bad[:3]}")
        full = [s for s in steps if s.num_decode_seqs == batch and s.prefill_tokens == 0]
        times = backend_times(steps, batch)
        if len(times["step"]) != 1:  # all B prompts admitted together: one wave of full steps
            raise RuntimeError(f"batch {batch}: {len(times['step'])} waves of full decode steps")
        results.append(
            {
                "batch": batch,
                "step_ms": times["step"][0],
                "period_ms": times["period"][0] if times["period"] else None,
                "forward_ms": statistics.median(s.forward_ns for s in full) / 1e6,
                "full_steps": len(full),
                "prompt_digest": digest(ids),
            }
        )
    kernels = native.info(load_now=False)
    policy = wait_policy()
    info = {
        "native_isa": kernels["isa"],
        "native_loaded": kernels["loaded"],
        "native_reason": kernels["reason"],
        "torch_threads": llm.engine.platform.num_threads,
        "omp_wait_policy": policy.get("OMP_WAIT_POLICY"),
        "omp_wait_source": policy.get("source"),
    }
    llm.close()
    return {"results": results, "info": info}


def child(spec: dict[str, Any]) -> int:
    import engines  # noqa: F401  (OpenMP's wait policy, before torch loads)

    start = time.perf_counter()
    measure = measure_llamacpp if spec["engine"]["backend"] == "llamacpp" else measure_builtin
    reply = measure(spec)
    reply["child_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(reply), flush=True)
    return 0


# ---- the parent -------------------------------------------------------------------------------


def cpu_facts() -> dict[str, Any]:
    """The CPU's model name and the vector ISA flags that matter here (/proc/cpuinfo)."""
    model, flags = "unknown", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu_model": model,
        "avx512f": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "cpus_usable": len(os.sched_getaffinity(0)),
    }


def compose_variant(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine and model groups `inferlab run model=smollm2-135m variant=NAME` runs with."""
    from omegaconf import OmegaConf

    import configs
    import engines.backends  # noqa: F401  (the engine groups' schemas, for compose)
    import workloads  # noqa: F401  (the workload groups' schemas, for compose)
    from harness.running import config_schema  # noqa: F401  (the run section's)

    cfg = OmegaConf.to_container(
        configs.compose([f"model={MODEL}", f"variant={name}"]), resolve=True
    )
    assert isinstance(cfg, dict)
    return dict(cfg["engine"]), dict(cfg["model"])


def parse_engine_options(values: list[str]) -> dict[str, Any]:
    """`--engine-option KEY=VALUE`s, each value read as a YAML scalar; ValueError naming it."""
    import yaml

    options: dict[str, Any] = {}
    for text in values:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{text!r} is invalid; allowed: KEY=VALUE (an engine option)")
        if key in SET_BY_SCRIPT:
            raise ValueError(f"{key}: set by {SET_BY_SCRIPT[key]}; allowed: any other option")
        try:
            options[key] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            raise ValueError(f"{key}: {raw!r} is not a YAML scalar") from None
    return options


def builtin_engine(engine: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A built-in variant's options with --engine-option applied, checked by EngineConfig
    (a ValueError naming the field)."""
    from engines.builtin.config import EngineConfig

    options = {**engine, **extra}
    EngineConfig.from_dict({k: v for k, v in options.items() if k != "backend"} | {"model": MODEL})
    return options


class ChildFailed(RuntimeError):
    pass


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measuring process; its JSON reply (its last stdout line)."""
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        cwd=REPO,
        env=USER_ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-3:]
        raise ChildFailed(
            f"{spec['variant']} on {spec['engine']['num_threads']} threads: exit "
            f"{done.returncode}: {' | '.join(tail) or 'no output'}"
        )
    reply = json.loads(lines[-1])
    assert isinstance(reply, dict)
    return reply


SPINNER = """\
import os
os.sched_setaffinity(0, {{{cpu}}})
parent, turns = os.getppid(), 0
while True:  # spin; leave when the benchmark is gone, even if it was killed
    turns += 1
    if turns % 4_000_000 == 0 and os.getppid() != parent:
        break
"""


@contextmanager
def busy_core(cpu: int | None) -> Iterator[None]:
    """A process spinning on CPU `cpu` for the whole run (None: none), ended on the way out,
    on Ctrl-C and SIGTERM too."""
    if cpu is None:
        yield
        return
    spinner = subprocess.Popen(
        [sys.executable, "-c", SPINNER.format(cpu=cpu)], stdin=subprocess.DEVNULL, env=USER_ENV
    )
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()
        signal.signal(signal.SIGTERM, previous)


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summary(rows: list[dict[str, Any]]) -> dict[tuple[int, int, str], dict[str, Any]]:
    """(threads, batch, variant) -> the medians over rounds."""
    groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["threads"], row["batch"], row["variant"]), []).append(row)
    out = {}
    for key, group in groups.items():
        step = statistics.median(r["step_ms"] for r in group)
        out[key] = {
            "step_ms": step,
            "period_ms": median_or_none([r["period_ms"] for r in group]),
            "tok_s": key[1] * 1000 / step,
            "rounds": len(group),
        }
    return out


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(rows: list[dict[str, Any]], variants: list[str], threads: list[int]) -> None:
    medians = summary(rows)
    print(
        f"\n{'threads':>7} {'batch':>5}  {'variant':<22} {'step ms':>8} {'period ms':>9} "
        f"{'tok/s':>8}  vs llama.cpp (per token)"
    )
    for t in threads:
        for b in sorted({r["batch"] for r in rows}):
            for v in variants:
                m = medians.get((t, b, v))
                if m is None:
                    continue
                reference = VARIANTS[base_variant(v)]
                if reference is None:
                    versus = f"({REFERENCE_LABELS[v]})"
                elif (ref := medians.get((t, b, reference))) is not None:
                    versus = f"{ref['step_ms'] / m['step_ms']:.2f}x {REFERENCE_LABELS[reference]}"
                else:
                    versus = f"- ({reference} not measured)"
                print(
                    f"{t:>7} {b:>5}  {v:<22} {m['step_ms']:>8.2f} "
                    f"{fmt(m['period_ms'], '.2f'):>9} {m['tok_s']:>8.1f}  {versus}"
                )
    if len(threads) < 2:
        return
    low = threads[0]
    print(f"\ntok/s by threads (x: against {low} thread{'s' if low > 1 else ''})")
    head = "".join(f" {f'{t} thread' + ('s' if t > 1 else ''):>18}" for t in threads)
    print(f"{'batch':>5}  {'variant':<22}{head}")
    for b in sorted({r["batch"] for r in rows}):
        for v in variants:
            base = medians.get((low, b, v))
            cells = []
            for t in threads:
                m = medians.get((t, b, v))
                if m is None:
                    cells.append(f" {'-':>18}")
                    continue
                ratio = f" ({m['tok_s'] / base['tok_s']:.2f}x)" if base else ""
                cell = f"{m['tok_s']:.1f}{ratio}"
                cells.append(f" {cell:>18}")
            print(f"{b:>5}  {v:<22}{''.join(cells)}")


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    from models.files import write_output_text

    if path.suffix.lower() == ".csv":
        columns: list[str] = []
        for row in rows:
            columns += [k for k in row if k not in columns]
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
        write_output_text(path, text.getvalue(), "--json")
    else:
        write_output_text(path, json.dumps(rows, indent=1) + "\n", "--json")


def comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    from harness.arguments import at_least, integers_at_least

    parser.add_argument(
        "--variants",
        type=comma_list,
        default=list(VARIANTS),
        help=f"comma-separated, of {','.join(VARIANTS)} (default: all)",
    )
    parser.add_argument(
        "--threads", type=integers_at_least(1), default=[1, 2], help="comma-separated (1,2)"
    )
    parser.add_argument(
        "--batches", type=integers_at_least(1), default=[1], help="comma-separated (1), e.g. 1,4,16"
    )
    parser.add_argument("--rounds", type=at_least(1), default=3, help="(3)")
    parser.add_argument("--input-len", type=at_least(1), default=128, help="prompt tokens (128)")
    parser.add_argument(
        "--output-len", type=at_least(2), default=48, help="decode steps timed per batch (48)"
    )
    parser.add_argument(
        "--busy-core",
        type=at_least(0),
        default=None,
        metavar="N",
        help="keep a process spinning on CPU N for the whole run",
    )
    parser.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an EngineConfig option for the built-in variants (repeatable; a YAML scalar)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="every row; .csv: as CSV")
    parser.add_argument("--force", action="store_true", help="--json may write over a file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return args
    unknown = [v for v in args.variants if base_variant(v) not in VARIANTS]
    if unknown or not args.variants:
        parser.error(
            f"--variants: unknown {unknown or 'empty list'}; allowed: a comma-separated list "
            f"of {','.join(VARIANTS)}, a built-in one optionally with @policy"
        )
    for v in args.variants:
        policy = v.partition("@")[2]
        if "@" in v and (VARIANTS[base_variant(v)] is None or policy not in WAIT_POLICIES):
            parser.error(
                f"--variants: {v!r}; allowed after @: a built-in variant's "
                f"engine.cpu_wait_policy, one of {'|'.join(WAIT_POLICIES)}"
            )
    if len(set(args.variants)) != len(args.variants):
        parser.error(f"--variants: {','.join(args.variants)} names one twice; allowed: each once")
    args.threads = sorted(set(args.threads))
    args.batches = sorted(set(args.batches))
    usable = sorted(os.sched_getaffinity(0))
    if args.busy_core is not None and args.busy_core not in usable:
        parser.error(
            f"--busy-core: {args.busy_core} is not a CPU this process may run on; allowed: "
            f"one of {','.join(map(str, usable))}"
        )
    if args.json is not None:
        from harness.run_folder import output_file_path

        try:
            args.json = output_file_path(args.json, "--json")
        except ValueError as exc:
            parser.error(str(exc))
        if args.json.exists() and not args.force:
            parser.error(
                f"--json: {args.json} exists and is not written over; allowed: a new file's "
                "path, or --force"
            )
        if not args.json.parent.is_dir():
            parser.error(f"--json: {args.json.parent} is not a folder; allowed: a file's path")
    try:
        args.engine_options = parse_engine_options(args.engine_option)
    except ValueError as exc:
        parser.error(f"--engine-option: {exc}")
    with_policy = [v for v in args.variants if "@" in v]
    if "cpu_wait_policy" in args.engine_options and with_policy:
        # applied after a variant's @policy, it would relabel every row's measurement
        parser.error(
            f"--engine-option: cpu_wait_policy: set by --variants' @policy on "
            f"{','.join(with_policy)}; allowed: one of the two"
        )
    return args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args = parse_args(parser)
    if args.child is not None:
        return child(json.loads(args.child))

    max_batch = max(args.batches)
    max_model_len = max(MAX_MODEL_LEN, args.input_len + args.output_len + 1)
    configured: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for name in args.variants:
        engine, model = compose_variant(base_variant(name))
        engine.update(max_num_seqs=max_batch, max_model_len=max_model_len)
        if "@" in name:
            engine["cpu_wait_policy"] = name.partition("@")[2]
        if engine["backend"] == "llamacpp":
            engine["max_num_batched_tokens"] = max(engine["max_num_batched_tokens"], max_batch)
        else:
            try:
                engine = builtin_engine(engine, args.engine_options)
            except ValueError as exc:
                parser.error(f"--engine-option: {exc}")
        configured[name] = (engine, model)

    facts = cpu_facts()
    print(
        f"CPU: {facts['cpu_model']} ({facts['cpus_usable']} usable CPUs; avx512f "
        f"{'yes' if facts['avx512f'] else 'no'}, avx2 {'yes' if facts['avx2'] else 'no'}); "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{MODEL}: {args.input_len}-token prompts, {args.output_len} decode steps timed; "
        f"threads {args.threads}, batches {args.batches}, {args.rounds} rounds; variants "
        f"{','.join(args.variants)}"
        + (f"; engine options {args.engine_options}" if args.engine_options else "")
        + (f"; CPU {args.busy_core} kept busy" if args.busy_core is not None else "")
    )

    rows: list[dict[str, Any]] = []
    info: dict[str, dict[str, Any]] = {}
    failed: str | None = None
    with busy_core(args.busy_core):
        try:
            for round_ in range(args.rounds):
                shift = round_ % len(args.variants)
                order = args.variants[shift:] + args.variants[:shift]
                for threads in args.threads:
                    for name in order:
                        engine, model = configured[name]
                        spec = {
                            "variant": name,
                            "engine": {**engine, "num_threads": threads},
                            "model": model,
                            "batches": args.batches,
                            "input_len": args.input_len,
                            "output_len": args.output_len,
                        }
                        load = os.getloadavg()[0]
                        reply = run_child(spec)
                        info.setdefault(engine["backend"], reply["info"])
                        for result in reply["results"]:
                            rows.append(
                                {
                                    "round": round_,
                                    "variant": name,
                                    "backend": engine["backend"],
                                    "threads": threads,
                                    **result,
                                    "tok_s": result["batch"] * 1000 / result["step_ms"],
                                    "load_avg": load,
                                    "busy_core": args.busy_core,
                                    **facts,
                                    **{f"info_{k}": v for k, v in reply["info"].items()},
                                }
                            )
                        steps = "  ".join(
                            f"B={r['batch']} {r['step_ms']:.2f} ms" for r in reply["results"]
                        )
                        print(
                            f"round {round_}  {threads} threads  {name:<22} {steps}  "
                            f"(load {load:.2f}, {reply['child_s']} s)",
                            flush=True,
                        )
        except ChildFailed as exc:
            failed = str(exc)
            print(f"a measuring process failed: {failed}", file=sys.stderr)

    builtin, llamacpp = info.get("builtin"), info.get("llamacpp")
    if builtin:
        print(
            f"\nbuilt-in engine: native kernels {builtin['native_isa']}"
            + ("" if builtin["native_loaded"] else f" (not loaded: {builtin['native_reason']})")
            + f"; OMP_WAIT_POLICY {builtin['omp_wait_policy']} ({builtin['omp_wait_source']})"
        )
    if llamacpp:
        print(
            f"llama.cpp: llama-cpp-python {llamacpp['llama_cpp_python']}, build "
            f"{llamacpp['build_isa']} {' '.join(llamacpp['build_cmake_args'] or [])}; "
            f"{llamacpp['system_info']}"
        )
    digests: dict[int, set[str]] = {}
    for row in rows:
        digests.setdefault(row["batch"], set()).add(row["prompt_digest"])
    differing = sorted(b for b, d in digests.items() if len(d) > 1)
    if differing:
        print(f"note: the prompts' token ids differ between variants at batches {differing}")
    if rows:
        print_tables(rows, args.variants, args.threads)
    if args.json is not None and rows:
        write_rows(args.json, rows)
        print(f"\n{len(rows)} rows written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
