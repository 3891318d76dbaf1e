"""docs/troubleshooting.md quotes real `accel-npu env` output: every quoted line still appears."""

import re
import subprocess

import pytest

from tests.launch_utils import BIN, REPO, base_env

DOC = (REPO / "docs" / "troubleshooting.md").read_text()
# Lines that legitimately differ between machines (interpreter, platform, library versions).
MACHINE_SPECIFIC = re.compile(
    r"^  (python|platform|accel-npu|torch|torch_npu|accelerate|deepspeed|diffusers|"
    r"transformers|pluggy|wrapt|safetensors) {2,}"
)


def first_text_block(after_heading: str) -> str:
    return re.search(r"^```text\n(.*?)^```", DOC.split(after_heading, 1)[1], flags=re.S | re.M).group(1)


@pytest.mark.slow
def test_quoted_cpu_env_output_is_current():
    quoted = first_text_block("## Is accel-npu active?")
    proc = subprocess.run(
        [str(BIN / "accel-npu"), "env"], env=base_env(), capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = proc.stdout.splitlines()
    checked = 0
    for line in quoted.splitlines():
        if not line.strip() or line.strip() == "..." or MACHINE_SPECIFIC.match(line):
            continue
        assert line in real, f"docs/troubleshooting.md quotes a line `accel-npu env` no longer prints:\n{line}"
        checked += 1
    assert checked >= 20


def test_the_documented_switches_exist():
    from accel_npu import environment

    names = {v.name for v in environment.VARIABLES}
    for name in set(re.findall(r"\bACCEL_NPU_[A-Z_]+\b", DOC)):
        assert name in names, name
