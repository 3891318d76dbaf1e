"""Upstream's own tests pass, fail and skip the same with accel-npu active as stock (ACCEL_NPU_DISABLE=1).

tools/upstream_equivalence.py runs each vendored upstream module (third_party/, one per suite) twice,
each half a pytest subprocess, and compares the outcomes test by test; a test whose outcome differs, or
that only one half collected, fails this test by name with both halves' causes. The comparer's own tests
come first: fed maps that differ it must report them (a checker that cannot fail checks nothing).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap

import pytest

from tests.launch_utils import REPO

_spec = importlib.util.spec_from_file_location("upstream_equivalence", REPO / "tools" / "upstream_equivalence.py")
ue = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("upstream_equivalence", ue)
_spec.loader.exec_module(ue)


def _o(outcome, message=""):
    return {"outcome": outcome, "message": message}


def test_the_comparer_reports_every_outcome_difference_and_one_sided_test():
    stock = {
        "t.py::same": _o("passed"),
        "t.py::accel_runs_what_stock_skips": _o("skipped", "test requires a hardware accelerator"),
        "t.py::only_stock": _o("passed"),
        "t.py::both_fail_differently": _o("failed", "AssertionError: at 0x7f00aa"),
        "t.py::both_fail_same": _o("failed", "AssertionError: at 0x7f00aa"),
    }
    accel = {
        "t.py::same": _o("passed"),
        "t.py::accel_runs_what_stock_skips": _o("failed", "RuntimeError: Found no NVIDIA driver"),
        "pipelines/kolors/test_kolors.py": _o("error", "RuntimeError: torch.jit.script failed"),
        "t.py::both_fail_differently": _o("failed", "TypeError: not a tensor"),
        "t.py::both_fail_same": _o("failed", "AssertionError: at 0x55bb11"),
    }
    result = ue.compare(stock, accel)
    differing = {d["id"]: d for d in result["differing"]}
    assert set(differing) == {
        "t.py::accel_runs_what_stock_skips",
        "t.py::only_stock",
        "pipelines/kolors/test_kolors.py",
    }
    skip = differing["t.py::accel_runs_what_stock_skips"]
    assert (skip["stock"], skip["accel"]) == ("skipped", "failed")
    assert skip["stock_message"] == "test requires a hardware accelerator"
    assert skip["accel_message"] == "RuntimeError: Found no NVIDIA driver"
    assert (differing["t.py::only_stock"]["stock"], differing["t.py::only_stock"]["accel"]) == ("passed", "absent")
    assert differing["pipelines/kolors/test_kolors.py"]["stock"] == "absent"
    assert differing["pipelines/kolors/test_kolors.py"]["accel"] == "error"
    assert result["tests"] == 6 and result["identical"] == 3
    # same outcome, other cause: reported apart (addresses ignored), not counted as differing
    assert [d["id"] for d in result["same_outcome_other_cause"]] == ["t.py::both_fail_differently"]
    assert ue.compare(stock, dict(stock)) == {
        "tests": 5,
        "identical": 5,
        "differing": [],
        "same_outcome_other_cause": [],
    }


def test_a_test_takes_its_worst_phase(tmp_path):
    rows = [
        {"id": "a", "phase": "call", "outcome": "passed", "message": ""},
        {"id": "a", "phase": "teardown", "outcome": "error", "message": "OSError: busy"},
        {"id": "b", "phase": "setup", "outcome": "skipped", "message": "no gpu"},
        {"id": "c", "phase": "collect", "outcome": "error", "message": "ImportError: x"},
    ]
    path = tmp_path / "o.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ue.read_outcomes(path) == {
        "a": _o("error", "OSError: busy"),
        "b": _o("skipped", "no gpu"),
        "c": _o("error", "ImportError: x"),
    }


def test_the_halves_environments_differ_only_by_accel_npu_disable():
    base = {"PATH": "/bin", "ACCEL_NPU_BACKEND": "cpu", "ACCEL_NPU_DISABLE": "0", "PYTHONPATH": "/x"}
    stock, accel = ue.child_env(True, base), ue.child_env(False, base)
    assert not any(k.startswith("ACCEL_NPU_") for k in accel)
    assert {k: v for k, v in stock.items() if k != "ACCEL_NPU_DISABLE"} == accel
    assert stock["ACCEL_NPU_DISABLE"] == "1"
    assert accel["HF_HUB_OFFLINE"] == "1" and accel["OMP_NUM_THREADS"] == "1"


def test_the_runner_sees_a_difference_end_to_end(tmp_path):
    """Both halves through real pytest subprocesses and the plugin: a test that fails only with accel-npu
    active, one collected only stock (the other half's module fails to import) and a skip reason."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_synthetic.py").write_text(
        textwrap.dedent("""
        import os, pytest
        STOCK = os.environ.get("ACCEL_NPU_DISABLE") == "1"

        def test_same():
            pass

        def test_passes_only_stock():
            assert STOCK, "accel-npu changed this"

        @pytest.mark.skipif(STOCK, reason="requires a hardware accelerator")
        def test_skipped_only_stock():
            pass
    """)
    )
    (tmp_path / "tests" / "test_collects_stock_only.py").write_text(
        textwrap.dedent("""
        import os
        if os.environ.get("ACCEL_NPU_DISABLE") != "1":
            raise RuntimeError("broken at import")

        def test_x():
            pass
    """)
    )
    # a lazy import's wrapper (diffusers/transformers style): the first line hides the root cause, which the
    # recorded message must still name -- once raised as RuntimeError (pytest keeps the exception chain),
    # once as ImportError (pytest flattens it to text)
    for name, wrapper in (
        ("test_chained_runtime_error.py", "RuntimeError"),
        ("test_chained_import_error.py", "ImportError"),
    ):
        (tmp_path / "tests" / name).write_text(
            textwrap.dedent(f"""
            import os
            if os.environ.get("ACCEL_NPU_DISABLE") != "1":
                try:
                    import a_dependency_that_is_not_installed_xyz
                except ImportError as e:
                    raise {wrapper}(
                        "Failed to import synthetic.pipeline because of the following error "
                        "(look up to see its traceback):\\n" + str(e)) from e

            def test_y():
                pass
        """)
        )
    select = ["tests"]
    stock = ue.run_half(tmp_path, select, stock=True, timeout=300)
    accel = ue.run_half(tmp_path, select, stock=False, timeout=300)
    result = ue.compare(stock.outcomes, accel.outcomes)
    got = {d["id"]: (d["stock"], d["accel"], d["accel_message"]) for d in result["differing"]}
    assert got["tests/test_synthetic.py::test_passes_only_stock"][:2] == ("passed", "failed")
    assert "accel-npu changed this" in got["tests/test_synthetic.py::test_passes_only_stock"][2]
    assert got["tests/test_synthetic.py::test_skipped_only_stock"][:2] == ("skipped", "passed")
    assert got["tests/test_collects_stock_only.py::test_x"][:2] == ("passed", "absent")
    assert got["tests/test_collects_stock_only.py"][:2] == ("absent", "error")
    assert "broken at import" in got["tests/test_collects_stock_only.py"][2]
    assert "tests/test_synthetic.py::test_same" not in got
    for name in ("test_chained_runtime_error.py", "test_chained_import_error.py"):
        assert got[f"tests/{name}"][:2] == ("absent", "error")
        message = got[f"tests/{name}"][2]
        assert "\n" not in message, message
        assert "ModuleNotFoundError: No module named 'a_dependency_that_is_not_installed_xyz'" in message, message
        assert "Failed to import synthetic.pipeline" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("suite", sorted(ue.CI_SUBSET))
def test_upstream_module_has_the_same_outcomes_with_accel_npu_as_stock(suite):
    missing = [name for name in ue.TEST_REQUIREMENTS if importlib.util.find_spec(name) is None]
    assert not missing, (
        f"upstream's tests import {missing}: install them (the [test] extra should list "
        "them), or this suite's halves would only record the same import error"
    )
    src, modules = ue.CI_SUBSET[suite]
    assert all((src / module).is_file() for module in modules), (src, modules)
    result = ue.run_suite(suite, src, list(modules), log=lambda *_: None)
    for side, half in result["halves"].items():
        assert not half["timed_out"], f"{suite}: the {side} half timed out"
        assert half["counts"].get("passed"), f"{suite}: the {side} half passed no test: {half['counts']}"
    assert not result["differing"], f"{suite}: {len(result['differing'])} upstream test(s) differ:\n" + "\n".join(
        f"  {d['id']}: stock {d['stock']} ({d['stock_message'] or '-'}) / accel-npu {d['accel']} "
        f"({d['accel_message'] or '-'})"
        for d in result["differing"]
    )
