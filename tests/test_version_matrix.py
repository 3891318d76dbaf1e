"""Declared = tested: the ranges accel-npu declares (setup.cfg, every Patch's ``supports``) are the ones the
version matrix (noxfile.py, sets in benchmarks/versions.py) installs at their ends, and its recorded rows
(benchmarks/results/versions.json) show those ends passing. The matrix's own env check gets a negative test."""

from __future__ import annotations

import configparser
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.inprocess import declared_patches as _declared_patches
from tests.launch_utils import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import versions as matrix  # benchmarks/versions.py: standard library only at import


def _install_requires() -> dict:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    reqs = [Requirement(line) for line in cfg["options"]["install_requires"].splitlines() if line.strip()]
    extras = [
        Requirement(line)
        for line in cfg["options.extras_require"]["test"].splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    out = {canonicalize_name(r.name): r.specifier for r in reqs}
    for r in extras:  # the test extra's range for a library install_requires does not name (peft, decord)
        out.setdefault(canonicalize_name(r.name), r.specifier)
    return out


def _bounds(specifier) -> tuple[str | None, str | None]:
    lower = next((s.version for s in specifier if s.operator in (">=", "==")), None)
    upper = next((s.version for s in specifier if s.operator in ("<", "==")), None)
    return lower, upper


DECLARED = _install_requires()


@pytest.mark.parametrize("patch", _declared_patches(), ids=lambda p: p.target)
def test_every_patch_covers_exactly_its_library_s_declared_range(patch):
    from packaging.specifiers import SpecifierSet

    req = Requirement(patch.supports)
    name = canonicalize_name(req.name)
    if name == "python":
        return  # the interpreter: python_requires, outside the library matrix
    assert name in DECLARED, f"{patch.target}: {req.name} is in no declared range (setup.cfg)"
    lower, upper = _bounds(req.specifier)
    want_lower, want_upper = _bounds(DECLARED[name])
    assert upper == want_upper, f"{patch.target}: supports {patch.supports}, declared {req.name}{DECLARED[name]}"
    if patch.stock_correct:
        # the versions below the patch's range are the ones it declares stock correct, down to the declared floor
        stock = SpecifierSet(str(Requirement(patch.stock_correct).specifier))
        assert Version(want_lower) in stock and Version(lower) not in stock, (patch.target, patch.stock_correct)
        assert _bounds(stock)[1] == lower, (
            f"{patch.target}: stock_correct {patch.stock_correct} leaves a gap to {lower}"
        )
    else:
        assert lower == want_lower, f"{patch.target}: supports {patch.supports}, declared {req.name}{DECLARED[name]}"


def test_the_lower_set_installs_every_declared_lower_bound():
    pins = dict(p.split("==") for p in [matrix.SETS["lower"]["torch"], *matrix.SETS["lower"]["pins"]])
    for name, specifier in DECLARED.items():
        lower = _bounds(specifier)[0]
        if (
            name
            in (
                "pytest",
                "pytest-timeout",
                "pytest-xdist",
                "pexpect",
                "matplotlib",
                "psutil",
                "tensorboard",
                "sentencepiece",
                "datasets",
                "parameterized",
                "requests-mock",
                "decord",
                "ruff",
            )
            or lower is None
        ):
            # test tooling, not a range users install accel-npu into (decord: one release, 0.6.0; ruff: pinned,
            # its formatting changes between releases)
            continue
        assert name in pins and Version(pins[name]) == Version(lower), (
            f"the lower set installs {name}=={pins.get(name)}, the declared floor is {lower}"
        )


def _latest(session: str) -> dict:
    latest = matrix.latest_rows()
    assert session in latest, f"no {session!r} row in {matrix.JSON_FILE}"
    return latest[session]


@pytest.mark.parametrize("session", ["lower", "newest"])
def test_the_recorded_ends_of_the_declared_ranges_pass_every_check(session):
    row = _latest(session)
    failed = {c: r.get("first_error") for c, r in row["checks"].items() if r["result"] != "pass"}
    assert not failed, f"{session}: {failed} (benchmarks/results/versions.md)"
    assert set(row["checks"]) == set(matrix.CHECKS), (
        f"{session}: checks not run: {set(matrix.CHECKS) - set(row['checks'])}"
    )
    for name, specifier in DECLARED.items():
        installed = row["versions"].get(name)
        if installed is None:
            continue
        assert Version(installed.split("+")[0]) in specifier, f"{session}: {name} {installed} outside {specifier}"
        if session == "lower" and name in row["versions"] and _bounds(specifier)[0]:
            assert Version(installed.split("+")[0]) == Version(_bounds(specifier)[0]), (name, installed)


# -- the env check: a patch skipped inside the declared range is an error, outside it is listed ---------------
def _report(status: str, supports: str = "pytest>=1,<999") -> dict:
    return {"patches": [{"target": "m:f", "plugin": "p", "supports": supports, "status": status}]}


def test_the_env_check_fails_on_a_patch_skipped_inside_the_declared_range():
    import pytest as installed

    ranges = {"pytest": Requirement("pytest>=1,<999").specifier}
    violations, skipped = matrix.env_violations(_report("skipped: pytest x is outside the supported range"), ranges)
    assert len(violations) == 1 and f"pytest {installed.__version__} is inside" in violations[0]
    # outside the declared range (a newer release than the caps): listed, not an error
    violations, skipped = matrix.env_violations(
        _report("skipped: outside"), {"pytest": Requirement("pytest<1").specifier}
    )
    assert violations == [] and len(skipped) == 1
    # applied, not needed, inactive here: neither
    for status in ("applied", "not needed: pytest 8 is in pytest<999, ...", "inactive here: not launched"):
        assert matrix.env_violations(_report(status), ranges) == ([], [])


# -- a release that needs a newer torch than it declares: named after the traceback and at launch -------------
@pytest.mark.parametrize(
    "installed,named",
    [
        # what pip resolves under torch_npu 2.5.1's torch (the torch_npu_2_5 rows)
        ({"torch": "2.5.1", "diffusers": "0.42.1", "transformers": "5.25.0"}, ["diffusers", "transformers"]),
        ({"torch": "2.5.1", "diffusers": "0.40.0", "transformers": "4.57.6"}, []),  # the releases before them
        ({"torch": "2.6.0", "diffusers": "0.42.1", "transformers": "5.25.0"}, []),  # torch has what they need
    ],
)
def test_a_release_needing_a_newer_torch_than_it_declares_is_named(monkeypatch, caplog, installed, named):
    from accel_npu.plugins.explain_errors.excepthook import explanations
    from accel_npu.plugins.launch.launcher import _warn_undeclared_torch_needs

    monkeypatch.setattr("accel_npu.patching.installed_version", installed.get)
    lines = explanations(AttributeError("module 'torch' has no attribute 'accelerator'"))
    mine = [line for line in lines if "does not declare it" in line]
    since = {"diffusers": "0.41.0", "transformers": "5.0.0"}
    assert [f"pip install '{d}<{since[d]}'" in " ".join(mine) for d in named] == [True] * len(named)
    assert bool(mine) is bool(named) and all(f"torch {installed['torch']} is installed" in m for m in mine)
    with caplog.at_level("WARNING", logger="accel_npu"):
        _warn_undeclared_torch_needs()
    warned = [r.getMessage() for r in caplog.records if "does not declare it" in r.getMessage()]
    assert [d for d in named if any(w.startswith(f"accel-npu: {d} ") for w in warned)] == named and len(warned) == len(
        named
    )
