"""CI runs exactly the test command README.md gives (docs that rot are defects)."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ci_extracts_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, flags=re.S).group(1).splitlines()
    assert block[0].startswith("# install and run the main job")
    assert "pip install torch==2.13.0" in block[1] and "accelerate launch" in block[1]
    assert block[2] == "# run the tests"
    extracted = subprocess.run(
        ["awk", "/^# run the tests$/{getline; print; exit}", "README.md"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert extracted == block[3] and "pytest" in extracted
    ci = (REPO / ".ci" / "run").read_text()
    assert "torch==2.13.0" in ci and "/^# run the tests$/" in ci and 'eval "$TEST_COMMAND"' in ci
