"""Every patch in the ledger, automatically: import->patch, patch->import, double patch,
unpatch restores the identical original, double unpatch, unpatch->repatch, and unpatch before the
module is imported (the module then stays stock until the next patch). Each order runs in a fresh process
(with torch's autoload off, so the test decides when accel-npu arms) that imports every patched module,
as a training script does; the results are asserted module by module."""

import json
import re
import subprocess
import sys
import textwrap

import pytest

from tests.launch_utils import base_env


def _declared_patches():
    from accel_npu.manager import declared_patches, get_plugin_manager

    pm = get_plugin_manager()
    return [
        (impl.plugin_name, patch)
        for impl in pm.hook.accel_npu_register_patches.get_hookimpls()
        for patch in declared_patches(impl)
    ]


DECLARED = _declared_patches()


def not_installed(patch) -> bool:
    from accel_npu.patching import installed_version, parse_supports

    return installed_version(parse_supports(patch.supports)[0]) is None


# One fresh process per order: "patch-then-import" needs the modules not yet imported, which torch
# (accel-npu activates inside it) and sys (every process has it) always are.
ALWAYS_IMPORTED = ("torch", "sys")
MODULES = sorted({patch.module for _, patch in DECLARED})


CHECK = textwrap.dedent(r"""
    import importlib, inspect, json, sys
    import wrapt
    order, modules = sys.argv[1], sys.argv[2:]
    import accel_npu
    from accel_npu.patching import get_ledger

    absent = []

    def load(module_name):
        # a module the installed release does not have yet (deepspeed.runtime.sequence_parallel before 0.18.2)
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError:
            absent.append(module_name)

    def lookup(patch):
        parent, attribute, _ = wrapt.resolve_path(sys.modules[patch.module], patch.qualname)
        return parent, attribute, inspect.getattr_static(parent, attribute)

    def ours(obj, original):
        return isinstance(obj, wrapt.FunctionWrapper) and obj.__wrapped__ is original

    pristine = {}
    if order == "import-then-patch":
        for module_name in modules:
            load(module_name)
        # The objects as they are before accel-npu arms: unpatch must give back exactly these.
        from accel_npu.manager import get_plugin_manager
        for impl in get_plugin_manager().hook.accel_npu_register_patches.get_hookimpls():
            for p in impl.function() or ():
                if p.module in modules:
                    try:
                        pristine[p.target] = lookup(p)[2]
                    except Exception:
                        pass
        accel_npu.patch()
    else:
        already = {m: m in sys.modules for m in modules}
        accel_npu.patch()
        for module_name in modules:
            load(module_name)
    # each step of the lifecycle is taken by every patch at once (one patch()/unpatch() per step, not per patch:
    # those arm and disarm the whole ledger), and the whole cycle twice: the second round starts from the first's
    # repatch. A patch's result holds only if it held in both rounds.
    results, applied = {}, []
    for patch in [p for p in get_ledger().patches if p.module in modules]:
        out = results.setdefault(patch.module, {}).setdefault(patch.target, {"status": patch.status})
        if patch.status == "applied":
            applied.append((patch, out, patch._parent, patch._attribute, patch._original, patch._had_own_attribute))

    def record(out, key, value):
        out[key] = out.get(key, True) and value

    for _round in range(2):
        for patch, out, parent, attribute, original, own_before in applied:
            record(out, "wrapped_once", ours(lookup(patch)[2], original))
        accel_npu.patch()                                      # double patch
        for patch, *_ in applied:
            get_ledger().apply(patch)
        for patch, out, parent, attribute, original, own_before in applied:
            record(out, "still_wrapped_once", ours(lookup(patch)[2], original))
        accel_npu.unpatch()
        restored = {}
        for patch, out, parent, attribute, original, own_before in applied:
            restored[patch.target] = lookup(patch)[2] is pristine.get(patch.target, original) is original \
                and not isinstance(original, wrapt.FunctionWrapper)
        accel_npu.unpatch()                                    # double unpatch: nothing more to undo
        for patch, out, parent, attribute, original, own_before in applied:
            record(out, "restored_identical", restored[patch.target] and lookup(patch)[2] is original)
            record(out, "own_attribute_restored",
                   (attribute in vars(parent)) == own_before if inspect.isclass(parent) else True)
        accel_npu.patch()                                      # unpatch -> repatch
        for patch, out, parent, attribute, original, own_before in applied:
            record(out, "repatched", ours(lookup(patch)[2], original) and patch.status == "applied")
    print("RESULT " + json.dumps({"imported_before_arming": already if order == "patch-then-import" else {},
                                  "results": results, "absent": absent}))
""")


@pytest.fixture(scope="module")
def lifecycle():
    """order -> the fresh process's findings for every patched module (two processes in all)."""
    # the CUDA façade family applies in launched ranks only: opted in here, so every patch's lifecycle runs
    env = base_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0", ACCEL_NPU_CUDA_FACADE="1")
    found = {}
    for order in ("import-then-patch", "patch-then-import"):
        proc = subprocess.run(
            [sys.executable, "-c", CHECK, order, *MODULES], env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
        found[order] = json.loads(line[len("RESULT ") :])
    return found


@pytest.mark.slow
@pytest.mark.parametrize("order", ["import-then-patch", "patch-then-import"])
@pytest.mark.parametrize("module", MODULES)
def test_patch_lifecycle(lifecycle, module, order):
    found = lifecycle[order]
    if order == "patch-then-import" and module not in ALWAYS_IMPORTED:
        assert found["imported_before_arming"][module] is False, (
            f"{module} was imported by accel-npu's own activation: patch-then-import is untestable"
        )
    if module in found["absent"]:
        # only a release the patches declare stock correct may lack the module
        missing = [p.target for _, p in DECLARED if p.module == module and not (not_installed(p) or p.not_needed())]
        assert not missing, f"{module} is not in the installed release, which these patches support: {missing}"
        return
    results = found["results"].get(module, {})
    expected = {p.target for _, p in DECLARED if p.module == module}
    assert set(results) == expected
    ok = {
        "wrapped_once": True,
        "still_wrapped_once": True,
        "restored_identical": True,
        "own_attribute_restored": True,
        "repatched": True,
    }
    for target, result in results.items():
        # Every library a patch targets is installed in CI (decord is a test dependency): each
        # patch must really apply there; "skipped" is only acceptable for an absent library.
        patch = next(p for _, p in DECLARED if p.target == target)
        if not_installed(patch):
            assert result["status"].startswith("skipped: ") and "is not installed" in result["status"], result
            continue
        if patch.not_needed():  # a version the patch declares stock correct (tested by the version matrix)
            assert result == {"status": f"not needed: {patch.not_needed()}"}, target
            continue
        assert result == {"status": "applied", **ok}, target


def test_every_declared_patch_says_why_and_when_it_goes():
    for _plugin, patch in DECLARED:
        assert patch.reason.strip() and patch.remove_when.strip() and patch.supports.strip(), patch.target
        # the installed version of every targeted library is one the patch declares it supports, or one it
        # declares stock correct (the defect came later)
        assert patch.version_problem() is None or patch.not_needed(), (patch.target, patch.version_problem())


# Our own tracker's numbers (issue and item numbers, field report sections, pitfall numbers) mean nothing to
# a reader of `accel-npu env`; they belong in docs/pitfalls.md. Upstream references (`diffusers #2606`) stay.
INTERNAL_REFERENCE = re.compile(r"[Ii]ssue [0-9]+|field report|[Pp]itfall [0-9]|item [0-9]|stop [0-9]+", re.I)
REASON_LIMIT = 160  # one line of `accel-npu env`


def test_every_reason_is_one_short_line_citing_no_internal_tracker():
    too_long, internal = [], []
    for _plugin, patch in DECLARED:
        for field in ("reason", "remove_when"):
            text = getattr(patch, field)
            if len(text) > REASON_LIMIT or "\n" in text:
                too_long.append((patch.target, field, len(text)))
            if INTERNAL_REFERENCE.search(text):
                internal.append((patch.target, field, INTERNAL_REFERENCE.search(text).group()))
    assert not too_long, too_long
    assert not internal, internal


def test_patch_targets_are_unique():
    targets = [p.target for _, p in DECLARED]
    assert len(targets) == len(set(targets)), sorted(t for t in targets if targets.count(t) > 1)


UNPATCH_BEFORE_IMPORT = textwrap.dedent(r"""
    import importlib, inspect, json, sys
    import wrapt
    modules = sys.argv[1:]
    import accel_npu
    from accel_npu.patching import get_ledger

    accel_npu.patch()
    accel_npu.unpatch()
    imported_before = [m for m in modules if m in sys.modules and m not in ("torch", "sys")]
    results = {}
    for module_name in modules:
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError:  # not in the installed release (its patches declare it stock correct)
            pass
    for patch in get_ledger().patches:
        if patch.module not in modules or patch.module not in sys.modules:
            continue
        try:
            parent, attribute, _ = wrapt.resolve_path(sys.modules[patch.module], patch.qualname)
        except Exception:
            continue
        results[patch.target] = {"stock_after_import": not isinstance(inspect.getattr_static(parent, attribute),
                                                                      wrapt.FunctionWrapper)}
    accel_npu.patch()
    for patch in get_ledger().patches:
        if patch.target in results:
            results[patch.target]["status_after_repatch"] = patch.status
    print("RESULT " + json.dumps({"imported_before": imported_before, "results": results}))
""")


@pytest.mark.slow
def test_unpatch_before_import_leaves_the_module_stock_until_the_next_patch():
    """One process for every module: patch, unpatch, then import them all (ddtrace's patch-test base
    has this case): nothing is wrapped; the next patch() applies every supported patch."""
    proc = subprocess.run(
        [sys.executable, "-c", UNPATCH_BEFORE_IMPORT, *MODULES],
        env=base_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0", ACCEL_NPU_CUDA_FACADE="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT ") :])
    assert out["imported_before"] == [], "accel-npu's own activation imported these: the case is untestable"
    # a patch the installed release needs not (stock correct there) may still find its target: not compared
    needless = {p.target for _, p in DECLARED if p.not_needed()}
    results = {t: r for t, r in out["results"].items() if t not in needless}
    installed = {p.target for _, p in DECLARED if not not_installed(p) and not p.not_needed()}
    assert set(results) == installed
    assert [t for t, r in results.items() if not r["stock_after_import"]] == []
    assert {t: r["status_after_repatch"] for t, r in results.items() if r["status_after_repatch"] != "applied"} == {}
