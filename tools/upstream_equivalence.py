"""Upstream test suites run twice -- accel-npu active, and stock (ACCEL_NPU_DISABLE=1) -- and compared test by test.

The equivalence claim ("on a plain CPU process accel-npu changes nothing upstream can observe") checked,
not remembered: each half is ``python -m pytest`` in its own subprocess, in an environment that is the
inherited one with every ``ACCEL_NPU_*`` variable removed, ``HF_HUB_OFFLINE=1`` and ``OMP_NUM_THREADS=1``;
the stock half adds ``ACCEL_NPU_DISABLE=1`` and nothing else. This file doubles as the tiny pytest plugin
(``-p upstream_equivalence``, found through PYTHONPATH) that appends every test's outcome -- passed,
failed, skipped, error (setup/teardown and collection errors), xfailed, xpassed -- with the first line of
its failure or skip message (for an exception raised from another, its innermost one too: ``first line
[root cause: Type: message]``) to a JSON-lines file. The two maps are compared by pytest node id: an outcome
that differs, or a test that exists on one side only, is a difference, named with both sides' causes.

    python tools/upstream_equivalence.py --suite diffusers-models --src /tmp/upstream_src/diffusers \\
        [--select tests/models/...] [--suite accelerate --src /tmp/upstream_src/accelerate ...] \\
        --out benchmarks/results/upstream_equivalence.md

``--suite`` and ``--src`` pair up in order (``--select`` applies to the suite before it; without it the
suite's default subset below runs). The markdown and a ``.json`` beside it record the date, /work/main's
commit and whether the tree is dirty (the results files themselves left out), the library versions,
and per suite: tests, identical, differing, and every differing test with its cause on each side.
Exit status 1 when any suite differs.

Upstream's tests need test-only packages beyond the project's ``[test]`` extra:
requirements: parameterized requests-mock
(never the registry's torchvision wheels: they are CUDA builds and break the stock half's imports).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent
#: the code this tool measures besides itself (tests/test_docs_figures.py: a later change makes its results stale)
MEASURES = ("accel_npu/", "plugins/", "_accel_npu_startup.py")
OUTCOMES_ENV = "UPSTREAM_EQUIVALENCE_OUTCOMES"
LIBRARIES = ("torch", "accelerate", "diffusers", "transformers", "deepspeed", "peft", "huggingface_hub", "pytest")


@dataclass(frozen=True)
class Suite:
    library: str
    select: tuple[str, ...]
    #: seconds a half may take before it is stopped (what it recorded until then is kept)
    timeout: int = 3600


#: Subsets chosen to finish in minutes on 2 CPU cores (measured, see benchmarks/results/upstream_equivalence.md).
SUITES = {
    "diffusers-models": Suite(
        "diffusers",
        (
            "tests/models/transformers/test_models_transformer_flux.py",
            "tests/models/transformers/test_models_transformer_qwenimage.py",
            "tests/models/unets/test_models_unet_2d_condition.py",
            "tests/models/autoencoders/test_models_autoencoder_kl.py",
        ),
    ),
    "diffusers-pipelines": Suite(
        "diffusers",
        (
            "tests/pipelines/kolors",
            "tests/pipelines/flux/test_pipeline_flux.py",
            # built from dummy components, no Hub download: their tests run here rather than fail alike offline
            "tests/pipelines/dit",
            "tests/pipelines/ddpm",
            "tests/pipelines/ddim",
        ),
    ),
    "accelerate": Suite(
        "accelerate",
        (
            "tests/test_utils.py",
            "tests/test_accelerator.py",
            "tests/test_big_modeling.py",
            "tests/test_modeling_utils.py",
            "tests/test_hooks.py",
            "tests/test_memory_utils.py",
            "tests/test_data_loader.py",
            "tests/test_kwargs_handlers.py",
            "tests/test_optimizer.py",
            "tests/test_scheduler.py",
            "tests/test_offload.py",
        ),
    ),
    # its standalone modules: the modeling-common tests need files its sdist lacks
    "transformers": Suite(
        "transformers",
        (
            "tests/test_executorch.py",
            "tests/test_image_transforms.py",
            "tests/test_monkey_patching.py",
            "tests/test_tokenizers_backend_mixin.py",
        ),
    ),
}


#: the libraries the suites test (pytest_sessionfinish records where each was imported from)
TESTED_LIBRARIES = tuple(sorted({suite.library for suite in SUITES.values()}))

#: The CI subset: upstream modules per suite, vendored byte for byte under third_party/ (README there). Kolors' tests
#: need the Hub (they fail alike offline) but collecting the module once tripped accel-npu (torch.jit.script);
#: DiT's pipeline tests build their components and run
VENDORED = REPO / "third_party"
CI_SUBSET = {
    "diffusers-models": (
        VENDORED / "diffusers-v0.40.0",
        ("tests/models/transformers/test_models_transformer_flux.py",),
    ),
    "diffusers-pipelines": (
        VENDORED / "diffusers-v0.40.0",
        ("tests/pipelines/kolors/test_kolors.py", "tests/pipelines/dit/test_dit.py"),
    ),
    "accelerate": (VENDORED / "accelerate-v1.15.0", ("tests/test_utils.py",)),
    "transformers": (VENDORED / "transformers-v5.25.0", ("tests/test_monkey_patching.py",)),
}
#: test-only packages upstream's tests import beyond this project's [test] extra
TEST_REQUIREMENTS = ("parameterized", "requests_mock")

# --------------------------------------------------------------------------- the pytest plugin (child side)


def _first_line(text) -> str:
    for line in str(text or "").splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return ""


#: an exception line as pytest prints it: ``[E   ]module.ExceptionName: message`` (or the bare name)
_EXCEPTION_LINE = re.compile(r"^(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Failure))(?::\s|$)")


def _root_cause(longrepr) -> str:
    """The innermost exception of a chained failure (``raise X from e``, or one raised while handling
    another) as its one-line ``Type: message``; "" when there is no chain. pytest prints a chain
    innermost first, so in text form (an ImportError at collection, a CollectErrorRepr) it is the
    first exception line."""
    chain = getattr(longrepr, "chain", None)
    if chain and len(chain) > 1:  # ExceptionChainRepr: [(reprtraceback, reprcrash, descr)], innermost first
        reprtraceback, crash, _ = chain[0]
        if crash is not None and crash.message:
            return _first_line(crash.message)
        entries = getattr(reprtraceback, "reprentries", None) or []
        lines = getattr(entries[-1], "lines", []) if entries else []
        errors = [line[1:].strip() for line in lines if line.startswith("E ")]
        return _first_line(errors[0]) if errors else ""
    if chain is not None:  # a single exception: nothing beneath it
        return ""
    exceptions = _chained_text_exceptions(str(longrepr))
    return exceptions[0] if exceptions else ""


def _chained_text_exceptions(text: str) -> list[str]:
    """The exception lines (``E   Type: message``, innermost first) of a chain pytest printed as text;
    [] when the text holds no chain."""
    if "The above exception was the direct cause" not in text and "During handling of the above exception" not in text:
        return []
    return [
        _first_line(line[1:]) for line in text.splitlines() if line.startswith("E ") and _EXCEPTION_LINE.match(line)
    ]


def _message(report) -> str:
    """One line: a skip's reason; a failure's or error's first line, and when the exception was raised
    from another (a lazy import wrapping the real ImportError, say) `` [root cause: <innermost>]``."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, lineno, reason)
        return _first_line(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and crash.message:
        first = _first_line(crash.message)
    else:
        text = str(longrepr)
        errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
        chained = _chained_text_exceptions(text)
        # a chain printed as text starts innermost: its first line is the outermost exception's
        first = chained[-1] if len(chained) > 1 else _first_line(errors[0] if errors else text)
    if report.skipped:
        return first
    root = _root_cause(longrepr)
    if root and root != first and root not in first:
        return f"{first} [root cause: {root}]"
    return first


def _record(row: dict) -> None:
    path = os.environ.get(OUTCOMES_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")


def pytest_sessionfinish(session):
    """Which file each library the suites test was imported from (the report names it: a source tree's copy first
    on sys.path would be tested instead of the installed one)."""
    _record({"imported": {lib: getattr(sys.modules.get(lib), "__file__", None) for lib in TESTED_LIBRARIES}})


def pytest_collectreport(report):
    if report.failed:
        _record({"id": report.nodeid or ".", "phase": "collect", "outcome": "error", "message": _message(report)})
    elif report.skipped:
        _record({"id": report.nodeid or ".", "phase": "collect", "outcome": "skipped", "message": _message(report)})


def pytest_runtest_logreport(report):
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
        _record(
            {"id": report.nodeid, "phase": report.when, "outcome": outcome, "message": _first_line(report.wasxfail)}
        )
        return
    if report.when == "call" or report.failed or report.skipped:
        outcome = report.outcome
        if report.failed and report.when != "call":
            outcome = "error"
        _record({"id": report.nodeid, "phase": report.when, "outcome": outcome, "message": _message(report)})


# --------------------------------------------------------------------------- reading and comparing (parent side)

_RANK = {"error": 4, "failed": 3, "xpassed": 2, "xfailed": 2, "skipped": 1, "passed": 0}


def read_outcomes(path: Path) -> dict[str, dict]:
    """{node id: {"outcome", "message"}} from the plugin's JSON lines: per test the worst phase wins
    (a teardown error after a passed call is an error), the first message of that outcome kept."""
    outcomes: dict[str, dict] = {}
    if not path.exists():
        return outcomes
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "id" not in row:  # pytest_sessionfinish's witness (read_imported)
            continue
        old = outcomes.get(row["id"])
        if old is None or _RANK[row["outcome"]] > _RANK[old["outcome"]]:
            outcomes[row["id"]] = {"outcome": row["outcome"], "message": row.get("message", "")}
    return outcomes


def read_imported(path: Path) -> dict[str, str | None]:
    """{library: the file its tests imported it from} (pytest_sessionfinish); {} when the run recorded none."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return next((row["imported"] for row in reversed(rows) if "imported" in row), {})


_VOLATILE = re.compile(r"0x[0-9a-fA-F]+|/tmp/[^\s'\"]+|\d+\.\d+s\b")


def compare(stock: dict[str, dict], accel: dict[str, dict]) -> dict:
    """Test by test: ``differing`` holds every id whose outcome differs, or that one side lacks
    (outcome ``absent``); ``same_outcome_other_cause`` the ids failing/erroring on both sides with
    different first lines (addresses and temp paths ignored) -- reported, not counted as differing."""
    ids = sorted(set(stock) | set(accel))
    missing = {"outcome": "absent", "message": "not collected on this side"}
    differing, other_cause, identical = [], [], 0
    for test_id in ids:
        s, a = stock.get(test_id, missing), accel.get(test_id, missing)
        row = {
            "id": test_id,
            "stock": s["outcome"],
            "accel": a["outcome"],
            "stock_message": s["message"],
            "accel_message": a["message"],
        }
        if s["outcome"] != a["outcome"]:
            differing.append(row)
            continue
        identical += 1
        if s["outcome"] in ("failed", "error") and _VOLATILE.sub("*", s["message"]) != _VOLATILE.sub("*", a["message"]):
            other_cause.append(row)
    return {"tests": len(ids), "identical": identical, "differing": differing, "same_outcome_other_cause": other_cause}


def counts(outcomes: dict[str, dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in outcomes.values():
        out[value["outcome"]] = out.get(value["outcome"], 0) + 1
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- running the halves


def child_env(stock: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The inherited environment less every ACCEL_NPU_* variable, offline and single-threaded;
    the stock half differs only by ACCEL_NPU_DISABLE=1."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("ACCEL_NPU_")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop(OUTCOMES_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([str(TOOLS), *filter(None, [env.get("PYTHONPATH")])])
    if stock:
        env["ACCEL_NPU_DISABLE"] = "1"
    return env


@dataclass
class Half:
    outcomes: dict[str, dict] = field(default_factory=dict)
    seconds: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    tail: str = ""
    imported: dict = field(default_factory=dict)


def run_half(
    src: Path, select: list[str], stock: bool, timeout: int, workers: int = 0, extra: list[str] | None = None
) -> Half:
    """One pytest run of ``select`` (paths relative to ``src``) in ``src``: rootdir and confcutdir are
    ``src`` (no conftest above it is loaded), upstream's own pytest config applies."""
    with tempfile.TemporaryDirectory(prefix="upstream_equivalence_") as tmp:
        outcomes_file = Path(tmp) / "outcomes.jsonl"
        env = child_env(stock)
        env[OUTCOMES_ENV] = str(outcomes_file)
        # -c os.devnull: upstream's tests under upstream's conftest only, not this repository's setup.cfg (found
        # above the vendored tree), whose --strict-markers refuses the markers upstream leaves unregistered
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *select,
            "-p",
            "upstream_equivalence",
            "-p",
            "no:cacheprovider",
            "-c",
            os.devnull,
            f"--rootdir={src}",
            f"--confcutdir={src}",
            "-q",
            "-rN",
            "--timeout=900",
            "--continue-on-collection-errors",
            *(["-n", str(workers)] if workers else ["-p", "no:xdist"]),
            *(extra or []),
        ]
        start = time.monotonic()
        half = Half()
        try:
            proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=timeout)
            half.returncode, half.tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired as exc:
            half.timed_out = True
            half.tail = (
                str(exc.stdout or "")[-4000:] if not isinstance(exc.stdout, bytes) else exc.stdout.decode()[-4000:]
            )
        half.seconds = time.monotonic() - start
        half.outcomes = read_outcomes(outcomes_file)
        half.imported = read_imported(outcomes_file)
    if not half.outcomes:  # pytest stopped before any test (usage error, crash at startup): say so
        half.outcomes = {
            "<session>": {
                "outcome": "error",
                "message": f"no outcomes recorded, rc={half.returncode}: "
                f"{_first_line(half.tail.strip().splitlines()[-1] if half.tail.strip() else '')}",
            }
        }
    return half


@contextlib.contextmanager
def tests_against_the_installed(src: Path, library: str):
    """Where to run ``src``'s tests so they import the installed ``library``: ``src`` itself, or, where it holds
    the library's own source (``src/<library>``: a git checkout or an sdist), a copy of its ``tests/`` alone.
    diffusers' tests/conftest.py puts ``<checkout>/src`` first on sys.path, which would test that source, not the
    installed version the report names."""
    if not (src / "src" / library).is_dir():
        yield src
        return
    with tempfile.TemporaryDirectory(prefix=f"upstream_{library}_tests_") as tmp:
        shutil.copytree(src / "tests", Path(tmp) / "tests", symlinks=True)
        yield Path(tmp)


def run_suite(
    name: str,
    src: Path,
    select: list[str] | None = None,
    workers: int = 0,
    timeout: int | None = None,
    extra: list[str] | None = None,
    log=print,
) -> dict:
    suite = SUITES[name]
    select = list(select or suite.select)
    halves = {}
    with tests_against_the_installed(src, suite.library) as where:
        for side, stock in (("stock", True), ("accel", False)):
            log(f"[{name}] {side} half: pytest {' '.join(select)} (in {where})")
            halves[side] = run_half(where, select, stock, timeout or suite.timeout, workers, extra)
            h = halves[side]
            log(
                f"[{name}] {side} half: {h.seconds:.0f} s, rc={h.returncode}{' TIMED OUT' if h.timed_out else ''}, "
                f"{counts(h.outcomes)}"
            )
    result = compare(halves["stock"].outcomes, halves["accel"].outcomes)
    result.update(
        suite=name,
        library=suite.library,
        src=str(src),
        select=select,
        halves={
            side: {
                "seconds": round(h.seconds, 1),
                "returncode": h.returncode,
                "timed_out": h.timed_out,
                "counts": counts(h.outcomes),
                "imported": h.imported,
                # every test that did not pass, with its cause (the .json keeps them)
                "not_passed": {k: v for k, v in sorted(h.outcomes.items()) if v["outcome"] != "passed"},
            }
            for side, h in halves.items()
        },
    )
    return result


# --------------------------------------------------------------------------- the report


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for lib in LIBRARIES:
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            out[lib] = "not installed"
    return out


def git_state(outputs: list[Path]) -> dict:
    """HEAD and the files that differ from it (untracked ones too), as the benchmarks stamp theirs
    (benchmarks/_results.py: results files are rewritten by the runs that measure, so only other files count), less
    ``outputs``; no commit and a clean tree outside a checkout."""
    from benchmarks._results import git_state as tree_state  # main() put the repository on sys.path

    rel = {p.resolve().relative_to(REPO).as_posix() for p in outputs if p.resolve().is_relative_to(REPO)}
    try:
        sha, changed = tree_state(REPO, untracked="normal")
    except (OSError, subprocess.CalledProcessError):
        sha, changed = "", []
    dirty = [path for path in changed if path.strip() not in rel]
    return {"commit": sha, "dirty": bool(dirty), "dirty_paths": dirty}


def _cell(text: str) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ") or "—"


def markdown(report: dict) -> str:
    g = report["git"]
    lines = [
        "# Upstream test suites: accel-npu active vs stock (ACCEL_NPU_DISABLE=1)",
        "",
        f"Generated by `tools/upstream_equivalence.py` on {report['date']}.",
        "",
        *([f"Reproduce: `{report['command']}`", ""] if report.get("command") else []),
        *(
            [
                f"- at the start: commit `{report['git_start']['commit']}`, working tree "
                + ("dirty" if report["git_start"]["dirty"] else "clean")
                + " (it changed while the suites ran)"
            ]
            if report.get("git_start") and report["git_start"] != g
            else []
        ),
        f"- Commit: {g['commit']} (at the end)",
        "- accel-npu working tree at the end "
        + (
            f"**dirty** ({len(g['dirty_paths'])} paths: {', '.join(f'`{p}`' for p in g['dirty_paths'][:20])}"
            f"{' …' if len(g['dirty_paths']) > 20 else ''})"
            if g["dirty"]
            else "clean"
        ),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "- each half: `python -m pytest <select> -p upstream_equivalence -c /dev/null --rootdir=<src> "
        "--confcutdir=<src>` in "
        "the inherited environment less every `ACCEL_NPU_*`, with `HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1`; the "
        "stock half adds `ACCEL_NPU_DISABLE=1`",
        "",
    ]
    if report.get("notes"):
        lines += ["## Notes", "", *[f"- {n}" for n in report["notes"]], ""]
    lines += [
        "## Summary",
        "",
        "| suite | source | tests | identical | differing | stock s | accel s | stock outcomes | accel outcomes |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for s in report["suites"]:
        h = s["halves"]
        lines.append(
            f"| {s['suite']} | `{s['src']}` | {s['tests']} | {s['identical']} | {len(s['differing'])} | "
            f"{h['stock']['seconds']:.0f}{' (timed out)' if h['stock']['timed_out'] else ''} | "
            f"{h['accel']['seconds']:.0f}{' (timed out)' if h['accel']['timed_out'] else ''} | "
            f"{_cell(json.dumps(h['stock']['counts']))} | {_cell(json.dumps(h['accel']['counts']))} |"
        )
    for s in report["suites"]:
        lines += ["", f"## {s['suite']}", "", "Selected: " + ", ".join(f"`{p}`" for p in s["select"]), ""]
        imported = {side: half.get("imported", {}).get(s["library"]) for side, half in s["halves"].items()}
        lines += ["Imported: " + "; ".join(f"{side} `{where}`" for side, where in imported.items()), ""]
        if not s["differing"]:
            lines.append("No test differs.")
        else:
            lines += [
                f"{len(s['differing'])} differing:",
                "",
                "| test | stock | accel | stock cause | accel cause |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| `{d['id']}` | {d['stock']} | {d['accel']} | {_cell(d['stock_message'])} | "
                f"{_cell(d['accel_message'])} |"
                for d in s["differing"]
            ]
        if s["same_outcome_other_cause"]:
            lines += [
                "",
                f"Same outcome, different first line ({len(s['same_outcome_other_cause'])}; not counted as differing):",
                "",
                "| test | outcome | stock cause | accel cause |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| `{d['id']}` | {d['stock']} | {_cell(d['stock_message'])} | {_cell(d['accel_message'])} |"
                for d in s["same_outcome_other_cause"]
            ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    # the benchmarks' stamp helpers (benchmarks/_results.py); not at import: upstream's tests load this module as a
    # pytest plugin, where the repository's own tests/ package must not shadow theirs
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks._results import command_line

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", action="append", choices=sorted(SUITES), required=True)
    p.add_argument(
        "--src",
        action="append",
        type=Path,
        required=True,
        help="the upstream source tree holding tests/ (one per --suite, in order)",
    )
    p.add_argument(
        "--select",
        action="append",
        default=None,
        nargs="+",
        help="test paths/ids relative to --src, for the suite given last before it",
    )
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "upstream_equivalence.md")
    p.add_argument("--workers", type=int, default=0, help="pytest-xdist workers per half (0: none)")
    p.add_argument("--timeout", type=int, default=None, help="seconds per half (default: the suite's)")
    p.add_argument("--note", action="append", default=[], help="a line for the report's Notes")
    args = p.parse_args(argv)
    if len(args.src) != len(args.suite):
        p.error("give one --src per --suite")
    # --select belongs to the --suite before it: re-read argv to pair them
    selects: dict[int, list[str]] = {}
    raw, index = list(sys.argv[1:] if argv is None else argv), -1
    for i, tok in enumerate(raw):
        if tok == "--suite":
            index += 1
        elif tok == "--select":
            j = i + 1
            while j < len(raw) and not raw[j].startswith("--"):
                selects.setdefault(index, []).append(raw[j])
                j += 1
    out = args.out.resolve()
    out_json = out.with_suffix(".json")
    git_start = git_state([out, out_json])  # the tree may change while the suites run: both ends recorded
    results = [
        run_suite(name, src.resolve(), selects.get(i), args.workers, args.timeout)
        for i, (name, src) in enumerate(zip(args.suite, args.src))
    ]
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line([__file__, *raw]),
        "git_start": git_start,
        "git": git_state([out, out_json]),
        "versions": versions(),
        "notes": args.note,
        "suites": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(report))
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    differing = sum(len(s["differing"]) for s in results)
    print(f"{out}: {differing} differing test(s) in {len(results)} suite(s)")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
