"""Which tool wrote a result file, told from its content (or given), and the importer that
reads it. A folder stands for the one result file in it that a tool names by default."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.interop import aiperf, genai_perf, guidellm, llmperf, vllm_import
from harness.interop.errors import InteropError
from harness.interop.imported import ImportedRun
from harness.interop.sources import parse_json_documents, parse_yaml, read_text

FORMATS = ("vllm", "guidellm", "aiperf", "genai-perf", "llmperf")
#: the result files each tool writes by default, for a folder given instead of a file
DEFAULT_FILES = (
    "profile_export_aiperf.json",
    "profile_export_genai_perf.json",
    "benchmarks.json",  # guidellm's default output
    "benchmarks.yaml",
)
ALLOWED = "|".join(FORMATS)


@dataclass
class Content:
    kind: str  # json (one document) | jsonl (several) | yaml | csv
    documents: list[Any]
    text: str


def result_file(path: Path) -> Path:
    """`path`, or the one result file a tool names by default in the folder `path`."""
    if not path.is_dir():
        return path
    found = [path / name for name in DEFAULT_FILES if (path / name).is_file()]
    found += sorted(path.glob(f"*{llmperf.SUMMARY_SUFFIX}.json"))
    if len(found) != 1:
        what = "several: " + ", ".join(p.name for p in found) if found else "none"
        raise InteropError(
            f"{path}: a folder; give the result file in it (default names: "
            f"{', '.join(DEFAULT_FILES)}, *_summary.json; found {what})"
        )
    return found[0]


def read_content(path: Path) -> Content:
    text = read_text(path)
    if not text.strip():
        raise InteropError(f"{path}: empty file; expected a result file of {', '.join(FORMATS)}")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return Content("csv", [], text)
    if suffix in (".yaml", ".yml"):
        return Content("yaml", [parse_yaml(path, text)], text)
    documents = parse_json_documents(path, text)
    return Content("json" if len(documents) == 1 else "jsonl", documents, text)


def sniff(content: Content) -> str | None:
    """The tool whose file this looks like, or None."""
    if content.kind == "csv":
        first = content.text.lstrip().splitlines()[0] if content.text.strip() else ""
        header = [cell.strip() for cell in first.split(",")]
        if header[:1] == ["Metric"] and "p1" in header:
            return "aiperf"
        if header[:1] == ["Metric"] and "p25" in header:
            return "genai-perf"
        return None
    docs = content.documents
    if all(aiperf.looks_like_record(d) for d in docs):
        return "aiperf"
    if all(vllm_import.looks_like(d) for d in docs):
        return "vllm"
    if len(docs) != 1:
        return None
    data = docs[0]
    for tool, looks_like in (
        ("guidellm", guidellm.looks_like),
        ("aiperf", aiperf.looks_like_summary),
        ("genai-perf", genai_perf.looks_like),
        ("llmperf", llmperf.looks_like_summary),
        ("llmperf", llmperf.looks_like_responses),
    ):
        if looks_like(data):
            return tool
    return None


def _one_document(content: Content, path: Path, tool: str) -> Any:
    if content.kind == "csv" or len(content.documents) != 1:
        raise InteropError(f"{path}: not a {tool} result: expected one JSON or YAML document")
    return content.documents[0]


def load(path: Path, fmt: str = "auto") -> list[ImportedRun]:
    """Every benchmark in the result file `path` (or the folder's one result file), read by
    the importer of `fmt` (auto: told from the content)."""
    if fmt != "auto" and fmt not in FORMATS:
        raise InteropError(f"--format: {fmt!r} is invalid; allowed: auto|{ALLOWED}")
    path = result_file(path)
    content = read_content(path)
    tool = sniff(content) if fmt == "auto" else fmt
    if tool is None:
        raise InteropError(
            f"{path}: cannot tell which tool wrote it (not a result file of {', '.join(FORMATS)} "
            f"as the lab knows them); give --format {ALLOWED}"
        )
    if tool == "vllm":
        if content.kind not in ("json", "jsonl"):
            raise InteropError(f"{path}: not a vllm bench serve result: vLLM writes JSON")
        return vllm_import.import_file(content.documents, path)
    if tool == "guidellm":
        return guidellm.import_report(_one_document(content, path, tool), path)
    if tool == "aiperf":
        if content.kind == "csv":
            return aiperf.import_export(path, content.text, "csv")
        if content.kind == "jsonl" or aiperf.looks_like_record(content.documents[0]):
            return aiperf.import_export(path, content.documents, "jsonl")
        return aiperf.import_export(path, content.documents[0], "json")
    if tool == "genai-perf":
        if content.kind == "csv":
            return genai_perf.import_export(path, content.text, "csv")
        return genai_perf.import_export(path, _one_document(content, path, tool), "json")
    return llmperf.import_results(path, _one_document(content, path, tool))
