"""Where benchmark tables go: ``benchmarks/results/<name>.md``, plain markdown, written by the benchmark itself.

Each file starts with the one command that reproduces it, the date, the commit it ran on (the full id, followed
by "+ uncommitted changes to ..." when files other than results files differed from it, at the start or at the
end), the code it measures (the script and its ``MEASURES``), and the machine (CPU, cores, memory, library
versions, load average at the start, before anything is measured, and at the end: the CI box is shared, so the
spread of repeated runs is part of the result). A benchmark creates its :class:`Report` before it measures
anything. docs/ quote these files; tests/test_docs_figures.py checks that every figure a doc quotes from one
appears in it, and that its commit is an ancestor of HEAD that no later commit to the measured code follows.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1024**2


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed from the repository root: ``python benchmarks/x.py args``."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    try:
        script = script.relative_to(RESULTS.parents[1])
    except ValueError:
        pass
    return "python " + " ".join(shlex.quote(x) for x in [str(script), *argv[1:]])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _mem_total_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return float("nan")


def versions(*extra: str) -> str:
    """The installed versions of the libraries measured, and of ``extra`` distributions: "torch 2.13.0, ..."."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in ("torch", "accelerate", "deepspeed", "diffusers", "transformers", "safetensors", *extra):
        try:
            out.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out)


def git_state(root: Path | None = None, untracked: str = "no") -> tuple[str, list[str]]:
    """(HEAD, the files that differ from it: changed ones, and untracked ones as git's
    ``--untracked-files=<untracked>`` lists them) of the checkout at ``root`` (this repository by default).
    Results files are rewritten during a run (after each measurement): only other files count. Raises OSError /
    CalledProcessError outside a checkout."""
    import subprocess

    root = RESULTS.parents[1] if root is None else root
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()
    status = subprocess.run(
        ["git", "status", "--porcelain", f"--untracked-files={untracked}", "--", ".", ":(exclude)benchmarks/results"],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout
    return sha, [line[3:] for line in status.splitlines() if line.strip()]  # "XY path": two status letters


def git_commit() -> str:
    """The commit the benchmark ran on, "+ uncommitted changes to <files>" when the tree differs from it
    (named, so a reader can tell a docs edit from a change to the code measured)."""
    import subprocess

    try:
        sha, paths = git_state()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    if not paths:
        return sha
    more = f" and {len(paths) - 5} more" if len(paths) > 5 else ""
    return sha + " + uncommitted changes to " + ", ".join(paths[:5]) + more


def load_average() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def measured_paths(script: str | Path, measures: Sequence[str]) -> list[str]:
    """The repository paths a benchmark measures: the script itself, then its ``MEASURES`` (files, or folders
    ending in "/"). Raises ValueError for a path that does not exist, so a typo cannot hide a change."""
    root = RESULTS.parents[1]
    script = Path(script).resolve()
    try:
        first = script.relative_to(root).as_posix()
    except ValueError:
        first = script.name
    missing = [p for p in measures if not (root / p).exists()]
    if missing:
        raise ValueError(f"MEASURES names paths that do not exist: {missing}")
    return [first, *measures]


class Report:
    """Collects a benchmark's tables and writes them, with how they were made, to results/<name>.md.

    Create it before measuring anything: it reads the load average and the commit when created (the
    "start" figures of the header), and again whenever it renders (the "end" ones). ``measures`` is the
    script's ``MEASURES``: the code whose later change makes the results stale."""

    def __init__(self, name: str, title: str, measures: Sequence[str], argv: list[str] | None = None):
        self.load_before = load_average()  # first: nothing of this run has loaded the machine yet
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.commit_before = git_commit()
        self.name, self.title = name, title
        self.command = command_line(argv)
        self.measures = measured_paths((sys.argv if argv is None else argv)[0], measures)
        self.parts: list[str] = []

    @property
    def commit(self) -> str:
        """The commit at the start, or both when HEAD or the tree changed while the benchmark ran."""
        now = git_commit()
        if now == self.commit_before:
            return now
        return f"{self.commit_before} at the start; {now} at the end"

    def table(self, header: list[str], rows: list[list[str]], caption: str = "") -> None:
        lines = ([caption, ""] if caption else []) + [
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" for _ in header) + "|",
        ]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.parts.append("\n".join(lines))

    def text(self, text: str) -> None:
        self.parts.append(text.strip("\n"))

    def render(self) -> str:
        head = [
            f"# {self.title}",
            "",
            f"Reproduce: `{self.command}`",
            "",
            f"- Date: {self.started:%Y-%m-%d %H:%M} UTC",
            f"- Commit: {self.commit}",
            f"- Measures: {', '.join(self.measures)} (a later commit to any of them makes this file stale)",
            f"- Machine: {_cpu_model()}, {os.cpu_count()} cores, {_mem_total_gib():.1f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}; {versions()}",
            f"- Load average (1/5/15 min) at the start, before measuring, {self.load_before}; at the end "
            f"{load_average()}: the machine was shared with other jobs, so timings carry their spread",
            "",
        ]
        return "\n".join(head + ["\n\n".join(self.parts), ""])

    def write(self) -> Path:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"{self.name}.md"
        tmp = path.with_suffix(".md.partial")
        tmp.write_text(self.render())
        tmp.replace(path)
        print(f"\nwrote {path}")
        return path


def mb(nbytes: float, digits: int = 0) -> str:
    return f"{nbytes / MB:,.{digits}f} MB"


def median_spread(values: list[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    """``median (min-max)``: the spread of repeated runs on a shared machine."""
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med) + unit
    return f"{fmt.format(med)}{unit} ({fmt.format(min(values))}-{fmt.format(max(values))})"
