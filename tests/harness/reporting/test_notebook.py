"""notebooks/analysis.ipynb runs top to bottom, headless, on a fresh results folder: with no
results at all it makes a tiny sweep first, then loads and plots it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[3]
NOTEBOOK = REPO / "notebooks" / "analysis.ipynb"
KERNEL = "inferlab-test"


@pytest.fixture
def kernel_of_this_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernelspec running this very interpreter: on a fresh machine the only Python with the
    project installed may be this one, whatever `python3` kernel Jupyter would find first."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "inferlab test",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))  # searched first
    return KERNEL


def test_notebook_runs_on_a_fresh_results_folder(
    tmp_path: Path, kernel_of_this_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    results_root = tmp_path / "results"
    monkeypatch.setenv("INFERLAB_RESULTS_ROOT", str(results_root))
    monkeypatch.delenv("INFERLAB_RESULTS", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name=kernel_of_this_python,
        timeout=240,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error

    sweeps = list((results_root / "sweeps").iterdir())
    assert len(sweeps) == 1 and (sweeps[0] / "sweep.csv").is_file()
    outputs = [
        o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
    ]
    text = "\n".join(
        str(o.get("text", "")) + str((o.get("data") or {}).get("text/plain", "")) for o in outputs
    )
    assert "Results(2 runs, 2 variants)" in text
    assert "engine.kv_cache=none" in text and "engine.kv_cache=contiguous" in text
    # the CDF and the timeline came out as images
    images = [o for o in outputs if "image/png" in (o.get("data") or {})]
    assert len(images) >= 3
    assert (sweeps[0] / "report" / "report.md").is_file()
