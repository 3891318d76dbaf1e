"""ruff's lint and format hold on the whole tree (pyproject.toml's [tool.ruff]), and every ``noqa``
says which rule it silences and why.

The ruff runs start a process (slow); the ``noqa`` reading is in-process.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_utils import REPO

NOQA_WORD = "no" + "qa"  # spelled apart: this file's own examples are not directives for ruff or the scan
#: the directive with its rules, then the reason: "- why", "(why)" or plain words after the rules
NOQA = re.compile(
    r"#\s*" + NOQA_WORD + r"\b(?P<colon>:?)\s*(?P<codes>(?:[A-Z]+[0-9]+\s*,\s*)*[A-Z]+[0-9]+)?(?P<why>.*)$"
)


def noqa_problem(line: str) -> str | None:
    """What is wrong with the ``noqa`` on ``line`` (None when it names its rules and a reason, or has none)."""
    found = NOQA.search(line)
    if found is None:
        return None
    if not found["colon"] or not found["codes"]:
        return "a blanket noqa: name the rule it silences"
    why = found["why"].strip().lstrip("-–—(").strip()
    return None if why else f"no reason: say why after the rule (`# {NOQA_WORD}: RULE - why`)"


def excluded() -> list[str]:
    """The folders pyproject.toml's ``extend-exclude`` keeps from ruff (the vendored upstream tree, venvs)."""
    text = (REPO / "pyproject.toml").read_text()
    listed = re.search(r"^extend-exclude\s*=\s*\[(.*?)\]", text, re.M | re.S)
    assert listed, "pyproject.toml: [tool.ruff] extend-exclude not found"
    return re.findall(r'"([^"]+)"', listed.group(1))


def our_python_files() -> list[Path]:
    skip = {str(REPO / folder) for folder in excluded()} | {str(REPO / ".venv"), str(REPO / ".git")}
    found = []
    for folder, subfolders, files in os.walk(REPO):
        # build/ and *.egg-info/ hold copies pip made of our files
        subfolders[:] = [
            s
            for s in subfolders
            if os.path.join(folder, s) not in skip
            and not s.startswith(".")
            and s != "build"
            and not s.endswith("-info")
        ]
        found += [Path(folder, name) for name in files if name.endswith(".py")]
    return found


def test_every_noqa_names_its_rule_and_why():
    problems = [
        f"{path.relative_to(REPO)}:{number}: {problem}"
        for path in our_python_files()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if (problem := noqa_problem(line))
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (f"except Exception:  # {NOQA_WORD}: BLE001 - never break an import", None),
        (f"import torch  # {NOQA_WORD}: F401 (registers the device)", None),
        ("x = 1", None),
        (f"except Exception:  # {NOQA_WORD}", "a blanket noqa"),
        (f"except Exception:  # {NOQA_WORD}: BLE001", "no reason"),
        (f"import a  # {NOQA_WORD}: E402,F401  ", "no reason"),
    ],
)
def test_the_noqa_reader_tells_a_reasoned_noqa_from_a_bare_one(line, problem):
    found = noqa_problem(line)
    assert (found is None) if problem is None else (found is not None and found.startswith(problem))


def test_the_vendored_tree_is_excluded_and_exists():
    # an exclusion naming a folder that moved would let the vendored files be linted (or, worse, formatted)
    vendored = [folder for folder in excluded() if (REPO / folder / "README.md").exists()]
    assert vendored, excluded()


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.slow
def test_ruff_check_is_clean():
    result = ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.slow
def test_ruff_format_leaves_every_file_as_it_is():
    result = ruff("format", "--no-cache", "--check", ".")
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.slow
def test_ruff_reports_a_violation_in_a_file_it_is_given(tmp_path):
    # the negative half: the same configuration fails a long line and a bare broad except
    bad = tmp_path / "bad.py"
    bad.write_text("try:\n    x = 1\nexcept Exception:\n    pass\n" + "y = '" + "a" * 130 + "'\n")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(bad)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "E501" in result.stdout and "BLE001" in result.stdout, result.stdout
