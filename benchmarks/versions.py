"""The version matrix's helpers: the `accel-npu env` check, the results row, the table.

The matrix itself is ``noxfile.py`` at the repository root (one nox session per version set, each a
fresh venv with a non-editable install); this module is what its sessions call, standard library
plus ``packaging`` only, so it runs in any session's interpreter.

    python benchmarks/versions.py check-env [--env-json FILE] [--range 'torch>=2.5,<2.16' ...]
        Runs ``accel-npu env --json`` (or reads FILE) and fails if any patch is skipped or failed
        while the installed version of its library is inside the range accel-npu declares for it
        (install_requires, its extras, Requires-Python; ``--range`` replaces one library's range,
        for a session that lifts a cap locally). Names every skipped patch either way.
    python benchmarks/versions.py render
        Rewrites benchmarks/results/versions.md from benchmarks/results/versions.json.

``noxfile.py`` appends each session's row to versions.json (:func:`append_row`) and re-renders
versions.md: the latest row of every session, with exact versions, commit, dirty flag and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
JSON_FILE = RESULTS / "versions.json"
MD_FILE = RESULTS / "versions.md"
#: the code the version matrix checks besides this script (tests/test_docs_figures.py: a later change makes
#: versions.md stale)
MEASURES = (
    "accel_npu/",
    "plugins/",
    "_accel_npu_startup.py",
    "setup.py",
    "setup.cfg",
    "pyproject.toml",
    "noxfile.py",
)
# the libraries a row names (importlib.metadata of the session's venv)
DISTS = (
    "torch",
    "accelerate",
    "deepspeed",
    "diffusers",
    "transformers",
    "peft",
    "safetensors",
    "numpy",
    "pluggy",
    "wrapt",
    "filelock",
    "tqdm",
    "packaging",
)
# torch: a pip requirement for torch alone (installed first: pip resolves the rest against it).
# pins: the other libraries; what is not pinned is what pip resolves under the declared ranges.
# lift: {dist: new exclusive cap} applied to the snapshot only (see the module docstring).
# past_machine_cap: torch newer than this machine's pip constraint file allows (see the module docstring).
NEWEST = ["accelerate==1.16.0", "deepspeed==0.19.8", "diffusers==0.42.1", "transformers~=5.25.0", "peft"]
SETS = {
    # every install_requires lower bound together (and the test extra's peft), torch at torch_npu 2.5.1's pair
    "lower": dict(
        torch="torch==2.5.1",
        pins=[
            "accelerate==1.10.1",
            "deepspeed==0.16.9",
            "diffusers==0.35.2",
            "transformers==4.57.6",
            "peft==0.17.0",
            "safetensors==0.4.3",
            "pluggy==1.5.0",
            "wrapt==1.16.0",
            "filelock==3.12.0",
            "tqdm==4.66.3",
            "packaging==23.0",
        ],
    ),
    # torch_npu's pairings (each torch_npu release pairs with exactly one torch)
    # pip's own resolve under torch 2.5.1 picks diffusers 0.42.1 and transformers 5.25, which need torch 2.6
    # without declaring it; the set installs what accel-npu's launch warning says (accel_npu/compat.py)
    "torch_npu_2_5": dict(torch="torch==2.5.1", pins=["diffusers<0.41.0", "transformers<5.0.0"]),
    "torch_npu_2_6": dict(torch="torch==2.6.0", pins=[]),
    "torch_npu_2_7": dict(torch="torch==2.7.1", pins=[]),
    "torch_npu_2_8": dict(torch="torch==2.8.0", pins=[]),
    "torch_npu_2_9": dict(torch="torch==2.9.1", pins=[]),
    "torch_npu_2_10": dict(torch="torch~=2.10.0", pins=[]),
    "torch_npu_2_11": dict(torch="torch~=2.11.0", pins=[]),
    "torch_npu_2_12": dict(torch="torch~=2.12.0", pins=[]),
    "torch_npu_2_13": dict(torch="torch==2.13.0", pins=[]),
    "torch_npu_2_14": dict(torch="torch~=2.14.0", pins=[]),
    # the oldest accelerate and diffusers on the newest torch
    "oldest_libs_newest_torch": dict(
        torch="torch==2.15.0",
        pins=["accelerate==1.10.1", "diffusers==0.35.2"],
        past_machine_cap=True,
        env={"TORCHVISION_VERSION": "0.29.2"},
    ),
    # the ends of the ZeRO-3 dtype patch's stock_correct range (deepspeed<0.19.2) and of its supports range
    "deepspeed_0_19_1": dict(torch="torch==2.13.0", pins=["deepspeed==0.19.1"]),
    "deepspeed_0_19_2": dict(torch="torch==2.13.0", pins=["deepspeed==0.19.2"]),
    # the ends of python_requires (>=3.10): its lowest release on a torch_npu pairing, and the newest Python
    # with the newest releases; nox finds the interpreter on PATH (python3.10, python3.12)
    "python_3_10": dict(python="3.10", torch="torch==2.7.1", pins=[]),
    "python_3_12": dict(
        python="3.12", torch="torch==2.15.0", pins=NEWEST, past_machine_cap=True, env={"TORCHVISION_VERSION": "0.29.2"}
    ),
    # the newest releases
    # torchvision 0.30.0 (torch 2.15's pair) is not on the registry yet: the official scripts' torchvision
    # (tests/torchvision_site.py) is the newest released one, as a user would have it
    "newest": dict(torch="torch==2.15.0", pins=NEWEST, past_machine_cap=True, env={"TORCHVISION_VERSION": "0.29.2"}),
}
CHECKS = ("lifecycle", "env", "gated", "main_job", "examples", "official")
CHECK_TITLES = {
    "lifecycle": "lifecycle + import order",
    "env": "accel-npu env",
    "gated": "version-gated patches",
    "main_job": "README main job",
    "examples": "docs/examples plugin",
    "official": "official scripts",
}


def snapshot(root: Path, dest: Path, lift: dict | None = None) -> None:
    """The working tree's tracked and untracked (not ignored) files under ``root``, copied to ``dest``: what a
    matrix session installs and runs (a non-editable build writes build/ and *.egg-info into its source).
    ``lift``: {dist: new exclusive cap} written into the copy's setup.cfg and ``supports=`` strings."""
    import shutil

    shutil.rmtree(dest, ignore_errors=True)
    files = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for name in filter(None, files):
        if name.startswith((".nox/", ".venv/")):  # never a venv, whatever .gitignore says
            continue
        src = root / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    for dist, cap in (lift or {}).items():
        pattern = re.compile(rf"(?<![\w.-])({re.escape(dist)}>=[\d.]+,<)[\d.]+")
        for path in [dest / "setup.cfg", *(dest / "plugins").rglob("*.py"), *(dest / "accel_npu").rglob("*.py")]:
            text = path.read_text()
            new = pattern.sub(rf"\g<1>{cap}", text)
            if new != text:
                path.write_text(new)


# ------------------------------------------------------------------------------------------------
# check-env
# ------------------------------------------------------------------------------------------------
def declared_ranges(overrides: list[str] = ()) -> dict:
    """{normalized dist name: SpecifierSet} from the installed accel-npu's metadata (install_requires,
    every extra, Requires-Python as "python"), then ``overrides`` ("dist>=a,<b") replacing a dist's."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name

    ranges = {}
    meta = importlib.metadata.metadata("accel-npu")
    for line in importlib.metadata.requires("accel-npu") or []:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        # install_requires first; an extra's range for the same dist does not replace it
        if req.specifier and (name not in ranges or req.marker is None):
            ranges[name] = req.specifier
    if meta.get("Requires-Python"):
        ranges["python"] = SpecifierSet(meta["Requires-Python"])
    for line in overrides:
        req = Requirement(line)
        ranges[canonicalize_name(req.name)] = req.specifier
    return ranges


def env_violations(report: dict, ranges: dict) -> tuple[list[str], list[str]]:
    """(violations, every patch not applied for a version/attribute reason), as lines."""
    import importlib.metadata

    from packaging.utils import canonicalize_name
    from packaging.version import Version

    violations, skipped = [], []
    for patch in report["patches"]:
        status = patch.get("status", "")
        if not (status.startswith("skipped") or status.startswith("failed")):
            continue
        dist = re.match(r"\s*([A-Za-z0-9_.-]+)", patch["supports"]).group(1)
        name = canonicalize_name(dist)
        if name == "python":
            installed = platform.python_version()
        else:
            try:
                installed = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                installed = None
        line = f"{patch['target']} [{patch['supports']}; installed {dist} {installed}]: {status}"
        skipped.append(line)
        declared = ranges.get(name)
        if installed is not None and declared is not None and Version(Version(installed).base_version) in declared:
            violations.append(f"{line} -- but {dist} {installed} is inside accel-npu's declared {dist}{declared}")
    return violations, skipped


def check_env(args) -> int:
    if args.env_json:
        report = json.loads(Path(args.env_json).read_text())
    else:
        out = subprocess.run(["accel-npu", "env", "--json"], capture_output=True, text=True, check=True).stdout
        report = json.loads(out)
    violations, skipped = env_violations(report, declared_ranges(args.range))
    applied = sum(p.get("status") == "applied" for p in report["patches"])
    print(
        f"{len(report['patches'])} patches: {applied} applied, {len(skipped)} skipped/failed "
        f"(version or attribute), the rest inactive here or not imported"
    )
    for line in skipped:
        print(f"  skipped: {line}")
    for patch in report["patches"]:  # declared stock correct at this version (GATED_TESTS check the claim)
        if patch.get("status", "").startswith("not needed"):
            print(f"  {patch['status']}: {patch['target']} [stock correct: {patch.get('stock_correct')}]")
    for line in violations:
        print(f"ERROR: patch skipped inside the declared range: {line}")
    return 1 if violations else 0


# ------------------------------------------------------------------------------------------------
# rows and the table
# ------------------------------------------------------------------------------------------------
def git_state(root: Path) -> tuple[str, bool, list[str]]:
    """(HEAD, dirty, the changed/untracked files) of the checkout the session snapshotted."""
    from _results import git_state as head_and_changes

    try:
        sha, files = head_and_changes(root, untracked="normal")
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False, []
    return sha, bool(files), files


def load_rows() -> list[dict]:
    return json.loads(JSON_FILE.read_text()) if JSON_FILE.exists() else []


def append_row(row: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    rows = load_rows()
    rows.append(row)
    JSON_FILE.write_text(json.dumps(rows, indent=1) + "\n")
    render()


def _cell(check: dict | None) -> str:
    if not check:
        return "not run"
    return f"{check['result']} ({check['seconds']:.0f} s)"


def latest_rows() -> dict[str, dict]:
    """Each session's newest row, in the order sessions first appeared; each check stamped with the commit
    and date it ran on. A run of some checks only (``-- only=...``) keeps the others' results from the
    previous row of the same versions."""
    latest: dict[str, dict] = {}
    for row in load_rows():
        mark = row["commit"][:10] + ("+" if row.get("dirty") else "")
        row = {**row, "checks": {k: {**v, "commit": mark, "date": row["date"]} for k, v in row["checks"].items()}}
        before = latest.get(row["session"])
        if before and before["versions"] == row["versions"]:
            row["checks"] = {**before["checks"], **row["checks"]}
            row["wall_s"] = before["wall_s"] + row["wall_s"]
        latest[row["session"]] = row
    return latest


def render() -> None:
    latest = latest_rows()
    newest = max(latest.values(), key=lambda r: r["date"]) if latest else None
    lines = [
        "# Version matrix",
        "",
        "Reproduce: `nox -s <session>` (noxfile.py; `nox -l` lists the sessions; `nox -s <session> -- quick`",
        'skips the official scripts). Each row: a fresh venv, torch first, then `pip install ".[test]"`',
        "non-editable with the session's pins in one resolve; exact versions from importlib.metadata of that",
        "venv. Every run appends its row to benchmarks/results/versions.json; this table shows each",
        "session's latest row, each with its own commit and date.",
        "",
        f"- Date: {newest['date'] if newest else '-'} (the newest row)",
        f"- Commit: {newest['commit'] if newest else '-'} (the newest row's"
        + (" + uncommitted changes" if newest and newest.get("dirty") else "")
        + "; the table names the commit each check ran on, and versions.json each row's changed files)",
        f"- Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"rendered {datetime.datetime.now().isoformat(timespec='seconds')}",
        "",
        "| session | Python | torch | accelerate | deepspeed | diffusers | transformers | peft | "
        + " | ".join(CHECK_TITLES[c] for c in CHECKS)
        + " | wall | commit | date |",
        "|" + "---|" * (8 + len(CHECKS) + 3),
    ]
    for name, row in latest.items():
        v = row["versions"]
        marks = sorted({c["commit"] for c in row["checks"].values()})
        commit = ", ".join(marks) + (" (+: uncommitted changes)" if any(m.endswith("+") for m in marks) else "")
        lifted = f" (caps lifted: {', '.join(row['lifted'])})" if row.get("lifted") else ""
        lines.append(
            f"| {name}{lifted} | {v.get('python') or '-'} | "
            + " | ".join(str(v.get(d) or "-") for d in DISTS[:6])
            + " | "
            + " | ".join(_cell(row["checks"].get(c)) for c in CHECKS)
            + f" | {row['wall_s']:.0f} s | {commit} | {row['date']} |"
        )
    lines += ["", "## First error of each failed check", ""]
    for name, row in latest.items():
        for check in CHECKS:
            c = row["checks"].get(check)
            if c and c["result"] == "fail":
                error = " ".join((c.get("first_error") or "?").split()).replace("`", "'")
                lines.append(f"- {name} / {CHECK_TITLES[check]} ({c['commit']}): `{error}`")
    MD_FILE.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check-env")
    c.add_argument("--env-json", help="a saved `accel-npu env --json` (default: run it)")
    c.add_argument("--range", action="append", default=[], help="replace one library's declared range")
    sub.add_parser("render")
    args = p.parse_args(argv)
    if args.command == "check-env":
        return check_env(args)
    render()
    return 0


if __name__ == "__main__":
    sys.exit(main())
