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

Every results file is current (slow: it asks git): the script that wrote it declares the code it measures
(``MEASURES``, a module-level tuple of repository paths; the script itself counts too), and the file's
``- Commit:`` line — written by the script, a full commit id with no uncommitted changes — names a
commit that is an ancestor of HEAD and that no later commit to the measured code follows (``git
merge-base --is-ancestor``, ``git log -1 --format=%H -- <paths>``). A file that fails names the command
that re-runs it (its ``Reproduce:`` line).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
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


# -- every results file ran on the code it measures ------------------------------------------------------------------
RESULTS_DIR = REPO / "benchmarks" / "results"
COMMIT_LINE = re.compile(r"^- Commit: (.*)$", re.M)
WRITER = re.compile(r"(?<![\w/])((?:benchmarks|tools)/[\w-]+\.py)\b")
#: the writers of results files that are not benchmarks/*.py
TOOLS = ("tools/compatibility.py", "tools/upstream_equivalence.py")


def writer_of(results_file: Path, repo: Path = REPO) -> str | None:
    """The script that writes ``results_file``: the first script its header names (``Reproduce: `python
    benchmarks/x.py ...```), else the benchmark or tool named like the file."""
    head = results_file.read_text().split("\n- Commit:", 1)[0]
    m = WRITER.search(head)
    if m:
        return m.group(1)
    for candidate in (f"benchmarks/{results_file.stem}.py", f"tools/{results_file.stem}.py"):
        if (repo / candidate).is_file():
            return candidate
    return None


def declared_measures(script: Path) -> list[str] | None:
    """The script's module-level ``MEASURES`` (read, not imported: benchmarks import torch), or None."""
    for node in ast.parse(script.read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "MEASURES" for t in targets) and node.value is not None:
            return list(ast.literal_eval(node.value))
    return None


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def _clean_stamp(rest: str) -> bool:
    """What follows the commit id: nothing, or a note in parentheses that admits no uncommitted change and
    is not a commit recorded by hand afterwards."""
    if not rest:
        return True
    return rest.startswith(" (") and rest.endswith(")") and not re.search(r"\+|uncommitted|afterwards|history", rest)


def results_problems(results_file: Path, repo: Path = REPO) -> list[str]:
    """Why ``results_file`` does not show what the code at HEAD measures (nothing when it does)."""
    writer = writer_of(results_file, repo)
    if writer is None or not (repo / writer).is_file():
        return [f"no script writes it (its header names none, and there is no benchmarks/{results_file.stem}.py)"]
    measures = declared_measures(repo / writer)
    if measures is None:
        return [f"{writer} declares no MEASURES (the paths of the code it measures)"]
    missing = [p for p in measures if not (repo / p).exists()]
    if missing:
        return [f"{writer}'s MEASURES names paths that do not exist: {missing}"]
    paths = [writer, *measures]
    m = COMMIT_LINE.search(results_file.read_text())
    if m is None:
        return ["it has no '- Commit:' line"]
    stamp = re.match(r"([0-9a-f]{40})\b(.*)$", m.group(1).strip())
    if stamp is None:
        return [f"its commit line is not a full commit id as its script writes it: {m.group(0)!r}"]
    sha, rest = stamp.groups()
    if not _clean_stamp(rest):
        return [f"it ran on uncommitted code, or its commit was recorded by hand: {m.group(0)!r}"]
    if _git(repo, "cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
        return [f"its commit {sha[:10]} is not in this repository"]
    if _git(repo, "merge-base", "--is-ancestor", sha, "HEAD").returncode != 0:
        return [f"its commit {sha[:10]} is not an ancestor of HEAD"]
    last = _git(repo, "log", "-1", "--format=%H", "--", *paths).stdout.strip()
    later = _git(repo, "rev-list", f"{sha}..HEAD", "--", *paths).stdout.split()  # a merged branch's older commits too
    if (last and _git(repo, "merge-base", "--is-ancestor", last, sha).returncode != 0) or later:
        newest = _git(repo, "log", "-1", "--format=%h %ad %s", "--date=short", later[0] if later else last)
        return [
            f"stale: it ran on {sha[:10]}, and {len(later)} later commit(s) changed what it measures "
            f"({', '.join(paths)}), the newest {newest.stdout.strip()[:110]}"
        ]
    return []


def _in_git_checkout(repo: Path) -> bool:
    if shutil.which("git") is None:
        return False
    return _git(repo, "rev-parse", "--is-inside-work-tree").stdout.strip() == "true"


def _reproduce(results_file: Path) -> str:
    m = re.search(r"^Reproduce: `([^`]+)`", results_file.read_text(), re.M)
    return m.group(1) if m else f"python {writer_of(results_file) or '?'}"


def test_every_results_writer_declares_the_code_it_measures():
    """Fast: every benchmark and tool that writes a results file names the existing paths it measures."""
    scripts = sorted(p for p in (REPO / "benchmarks").glob("[!_]*.py")) + [REPO / t for t in TOOLS]
    undeclared = [p.relative_to(REPO).as_posix() for p in scripts if not declared_measures(p)]
    assert not undeclared, f"scripts without a MEASURES tuple of the paths they measure: {undeclared}"
    missing = {
        p.relative_to(REPO).as_posix(): [m for m in declared_measures(p) if not (REPO / m).exists()] for p in scripts
    }
    assert not any(missing.values()), f"MEASURES naming paths that do not exist: {missing}"
    unwritten = [p.name for p in RESULTS_DIR.glob("*.md") if writer_of(p) is None]
    assert not unwritten, f"results files no script writes: {unwritten}"


#: results files known not to show the code at HEAD, each with why its re-run is pending: "<file name>: <why>"
#: lines. Listed, a file must be stale (else the line goes); unlisted, it must be current.
PENDING_RERUNS = REPO / "benchmarks" / "pending_reruns.txt"


def pending_reruns(path: Path = PENDING_RERUNS) -> dict[str, str]:
    lines = [ln.strip() for ln in path.read_text().splitlines()] if path.is_file() else []
    entries = [ln.split(":", 1) for ln in lines if ln and not ln.startswith("#")]
    bad = [":".join(e) for e in entries if len(e) != 2 or not e[1].strip()]
    assert not bad, f"{path.name}: lines must read '<results file>: <why its re-run is pending>': {bad}"
    return {name.strip(): why.strip() for name, why in entries}


def test_pending_reruns_name_results_files_with_a_reason():
    pending = pending_reruns()
    unknown = sorted(set(pending) - {p.name for p in RESULTS_DIR.glob("*.md")})
    assert not unknown, f"{PENDING_RERUNS.name} names results files that do not exist: {unknown}"


@pytest.mark.slow
@pytest.mark.parametrize("results_file", sorted(RESULTS_DIR.glob("*.md")), ids=lambda p: p.name)
def test_results_file_ran_on_the_code_it_measures(results_file):
    """STALE results files fail here, one test each: re-run the command the message names on a clean
    checkout of HEAD (an idle machine for timings) and commit the file it writes — or, while the re-run is
    pending, list the file in benchmarks/pending_reruns.txt with why."""
    if not _in_git_checkout(REPO):
        pytest.skip("not a git checkout: which commit a results file ran on cannot be checked")
    problems = results_problems(results_file)
    shallow = _git(REPO, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    if shallow and problems and "not in this repository" in problems[0]:
        pytest.skip(f"a shallow clone: {problems[0]}")
    pending = pending_reruns()
    if results_file.name in pending:
        assert problems, f"{results_file.name} is current: remove its line from {PENDING_RERUNS.name}"
        return
    assert not problems, (
        f"STALE RESULTS {results_file.relative_to(REPO)}: {'; '.join(problems)}. "
        f"Re-run on a clean checkout of HEAD: {_reproduce(results_file)}"
    )


@pytest.mark.slow
def test_the_results_check_fails_a_file_older_than_its_measured_code(tmp_path):
    """The checker itself, in a scratch repository: current after a change elsewhere; stale after a change to
    the measured code or to the script; failing for a dirty or hand-written stamp and a commit not on HEAD."""
    repo = tmp_path

    def git(*args: str) -> str:
        proc = _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def commit(message: str, files: dict[str, str]) -> str:
        for name, text in files.items():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_text(text)
        git("add", "-A")
        git("commit", "-qm", message)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    ran_on = commit("code", {"benchmarks/bench.py": "MEASURES = ('src/',)\n", "src/mod.py": "a = 1\n", "notes": "x\n"})
    results = repo / "benchmarks" / "results" / "bench.md"

    def stamp(line: str) -> list[str]:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(f"# t\n\nReproduce: `python benchmarks/bench.py`\n\n- Commit: {line}\n")
        return results_problems(results, repo)

    assert stamp(ran_on) == []
    commit("results", {"benchmarks/results/bench.md": results.read_text()})
    commit("a change the benchmark does not measure", {"notes": "y\n"})
    assert stamp(ran_on) == []
    assert "uncommitted" in stamp(f"{ran_on} + uncommitted changes to src/mod.py")[0]
    assert "by hand" in stamp(f"{ran_on} (recorded afterwards: the commit before)")[0]
    assert "full commit id" in stamp(ran_on[:7])[0]

    changed = commit("the measured code changes", {"src/mod.py": "a = 2\n"})
    (problem,) = stamp(ran_on)
    assert problem.startswith(f"stale: it ran on {ran_on[:10]}, and 1 later commit(s)") and changed[:7] in problem
    assert stamp(changed) == []
    commit("the benchmark itself changes", {"benchmarks/bench.py": "MEASURES = ('src/',)\nROUNDS = 2\n"})
    assert stamp(changed)[0].startswith("stale:")

    head = git("rev-parse", "HEAD")
    git("checkout", "-qb", "elsewhere")
    aside = commit("not on the main line", {"notes": "z\n"})
    git("checkout", "-q", head)
    assert "not an ancestor of HEAD" in stamp(aside)[0]
    assert "not in this repository" in stamp("f" * 40)[0]
    (repo / "benchmarks" / "bench.py").write_text("ROUNDS = 2\n")
    assert "declares no MEASURES" in stamp(head)[0]


def test_a_pending_rerun_line_without_a_reason_is_refused(tmp_path):
    ledger = tmp_path / "pending_reruns.txt"
    ledger.write_text("# comment\nhang_watch.md: re-run pending\n")
    assert pending_reruns(ledger) == {"hang_watch.md": "re-run pending"}
    ledger.write_text("hang_watch.md\n")
    with pytest.raises(AssertionError, match="lines must read"):
        pending_reruns(ledger)
