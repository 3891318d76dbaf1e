"""docs/environment.md lists exactly the variables accel-npu declares, with the same defaults."""

import re

from accel_npu import environment
from tests.launch_utils import REPO

DOC = (REPO / "docs" / "environment.md").read_text()


def table(section_title: str) -> dict[str, str]:
    """{variable: default} from the Markdown table under ``## section_title``."""
    section = DOC.split(f"## {section_title}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([A-Z0-9_]+)`\s*\|\s*([^|]*?)\s*\|", line)
        if m:
            default = m.group(2)
            rows[m.group(1)] = "" if default == "(empty)" else default.strip("`")
    return rows


def test_read_by_accel_npu_matches_environment_py():
    documented = table("Read by accel-npu")
    declared = {v.name: v.default for v in environment.VARIABLES}
    assert set(documented) == set(declared), (
        f"undocumented: {sorted(set(declared) - set(documented))}; "
        f"documented but not declared: {sorted(set(documented) - set(declared))}"
    )
    assert documented == declared


def test_worker_defaults_match_the_npu_backend():
    from accel_npu.plugins.devices.npu.worker_env import NPU_LAUNCH_DEFAULTS

    assert table("Set for launched workers (npu backend)") == NPU_LAUNCH_DEFAULTS
