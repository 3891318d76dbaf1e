"""Why sequence parallelism stays refused under FSDP2 (docs/sequence-parallel.md, "FSDP2: why not yet"): torch's
``fully_shard`` averages gradients over its ranks, where the ranks of one sequence-parallel group must sum their
partial gradients; torch's divide factor with sum-only collectives is what a correct implementation would set.
The fact is torch's (tests/scripts/fsdp2_gradient_reduction.py never imports accel_npu), checked on 2 gloo ranks."""

from __future__ import annotations

import json

import pytest

from tests.launch_utils import SCRIPTS, base_env, explain, torchrun_launch


@pytest.mark.slow
def test_fsdp2_averages_gradients_over_its_ranks_and_sums_them_with_a_divide_factor_of_one():
    proc = torchrun_launch([str(SCRIPTS / "fsdp2_gradient_reduction.py")], env=base_env(ACCEL_NPU_DISABLE="1"))
    assert proc.returncode == 0, explain(proc)
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("REDUCED ")]
    reduced = json.loads(line.split(" ", 1)[1])
    assert reduced["world"] == 2
    assert abs(reduced["default"] - 1 / 2) < 1e-6, reduced  # the mean: half of an SP group's summed gradient
    assert abs(reduced["divide_by_1_sum_only"] - 1) < 1e-6, reduced
