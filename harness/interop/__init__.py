"""Results in the formats other tools already have (docs/interop.md).

`inferlab export RUN --format vllm` writes a run folder as the JSON `vllm bench serve
--save-result` writes; `inferlab import FILE` reads the result files of vLLM's benchmark,
guidellm, AIPerf, genai-perf and LLMPerf into a normal run folder whose `summary.json` uses the
lab's metric names and units, so that `inferlab report` and `inferlab gate` compare it with the
lab's own runs. Every metric an import carries says where it came from and whether the source
computed it the way the lab does (`summary.json` `definitions`).

Lowest first: errors, sources (reading and validating files), imported (the tool-neutral
ImportedRun), recompute (the lab's metrics from per-request rows), write (the run folder),
unit_stats (the {unit, avg, pNN} records of NVIDIA's tools); then one module per tool;
detect (which tool wrote a file); cli (the two commands).
"""
