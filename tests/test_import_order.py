"""Any import order leaves every patch applied (34 of diffusers' 90 training examples import
accelerate before torch; so do many research repos).

What can differ between orders is which of our target modules is half-initialised when
activation runs inside ``import torch``: that is decided by the chain of imports up to the
first ``import torch``, i.e. by the library imported first, and by what the libraries import of
each other afterwards. The orders below put every library first once and every ordered pair
both ways: the 6 rotations of one order do both (for libraries x and y, the rotation starting at x
imports x before y, the one starting at y the other way round). Each runs in a fresh process, with
activation through the real torch entry point (no explicit ``accel_npu.patch()``).

After the imports the script "uses" every patch's module (imports it, as a training script's
first call would) and reports the whole ledger: every patch must be ``applied``. A patch of a
library that is not installed is the only accepted exception, and decord is installed in CI.
"""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.inprocess import declared_patches as _declared_patches
from tests.launch_utils import base_env

LIBRARIES = ["torch", "accelerate", "diffusers", "transformers", "deepspeed", "decord"]


def _orders() -> list[list[str]]:
    libs = [lib for lib in LIBRARIES if importlib.util.find_spec(lib) is not None]
    return [libs[i:] + libs[:i] for i in range(len(libs))]


CHECK = r"""
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from accel_npu.patching import get_ledger
ledger = get_ledger()
absent = set()
for patch in ledger.patches:
    try:
        importlib.import_module(patch.module)
    except ModuleNotFoundError:  # not in the installed release (deepspeed.runtime.sequence_parallel before 0.18.2)
        absent.add(patch.module)
print("RESULT " + json.dumps({p.target: "absent" if p.module in absent else p.status for p in ledger.patches}))
"""


def _declared_targets() -> set[str]:
    return {p.target for p in _declared_patches()}


@pytest.mark.slow
@pytest.mark.parametrize("order", _orders(), ids=lambda order: "-".join(order))
def test_every_patch_applied_whatever_the_import_order(order, tmp_path):
    # the CUDA façade family applies in launched ranks only; opted in so every patch is expected applied
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, *order],
        env=base_env(ACCEL_NPU_CUDA_FACADE="1"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    statuses = json.loads(line[len("RESULT ") :])
    assert set(statuses) == _declared_targets(), "the ledger must hold every declared patch"
    # "not needed" only where the installed version is one the patch declares stock correct
    needless = {p.target: f"not needed: {p.not_needed()}" for p in _declared_patches() if p.not_needed()}
    # a module the installed release lacks: only where the patch declares that release stock correct
    not_applied = {
        t: s
        for t, s in statuses.items()
        if s != "applied" and s != needless.get(t) and not (s == "absent" and t in needless)
    }
    assert not not_applied, f"import order {order}: {json.dumps(not_applied, indent=1)}"


@pytest.mark.slow
def test_stock_half_accelerate_before_torch_is_half_initialised(tmp_path):
    """The mechanism the fix relies on, shown on the real libraries: with `import accelerate`
    first, torch (and so our activation) is imported while accelerate.accelerator has not yet
    defined Accelerator. Witnessed by a post-import hook on torch, not by accel-npu."""
    probe = r"""
import sys, wrapt
seen = {}
def on_torch(module):
    acc = sys.modules.get("accelerate.accelerator")
    seen["half"] = acc is not None and not hasattr(acc, "Accelerator")
    seen["initializing"] = bool(getattr(getattr(acc, "__spec__", None), "_initializing", False))
wrapt.register_post_import_hook(on_torch, "torch")
import accelerate
print("RESULT", seen["half"], seen["initializing"])
"""
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        env=base_env(ACCEL_NPU_DISABLE="1"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT True True" in proc.stdout


@pytest.mark.slow
def test_call_when_imported_fires_after_the_module_body(tmp_path):
    """The deferral itself, on a module of our own that imports a hook trigger half-way."""
    pkg = tmp_path / "halfmod"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "trigger.py").write_text(
        "import sys\n"
        "from accel_npu.patching import call_when_imported, still_importing\n"
        "target = sys.modules['halfmod.target']\n"
        "assert still_importing(target)\n"
        "assert call_when_imported(target, lambda m: EVENTS.append(('done', hasattr(m, 'LATE'))))\n"
        "EVENTS = []\n"
    )
    (pkg / "target.py").write_text("EARLY = 1\nfrom halfmod import trigger\nLATE = 2\n")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import halfmod.target, halfmod.trigger as t; "
        "from accel_npu.patching import still_importing; "
        "print('RESULT', t.EVENTS, still_importing(halfmod.target), type(halfmod.target.__spec__).__name__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=base_env(ACCEL_NPU_DISABLE="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT [('done', True)] False ModuleSpec" in proc.stdout
