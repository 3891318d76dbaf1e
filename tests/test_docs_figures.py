"""Every figure the docs quote from a benchmark is in the results file that benchmark wrote.

The convention (docs/developing.md, "Figures"): a passage that quotes measurements sits between
``<!-- figures: benchmarks/results/NAME.md -->`` and ``<!-- /figures -->``. Every figure in it — a
number with a unit: MB, GB, GiB, KB, MB/s, s, ms, ×, %, or a loss-like decimal such as 4.7501 or
1.4e-06 — must appear in that results file (the
file ``python benchmarks/<script>.py`` writes, with its command, machine and date). A figure in a
table cell or line that says "estimate" is exempt (it must give its formula). Outside such
blocks, a line that names a benchmark script or results file carries no figure: measurements are
quoted only from results files. Fast: reads files, runs no benchmark.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]

BLOCK = re.compile(r"<!-- figures: (benchmarks/results/[\w.-]+\.md) -->(.*?)<!-- /figures -->", re.S)
OPEN = re.compile(r"<!-- figures: benchmarks/results/[\w.-]+\.md -->")
FIGURE = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?\s?(MB/s|MB|GB|GiB|KB|ms|s|×|%)(?![\w/])")
# unitless measurements: a loss (4.7501) or a difference (1.4e-06)
PLAIN = re.compile(r"(?<![\w.,])(\d+\.\d+e-\d+|\d+\.\d{3,})(?![\w.])(?!\s?(MB/s|MB|GB|GiB|KB|ms|s|×|%)(?![\w/]))")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_X = re.compile(r"(?<=\d) ?x(?![\w])")  # "1.03 x model" in plain-text output = "1.03×"


def _norm_number(whole: str, frac: str | None) -> str:
    return whole.replace(",", "") + (frac or "")


def figures(text: str) -> list[tuple[str, str]]:
    """(as written, normalized) for every figure in ``text`` outside cells/lines saying "estimate"."""
    out = []
    for line in text.splitlines():
        cells = line.split("|") if line.lstrip().startswith("|") else [line]
        for cell in cells:
            if "estimat" in cell.lower():
                continue
            for m in FIGURE.finditer(cell):
                out.append((m.group(0), _norm_number(m.group(1), m.group(2)) + m.group(3)))
            out += [(m.group(0), m.group(0)) for m in PLAIN.finditer(cell)]
    return out


def normalized(results: str) -> str:
    text = _THOUSANDS.sub("", results)
    text = _X.sub("×", text)
    return re.sub(r"(?<=\d) (?=(MB/s|MB|GB|GiB|KB|ms|s|×|%)(?![\w/]))", "", text)


def appears(fig: str, results_norm: str) -> bool:
    return re.search(r"(?<![\d.])" + re.escape(fig) + r"(?![\w/])", results_norm) is not None


def _blocks():
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            yield doc, m.group(1), m.group(2)


def test_the_convention_finds_figures_and_rejects_a_changed_one():
    """The checker itself: it sees figures, normalizes both sides alike, and a changed digit fails."""
    results = normalized("| (c) | 1 | 1,172 MB | 0.81× | 975 MB/s | 14.22 s | 1.03 x model |")
    found = [n for _, n in figures("(c) peaks at 1,172 MB (0.81×, 975 MB/s, 14.22 s, 1.03 ×)")]
    assert found == ["1172MB", "0.81×", "975MB/s", "14.22s", "1.03×"]
    assert all(appears(f, results) for f in found)
    assert not appears("1173MB", results) and not appears("0.8×", results) and not appears("72MB", results)
    assert [n for _, n in figures("mean 1.4e-06; step 10 loss 4.7501 (accelerate 1.15)")] == ["1.4e-06", "4.7501"]
    assert [n for _, n in figures("took 2.016 s")] == ["2.016s"]
    assert figures("| (a) | not run: ~26.2 GiB (estimate: 2 × N=1) |") == []


_BLOCKS = list(_blocks())


@pytest.mark.parametrize("doc,cited,body", _BLOCKS, ids=[f"{d.name}:{Path(c).name}" for d, c, _ in _BLOCKS])
def test_quoted_figures_are_in_the_results_file(doc, cited, body):
    results_file = REPO / cited
    assert results_file.is_file(), f"{doc.name} quotes {cited}, which does not exist (run the benchmark it names)"
    results = normalized(results_file.read_text())
    figs = figures(body)
    assert figs, f"{doc.name}: the figures block citing {cited} quotes no figure"
    missing = [raw for raw, norm in figs if not appears(norm, results)]
    assert not missing, f"{doc.name}: figures not in {cited}: {missing}"


def test_every_figures_block_is_closed_and_there_is_at_least_one():
    opened = sum(len(OPEN.findall(d.read_text())) for d in DOCS)
    assert opened == len(list(_blocks())), "a `<!-- figures: ... -->` without its `<!-- /figures -->`"
    assert opened > 0


def test_no_benchmark_figure_outside_a_figures_block():
    bad = []
    for doc in DOCS:
        text = BLOCK.sub("", doc.read_text())
        for line in text.splitlines():
            if re.search(r"benchmarks/\w+\.(py|md)", line) and figures(line):
                bad.append(f"{doc.name}: {line.strip()[:120]}")
    assert not bad, "benchmark figures outside a `<!-- figures: benchmarks/results/X.md -->` block:\n" + "\n".join(bad)


def _matrix_rows(text: str) -> set[str]:
    """The run rows (✔ / ✘) of the official-scripts matrix table in ``text``."""
    return {line.strip() for line in text.splitlines()
            if line.startswith("| `") and re.search(r"\| (✔|✘) \|", line)}


def test_compatibility_doc_quotes_every_matrix_row_as_run():
    """docs/compatibility.md quotes benchmarks/compatibility.py's rows verbatim, every one that was run,
    and counts the scripts not run as the results file lists them."""
    results = (REPO / "benchmarks" / "results" / "compatibility.md").read_text()
    blocks = [body for doc, name, body in _BLOCKS
              if doc.name == "compatibility.md" and name == "benchmarks/results/compatibility.md"]
    assert len(blocks) == 1
    assert _matrix_rows(results) and _matrix_rows(blocks[0]) == _matrix_rows(results)
    not_run = sum(1 for line in results.splitlines() if line.startswith("| `") and "| not run:" in line)
    assert f"{not_run} more scripts" in blocks[0]
