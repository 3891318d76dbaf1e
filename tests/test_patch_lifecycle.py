"""Every patch in the ledger, automatically: import->patch, patch->import, double patch,
unpatch restores the identical original, unpatch->repatch. Each case runs in a fresh process
(with torch's autoload off, so the test decides when accel-npu arms)."""
import json
import subprocess
import sys
import textwrap

import pytest

from tests.launch_utils import base_env


def _declared_targets():
    from accel_npu.manager import get_plugin_manager

    pm = get_plugin_manager()
    targets = []
    for impl in pm.hook.accel_npu_register_patches.get_hookimpls():
        for patch in impl.function() or ():
            targets.append(patch.target)
    return targets


TARGETS = _declared_targets()

CHECK = textwrap.dedent(r'''
    import importlib, inspect, json, sys
    import wrapt
    target, order = sys.argv[1], sys.argv[2]
    module_name, qualname = target.split(":")
    import accel_npu
    from accel_npu.patching import get_ledger

    def lookup():
        module = sys.modules[module_name]
        parent, attribute, _ = wrapt.resolve_path(module, qualname)
        return parent, attribute, inspect.getattr_static(parent, attribute)

    def ours(obj, original):
        return isinstance(obj, wrapt.FunctionWrapper) and obj.__wrapped__ is original

    out = {}
    if order == "import-then-patch":
        importlib.import_module(module_name)
        parent, attribute, original = lookup()
        own_before = attribute in vars(parent)
        accel_npu.patch()
    else:
        assert module_name not in sys.modules or module_name == "torch", f"{module_name} already imported"
        accel_npu.patch()
        importlib.import_module(module_name)
        patch = get_ledger().find(target)
        parent, attribute, original = patch._parent, patch._attribute, patch._original
        own_before = patch._had_own_attribute
    patch = get_ledger().find(target)
    out["status"] = patch.status
    if patch.status != "applied":
        print("RESULT " + json.dumps(out)); sys.exit(0)
    out["wrapped_once"] = ours(lookup()[2], original)
    accel_npu.patch(); get_ledger().apply(patch)          # double patch
    out["still_wrapped_once"] = ours(lookup()[2], original)
    accel_npu.unpatch()
    out["restored_identical"] = lookup()[2] is original
    out["own_attribute_restored"] = (attribute in vars(parent)) == own_before if inspect.isclass(parent) else True
    accel_npu.patch()                                      # unpatch -> repatch
    out["repatched"] = ours(lookup()[2], original) and patch.status == "applied"
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.parametrize("order", ["import-then-patch", "patch-then-import"])
@pytest.mark.parametrize("target", TARGETS)
def test_patch_lifecycle(target, order):
    env = base_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    proc = subprocess.run([sys.executable, "-c", CHECK, target, order], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    if result["status"].startswith("skipped"):
        pytest.skip(f"{target}: {result['status']}")
    assert result == {"status": "applied", "wrapped_once": True, "still_wrapped_once": True,
                      "restored_identical": True, "own_attribute_restored": True, "repatched": True}


def test_every_declared_patch_is_documented():
    for target in TARGETS:
        from accel_npu.patching import get_ledger

        patch = get_ledger().find(target)
        assert patch is not None, f"{target} declared but not in the ledger"
        assert patch.reason.strip() and patch.remove_when.strip() and patch.supports.strip()
