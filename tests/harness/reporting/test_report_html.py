"""report.html from its jinja2 template: hostile text in a title, heading, paragraph, note,
table cell or caption is escaped, never markup, and the page keeps its tables and figures."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from harness.reporting.report import Document

HOSTILE = '<script>alert("x")</script>'


def page(tmp_path: Path) -> str:
    doc = Document(tmp_path)
    doc.heading(f"run {HOSTILE}", level=1)
    doc.text(f"made by `inferlab report` & {HOSTILE} in `a<b`")
    doc.heading("Variants")
    doc.note(f"needs `samples.parquet` {HOSTILE}")
    doc.table(
        pd.DataFrame({"variant": [f"engine.name={HOSTILE}", "x&y"], HOSTILE: [1.5, float("nan")]})
    )
    fig = Figure()
    fig.add_subplot().plot([0, 1], [0, 1])
    doc.figure(fig, "latency_cdf", f"CDF {HOSTILE}")
    return doc.html(f"title {HOSTILE}")


def test_hostile_text_is_escaped_everywhere(tmp_path: Path) -> None:
    html = page(tmp_path)
    assert "<script" not in html
    escaped = "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;"
    # title, h1, paragraph, note, cell, column name, img alt and caption: 8 places
    assert html.count(escaped) == 8
    assert f"<title>title {escaped}</title>" in html
    assert f'<img alt="CDF {escaped}"' in html  # a quote cannot end the attribute
    # the one piece of Markdown the texts use still becomes markup, its content escaped
    assert "<code>inferlab report</code> &amp; " in html
    assert "<code>a&lt;b</code>" in html


def test_the_page_keeps_its_structure(tmp_path: Path) -> None:
    html = page(tmp_path)
    assert html.startswith('<!doctype html>\n<html lang="en">')
    assert html.endswith("</body></html>\n")
    assert "border-collapse: collapse" in html  # the stylesheet
    assert re.search(r"<h1>run [^<]*</h1>\n<p>made by", html)
    assert '<p class="note">needs <code>samples.parquet</code>' in html
    table = re.search(r"<table>.*?</table>", html, re.S)
    assert table is not None
    assert table.group(0).count("<tr>") == 3 and table.group(0).count("<th>") == 2
    assert "<td>1.5</td>" in table.group(0) and "<td>-</td>" in table.group(0)  # NaN shown as -
    png = (tmp_path / "latency_cdf.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert html.count("<figure><img") == 1 and 'src="data:image/png;base64,iVBOR' in html
