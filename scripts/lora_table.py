"""docs/lora.md's table from an `experiment=lora` sweep folder: per job the adapters' rank and
count, TPOT p50 and output tok/s (sweep.csv), the median decode step of the steps that decode
every sequence at once (steps.parquet; `--rows`, the experiment's max_num_seqs), that step
against the same rank's base-model job, the most adapters one step ran, and the adapters' disk
load time and size (summary.json engine.lora).

    .venv/bin/python -m harness.cli run -m experiment=lora hydra.sweep.dir=/tmp/lora
    .venv/bin/python scripts/lora_table.py /tmp/lora --out docs/data/lora_smollm2.csv
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
from script_args import parse_args_checking_out, refuse


def job_facts(folder: Path, rows: int) -> dict[str, float | int | None]:
    summary = json.loads((folder / "summary.json").read_text())
    lora = summary["engine"].get("lora") or {}
    steps = pd.read_parquet(folder / "steps.parquet")
    decodes = steps[(steps.num_prefill_seqs == 0) & (steps.num_decode_seqs == rows)]
    loads = lora.get("lora_disk_loads") or 0
    sizes = [adapter["bytes"] for adapter in (lora.get("adapters") or {}).values()]
    return {
        "job": int(folder.name),
        "decode_step_ms": float((decodes.end_s - decodes.start_s).median() * 1e3)
        if len(decodes)
        else None,
        "decode_steps": len(decodes),
        "adapters_max": int(steps.lora_adapters.max()),
        "load_ms_per_adapter": 1e3 * lora.get("lora_disk_load_s", 0.0) / loads if loads else None,
        "adapter_mb": sizes[0] / 1e6 if sizes else None,
    }


def table(sweep: Path, rows: int) -> pd.DataFrame:
    jobs = pd.read_csv(sweep / "sweep.csv")
    if "engine.lora_dummy_rank" not in jobs or "workload.lora_adapters" not in jobs:
        refuse(f"{sweep}: not an experiment=lora sweep (no lora_dummy_rank / lora_adapters)")
    jobs["adapters"] = jobs["workload.lora_adapters"].map(
        lambda names: 0 if str(names) in ("[]", "", "nan") else len(str(names).split(","))
    )
    facts = pd.DataFrame([job_facts(sweep / str(job), rows) for job in jobs.job])
    out = jobs[["job", "engine.lora_dummy_rank", "adapters", "tpot_p50_s", "output_tok_per_s"]]
    out = out.merge(facts, on="job")
    rank = out["engine.lora_dummy_rank"]
    base = out[out.adapters == 0].set_index("engine.lora_dummy_rank").decode_step_ms
    out["step_vs_base"] = out.decode_step_ms / rank.map(base)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="the experiment=lora sweep folder")
    parser.add_argument("--rows", type=int, default=16, help="the decode steps' sequences")
    parser.add_argument("--out", help="also write the table here (csv)")
    args = parse_args_checking_out(parser)
    if not (args.sweep / "sweep.csv").is_file():
        refuse(f"{args.sweep}: no sweep.csv (the folder of an `inferlab run -m` sweep)")
    out = table(args.sweep, args.rows)
    pd.set_option("display.width", 200)
    print(out.to_string(index=False))
    if args.out:
        out.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
