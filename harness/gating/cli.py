"""`inferlab gate`: compare a candidate with a baseline and exit 0 (pass), 1 (regression) or
2 (inconclusive, or the comparison could not be made), printing a markdown table.

    inferlab gate --baseline DIR --candidate DIR [--rules FILE]   # runs, repeats, sweeps
    inferlab gate --ab DIR [--rules FILE]                         # re-gate an A/B folder
    inferlab gate ab --baseline "..." --candidate "..." --out DIR # run A/B rounds, then gate

How it decides: docs/gate.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from harness.gating.compare import (
    GateResult,
    Row,
    compare_sides,
    config_differences,
    definition_warnings,
)
from harness.gating.inputs import InputError, ab_rounds, load_side, read_run
from harness.gating.rules import GateRules, RulesError, add_require_argument, load_rules
from harness.measuring.metrics import REGISTRY
from harness.run_folder import AB_FILE, refuse_run_file
from models.files import given_output_path, write_output_text

USAGE_EXAMPLES = """examples:
  inferlab gate --baseline results/main --candidate results/pr
  inferlab gate --baseline sweeps/main --candidate sweeps/pr --rules ci/gate.yaml
  inferlab gate --ab results/ab-123          # re-gate a finished A/B folder (paired)
  inferlab gate ab --baseline "" --candidate "engine.kv_cache=paged" \\
      --common "model=small workload.num_requests=8" --rounds 9 --out results/ab-123

exit status: 0 pass, 1 regression, 2 inconclusive (nothing compared, a required metric
absent, too few runs, too much noise) or bad input"""


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def _cell(row: Row, value: float | None, n: int) -> str:
    text = _fmt(value)
    return f"{text} (n={n})" if row.kind == "timing" and value is not None else text


def _verdict_cell(row: Row) -> str:
    verdict = row.verdict.upper() if row.outcome == "regression" else row.verdict
    if not row.gates and row.verdict not in ("missing", "info"):
        verdict += " (not gating)"
    elif row.gates and row.verdict == "missing":
        verdict = "MISSING (required)"
    return f"{verdict}: {row.note}" if row.note else verdict


def markdown(result: GateResult, title: str = "inferlab gate", all_rows: bool = False) -> str:
    """The result as markdown: a heading with the verdict, warnings, then the table (counters
    equal on both sides are listed after it in one line unless `all_rows`)."""
    lines = [f"## {title}: {result.verdict.upper()} (exit {result.exit_code})", ""]
    lines += [f"- warning: {w}" for w in result.warnings]
    if result.warnings:
        lines.append("")
    with_job = any(row.job for row in result.rows)
    header = ["metric", "baseline", "candidate", "ratio", "CI", "verdict"]
    if with_job:
        header.insert(0, "job")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    equal = [
        row
        for row in result.rows
        if not all_rows and row.kind == "deterministic" and row.verdict == "pass"
    ]
    equal_ids = {id(row) for row in equal}
    for row in result.rows:
        if id(row) in equal_ids:
            continue
        unit = REGISTRY[row.metric].unit if row.metric in REGISTRY else ""
        ci = f"[{row.ci[0]:.3f}, {row.ci[1]:.3f}]" if row.ci else "-"
        cells = [
            f"`{row.metric}`" + (f" ({unit})" if unit else ""),
            _cell(row, row.baseline, row.n_baseline),
            _cell(row, row.candidate, row.n_candidate),
            f"{row.ratio:.3f}" if row.ratio is not None else "-",
            ci,
            _verdict_cell(row),
        ]
        if with_job:
            cells.insert(0, row.job)
        lines.append("| " + " | ".join(cells) + " |")
    if equal:
        jobs = {row.job for row in equal}
        where = f" (in {len(jobs)} jobs)" if len(jobs) > 1 else ""
        names = ", ".join(dict.fromkeys(row.metric for row in equal))
        lines += ["", f"Equal on both sides{where} ({len(equal)} counters): {names}."]
    mode = "paired ratios over A/B rounds" if result.paired else "ratios over runs"
    lines += [
        "",
        f"ratio = candidate / baseline ({mode}); CI = bootstrap interval of the "
        "ratio; counters are compared exactly.",
    ]
    return "\n".join(lines)


def gate_dirs(
    baseline: str | Path, candidate: str | Path, rules: GateRules, ignore: set[str] | None = None
) -> GateResult:
    """Compare two runs, repeats folders or sweeps (unpaired)."""
    base = load_side(baseline, "a", ignore)
    cand = load_side(candidate, "b", ignore)
    result = compare_sides(base, cand, rules, ignore=ignore)
    differences = config_differences(base, cand)
    if differences:
        result.warnings.insert(0, "configuration differs: " + "; ".join(differences))
    result.warnings += definition_warnings(base, cand, result)
    return result


def gate_ab_dir(path: str | Path, rules: GateRules) -> GateResult:
    """Compare the two sides of an A/B folder on their paired per-round ratios."""
    path = Path(path)
    if not (path / AB_FILE).exists():
        raise InputError(f"--ab: {path} holds no {AB_FILE}")
    rounds = [entry for entry in ab_rounds(path) if entry["a"] and entry["b"]]
    pairs = [(read_run(path / entry["a"]), read_run(path / entry["b"])) for entry in rounds]
    return compare_sides(load_side(path, "a"), load_side(path, "b"), rules, pairs=pairs)


def emit(
    result: GateResult,
    markdown_out: str | None,
    json_out: str | None,
    title: str = "inferlab gate",
    all_rows: bool = False,
) -> int:
    text = markdown(result, title, all_rows)
    for option, out in (("--markdown", markdown_out), ("--json", json_out)):
        if out:  # both checked before either is written
            refuse_run_file(Path(out), option)
    # the files first: a table that says "exit 0" must not be followed by a failed write
    if markdown_out:
        write_output_text(markdown_out, text + "\n", "--markdown")
    if json_out:
        result_json = json.dumps(result.to_dict(), indent=2, default=str) + "\n"
        write_output_text(json_out, result_json, "--json")
    print(text)
    return result.exit_code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferlab gate",
        epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compare a candidate with a baseline (runs, runs with repeats, folders of "
        "runs, sweeps, A/B folders). `inferlab gate ab --help`: the A/B mode.",
    )
    parser.add_argument("--baseline", help="baseline run, repeats, sweep or A/B folder")
    parser.add_argument("--candidate", help="candidate run, repeats, sweep or A/B folder")
    parser.add_argument("--ab", metavar="DIR", help="re-gate a finished A/B folder (paired)")
    parser.add_argument("--rules", help="rules YAML merged over configs/gate/default.yaml")
    add_require_argument(parser)
    parser.add_argument(
        "--ignore-override",
        action="append",
        default=[],
        metavar="KEY",
        help="sweeps: leave this override key out of job matching (repeatable)",
    )
    parser.add_argument("--markdown", metavar="FILE", help="also write the table here")
    parser.add_argument("--json", metavar="FILE", help="write the result as JSON here")
    parser.add_argument(
        "--all-rows", action="store_true", help="one table row per counter, equal ones included"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.ab and (args.baseline or args.candidate):
        parser.error("--ab DIR re-gates an A/B folder; it takes no --baseline/--candidate")
    if not args.ab and not (args.baseline and args.candidate):
        parser.error("give --baseline DIR and --candidate DIR (or --ab DIR)")
    try:
        for option, out in (("--markdown", args.markdown), ("--json", args.json)):
            if out is not None:
                given_output_path(out, option, "a file path")
        rules = load_rules(args.rules, tuple(args.require_metric))
        if args.ab:
            result = gate_ab_dir(args.ab, rules)
        else:
            result = gate_dirs(args.baseline, args.candidate, rules, set(args.ignore_override))
        return emit(result, args.markdown, args.json, all_rows=args.all_rows)
    except (RulesError, InputError, ValueError) as exc:
        print(f"inferlab gate: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an unreadable folder, an unwritable --json/--markdown path
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"inferlab gate: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except RecursionError:
        print("inferlab gate: error: an input is nested too deeply", file=sys.stderr)
        return 2
    except Exception:  # a bug, not a verdict: CI reads exit 1 as a regression
        traceback.print_exc()
        print(
            "inferlab gate: internal error (the traceback above is a bug in the gate, "
            "please report it); exit 2, not 1: nothing was decided",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
