"""Every figure the docs quote from a benchmark is in the results file that benchmark wrote, where it was written.

The convention (docs/developing.md, "Figures"): a passage that quotes measurements sits between
``<!-- figures: benchmarks/results/NAME.md -->`` and ``<!-- /figures -->``. Every figure in it — a
number with a unit: MB, GB, GiB, KB, MB/s, s, ms, ×, %, or a loss-like decimal such as 4.7501 or
1.4e-06 — must be in that results file (the file ``python benchmarks/<script>.py`` writes, with its
command, commit, machine and date). A figure in a doc *table* must be in the results table's cell of
the same row and column: a results row whose cell holds the figure, whose cells under the doc's other
column headers hold the doc row's labels, that names the doc row's key (its first cell's first word),
and whose column header is the doc's (or, for a pivoted doc column "N = 2", whose "N" cell is 2). A
figure in prose must be in the file. A figure in a table cell or line that says "estimate" is exempt
(it must give its formula). Outside such blocks, a line that names a benchmark script or results file
carries no figure. Every benchmark script has its results file, and every results file says which
commit it ran on. Fast: reads files, runs no benchmark.
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


def _row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str):
    """(header, rows, line numbers) of every markdown table in ``text``; the other lines are prose."""
    lines, found, in_table = text.splitlines(), [], set()
    for i in range(len(lines) - 1):
        if (
            i in in_table
            or not lines[i].lstrip().startswith("|")
            or not re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1])
        ):
            continue
        j = i + 2
        while j < len(lines) and lines[j].lstrip().startswith("|"):
            j += 1
        found.append((_row(lines[i]), [_row(line) for line in lines[i + 2 : j]]))
        in_table.update(range(i, j))
    prose = "\n".join(line for k, line in enumerate(lines) if k not in in_table)
    return found, prose


def _key(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", "")).strip().lower()


def _first_word(cell: str) -> str:
    words = _key(cell).split(" ")
    return words[0].rstrip(",:") if words else ""


def _same_label(a: str, b: str) -> bool:
    """Equal, or one is the other's leading words: "(b)" labels the row "(b) stock from_pretrained"."""
    short, long = sorted((a, b), key=len)
    return long == short or long.startswith(short + " ")


def _in_cell(fig: str, cell: str) -> bool:
    return appears(fig, normalized(cell))


def placed(fig: str, doc_header: list[str], doc_row: list[str], col: int, results_tables) -> bool:
    """The results file has ``fig`` in the cell of the doc row's row and the doc column's column."""
    labels = {_key(h): _key(c) for h, c in zip(doc_header, doc_row) if not figures(c)}
    row_key = _first_word(doc_row[0]) if doc_row else ""
    column = _key(doc_header[col]) if col < len(doc_header) else ""
    pivot = re.fullmatch(r"([\w ]+?)\s*=\s*(\S+)", column)
    for header, rows in results_tables:
        names = [_key(h) for h in header]
        for row in rows:
            cells = dict(zip(names, (_key(c) for c in row)))
            raw = dict(zip(names, row))
            if row_key and row_key not in {_first_word(c) for c in row}:
                continue
            if not all(_same_label(cells.get(name, value), value) for name, value in labels.items()):
                continue
            if column in raw:
                if _in_cell(fig, raw[column]):
                    return True
            elif pivot and pivot.group(1) in cells:
                if cells[pivot.group(1)] == pivot.group(2) and any(_in_cell(fig, c) for c in row):
                    return True
            elif any(_in_cell(fig, c) for c in row):
                return True
    return False


def misplaced(body: str, results_text: str) -> list[str]:
    """The figures of a figures block that are not where they belong in the results file."""
    results_tables, _ = tables(results_text)
    results = normalized(results_text)
    doc_tables, prose = tables(body)
    bad = [raw for raw, norm in figures(prose) if not appears(norm, results)]
    for header, rows in doc_tables:
        for row in rows:
            for col, cell in enumerate(row):
                bad += [raw for raw, norm in figures(cell) if not placed(norm, header, row, col, results_tables)]
    return bad


def test_a_table_figure_must_be_in_the_same_row_and_column_of_the_results():
    results = (
        "| case | N | node peak | load |\n|---|---|---|---|\n| (g) | 2 | 6,195 MB | 24.1 s |\n"
        "| (g) | 3 | 8,338 MB | 32.1 s |\n| (h) | 2 | 5,005 MB | 20.8 s |\n"
    )
    assert misplaced("| case | N = 2 | N = 3 |\n|---|---:|---:|\n| (g) stock | 6,195 MB | 8,338 MB |\n", results) == []
    # the right numbers in the wrong places: another row, another column, a swapped pivot
    assert misplaced("| case | node peak |\n|---|---|\n| (h) | 6,195 MB |\n", results) == ["6,195 MB"]
    assert misplaced("| case | load |\n|---|---|\n| (g) | 6,195 MB |\n", results) == ["6,195 MB"]
    assert misplaced("| case | N = 3 |\n|---|---|\n| (g) | 6,195 MB |\n", results) == ["6,195 MB"]
    assert misplaced("| case | N | node peak |\n|---|---|---|\n| (g) | 3 | 6,195 MB |\n", results) == ["6,195 MB"]
    # prose is held to the file
    assert misplaced("(g) at N = 2 peaks at 6,195 MB; 9,999 MB nowhere", results) == ["9,999 MB"]


@pytest.mark.parametrize("doc,cited,body", _BLOCKS, ids=[f"{d.name}:{Path(c).name}" for d, c, _ in _BLOCKS])
def test_quoted_figures_are_in_the_results_file(doc, cited, body):
    results_file = REPO / cited
    assert results_file.is_file(), f"{doc.name} quotes {cited}, which does not exist (run the benchmark it names)"
    assert figures(body), f"{doc.name}: the figures block citing {cited} quotes no figure"
    missing = misplaced(body, results_file.read_text())
    assert not missing, f"{doc.name}: figures not in their row and column of {cited}: {missing}"


def test_every_benchmark_has_a_results_file_that_names_its_commit():
    scripts = sorted(p.stem for p in (REPO / "benchmarks").glob("[!_]*.py"))
    assert scripts
    results = {p.stem: p for p in (REPO / "benchmarks" / "results").glob("*.md")}
    no_results = [s for s in scripts if not any(name == s or name.startswith(s + "_") for name in results)]
    assert not no_results, f"benchmarks without a results file (run them: python benchmarks/NAME.py): {no_results}"
    no_commit = [p.name for p in results.values() if not re.search(r"^- Commit: [0-9a-f]{7,40}", p.read_text(), re.M)]
    assert not no_commit, f"results files that do not say which commit they ran on: {no_commit}"


def test_every_figures_block_is_closed_and_there_is_at_least_one():
    opened = sum(len(OPEN.findall(d.read_text())) for d in DOCS)
    assert opened == len(list(_blocks())), "a `<!-- figures: ... -->` without its `<!-- /figures -->`"
    assert opened > 0


def test_no_benchmark_figure_outside_a_figures_block():
    bad = []
    for doc in DOCS:
        text = BLOCK.sub("", doc.read_text())
        for line in text.splitlines():
            if re.search(r"(benchmarks/\w+|tools/compatibility)\.(py|md)", line) and figures(line):
                bad.append(f"{doc.name}: {line.strip()[:120]}")
    assert not bad, "benchmark figures outside a `<!-- figures: benchmarks/results/X.md -->` block:\n" + "\n".join(bad)


def _matrix_rows(text: str) -> set[str]:
    """The run rows (✔ / ✘) of the official-scripts matrix table in ``text``."""
    return {line.strip() for line in text.splitlines() if line.startswith("| `") and re.search(r"\| (✔|✘) \|", line)}


def test_compatibility_doc_quotes_every_matrix_row_as_run():
    """docs/compatibility.md quotes tools/compatibility.py's rows verbatim, every one that was run,
    and counts the scripts not run as the results file lists them."""
    results = (REPO / "benchmarks" / "results" / "compatibility.md").read_text()
    blocks = [
        body
        for doc, name, body in _BLOCKS
        if doc.name == "compatibility.md" and name == "benchmarks/results/compatibility.md"
    ]
    assert len(blocks) == 1
    assert _matrix_rows(results) and _matrix_rows(blocks[0]) == _matrix_rows(results)
    not_run = sum(1 for line in results.splitlines() if line.startswith("| `") and "| not run:" in line)
    assert f"{not_run} more scripts" in blocks[0]
