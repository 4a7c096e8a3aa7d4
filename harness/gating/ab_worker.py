"""An A/B worker process: runs the configurations its parent sends, one at a time.

Started as `python -c <this file's source> CODE_DIR`: the run's code (harness, engines,
workloads) is imported from CODE_DIR, which lets the two sides of an A/B job run two checkouts
(a baseline branch and a pull request) with the gate's own worker.

Protocol (JSON lines): the worker writes {"ready": true, "pid": ...} once its imports are
done, then for each line {"config": {...}, "run_dir": "..."} read from stdin it runs
run_experiment and writes {"status", "error", "wall_s"}. Anything else the run prints goes to
stderr, so stdout carries nothing but replies. A checkout from before the harness sub-packages
(harness/running/experiment.py) is run too, so that a pull request can be gated against such a base.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    module = "harness.running.experiment"
    if argv:  # the side's checkout comes first; the working directory must not shadow it
        code = os.path.abspath(argv[0])
        sys.path[:] = [code, *(p for p in sys.path if p not in ("", os.getcwd(), code))]
        # Decided by the checkout's files, not by trying the import: an installed inferlab's
        # finder would serve a module the checkout lacks, mixing two versions in one run.
        if not os.path.isfile(os.path.join(code, "harness", "running", "experiment.py")):
            module = "harness.experiment"  # a checkout from before harness/running/
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # C-level and Python prints land on stderr, never in the reply channel
    sys.stdout = sys.stderr
    run_experiment = importlib.import_module(module).run_experiment

    replies.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        start = time.perf_counter()
        try:
            summary = run_experiment(job["config"], job["run_dir"], progress=False)
            reply = {"status": summary["status"], "error": summary.get("error")}
        except Exception as exc:  # run_experiment records failures; this is a last resort
            reply = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        reply["wall_s"] = time.perf_counter() - start
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
