"""The patch ledger's own rules, on a private ledger and a real module."""

import importlib
import inspect
import sys

import pytest
import wrapt

from accel_npu.patching import NOT_IMPORTED, Patch, PatchLedger

MOD = "tests.fixtures.patch_target"


def _times_ten(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) * 10


def _shout(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs).upper()


def make(target, supports="pytest>=7", wrapper=_times_ten):
    return Patch(target=f"{MOD}:{target}", supports=supports, reason="test", remove_when="test", wrapper=wrapper)


@pytest.fixture
def target_module():
    sys.modules.pop(MOD, None)
    yield
    sys.modules.pop(MOD, None)


def test_declaring_changes_nothing_until_armed_and_imported(target_module):
    ledger = PatchLedger()
    patch = ledger.register(make("add"))
    assert patch.status == NOT_IMPORTED
    mod = importlib.import_module(MOD)
    assert mod.add(1, 2) == 3 and patch.status == NOT_IMPORTED  # not armed: nothing happens
    ledger.arm()
    assert mod.add(1, 2) == 30 and patch.status == "applied"
    ledger.unpatch_all()
    assert mod.add(1, 2) == 3


def test_inherited_method_is_removed_again_on_unpatch(target_module):
    ledger = PatchLedger()
    ledger.register(make("Child.who", wrapper=_shout))
    ledger.arm()
    mod = importlib.import_module(MOD)
    assert mod.Child().who() == "BASE" and mod.Base().who() == "base"
    assert "who" in vars(mod.Child)
    ledger.unpatch_all()
    assert "who" not in vars(mod.Child) and mod.Child().who() == "base"


def test_classmethod_keeps_its_binding(target_module):
    mod = importlib.import_module(MOD)
    original = inspect.getattr_static(mod.Child, "make")
    ledger = PatchLedger()
    calls = []

    def spy(wrapped, instance, args, kwargs):
        calls.append(instance)
        return wrapped(*args, **kwargs)

    ledger.register(make("Child.make", wrapper=spy))
    ledger.arm()
    assert isinstance(mod.Child.make(), mod.Child) and calls == [mod.Child]
    ledger.unpatch_all()
    assert inspect.getattr_static(mod.Child, "make") is original


@pytest.mark.parametrize(
    "supports,reason",
    [
        ("pytest>=99", "outside the supported range"),
        ("no-such-distribution>=1", "no-such-distribution is not installed"),
        ("pytest >=>= 1", "unreadable version range"),
    ],
)
def test_unknown_version_is_skipped_with_reason_never_raised(target_module, supports, reason):
    ledger = PatchLedger()
    patch = ledger.register(make("add", supports=supports))
    ledger.arm()
    mod = importlib.import_module(MOD)
    assert patch.status.startswith("skipped: ") and reason in patch.status
    assert mod.add(1, 2) == 3


def test_a_version_declared_stock_correct_leaves_the_target_stock_and_says_why(target_module):
    import pytest as installed

    ledger = PatchLedger()
    # the defect "came with" pytest 99: every installed pytest is stock correct, and below the supported range
    needless = ledger.register(
        Patch(
            target=f"{MOD}:add",
            supports="pytest>=99",
            stock_correct="pytest<99",
            reason="test",
            remove_when="test",
            wrapper=_times_ten,
        )
    )
    ledger.arm()
    mod = importlib.import_module(MOD)
    assert mod.add(1, 2) == 3
    assert (
        needless.status == f"not needed: pytest {installed.__version__} is in pytest<99, where stock has no such defect"
    )
    assert needless.installed_outside_range() is None and ledger.outside_their_range() == []
    # a stock_correct range the installed version is not in changes nothing: applied inside supports,
    # skipped (and outside the range) beyond it
    ledger.unpatch_all()
    applied = make("add", supports="pytest>=7")
    applied.stock_correct = "pytest<7"
    skipped = Patch(
        target=f"{MOD}:Child.who",
        supports="pytest>=99",
        stock_correct="pytest<7",
        reason="test",
        remove_when="test",
        wrapper=_shout,
    )
    other = PatchLedger()
    other.register(applied)
    other.register(skipped)
    other.arm()
    assert applied.status == "applied" and mod.add(1, 2) == 30
    assert (
        skipped.status.startswith("skipped: ")
        and skipped.installed_outside_range() == f"pytest {installed.__version__}"
    )
    other.unpatch_all()


def test_a_module_absent_at_a_release_declared_stock_correct_is_reported_not_needed():
    """deepspeed.runtime.sequence_parallel does not exist before deepspeed 0.18.2, where its patch's defect does not
    either: the report says "not needed" (with the reason), not "not imported" as for a module not loaded yet."""
    import pytest as installed

    ledger = PatchLedger()
    common = dict(supports="pytest>=99", reason="test", remove_when="test", wrapper=_times_ten)
    absent = ledger.register(Patch(target="tests.fixtures.no_such_module:f", stock_correct="pytest<99", **common))
    pending = ledger.register(Patch(target="tests.fixtures.no_such_module:g", stock_correct="pytest<7", **common))
    ledger.arm()
    statuses = {row["target"]: row["status"] for row in ledger.report()}
    assert statuses[absent.target] == (
        f"not needed: pytest {installed.__version__} is in pytest<99, where stock has no such defect"
    )
    assert statuses[pending.target] == NOT_IMPORTED  # a release the patch is for: the module is just not loaded
    assert absent.status == NOT_IMPORTED  # the ledger's own state is unchanged: it is the report that says why


def test_stock_correct_names_the_distribution_supports_names():
    with pytest.raises(ValueError, match="names another distribution"):
        Patch(
            target=f"{MOD}:add",
            supports="pytest>=7",
            stock_correct="torch<2",
            reason="",
            remove_when="",
            wrapper=_times_ten,
        )


def test_missing_attribute_is_skipped(target_module):
    ledger = PatchLedger()
    patch = ledger.register(make("Child.no_such_method"))
    ledger.arm()
    importlib.import_module(MOD)
    assert patch.status.startswith("skipped: Child.no_such_method not found")


def test_target_must_name_module_and_attribute():
    with pytest.raises(ValueError, match="module:qualified.name"):
        Patch(target="tests.fixtures.patch_target.add", supports="x", reason="", remove_when="", wrapper=_times_ten)


def test_a_relative_wrapper_path_resolves_in_the_declaring_plugins_package(target_module):
    ledger = PatchLedger()
    patch = ledger.register(make("add", wrapper=".test_patching:_times_ten"), plugin="tests", package="tests")
    # resolved at registration: the ledger and `accel-npu env` show the absolute path
    assert patch.wrapper_path == "tests.test_patching:_times_ten"
    ledger.arm()
    assert importlib.import_module(MOD).add(1, 2) == 30 and patch.wrapper is _times_ten


def test_absolute_wrapper_paths_and_callables_are_kept_whatever_the_package():
    ledger = PatchLedger()
    absolute = ledger.register(make("add", wrapper="tests.test_patching:_shout"), package="tests.fixtures")
    given = ledger.register(make("Child.who", wrapper=_shout), package="tests.fixtures")
    assert absolute.wrapper_path == "tests.test_patching:_shout" and absolute.wrapper is _shout
    assert given.wrapper_path == "" and given.wrapper is _shout


def test_a_relative_wrapper_path_without_a_package_is_an_error_naming_the_patch():
    with pytest.raises(ValueError, match=r"'tests.fixtures.patch_target:add'.*'.test_patching:_times_ten'"):
        PatchLedger().register(make("add", wrapper=".test_patching:_times_ten"), plugin="somewhere")
    unregistered = make("add", wrapper=".test_patching:_times_ten")
    with pytest.raises(ValueError, match="tests.fixtures.patch_target:add"):
        _ = unregistered.wrapper


def test_apply_twice_wraps_once(target_module):
    ledger = PatchLedger()
    patch = ledger.register(make("add"))
    ledger.arm()
    mod = importlib.import_module(MOD)
    ledger.apply(patch)
    ledger.arm()
    assert mod.add(1, 2) == 30
    assert not isinstance(mod.add.__wrapped__, wrapt.FunctionWrapper)


@pytest.mark.parametrize(
    "supports",
    ["torch>=2.5,<2.15", "accelerate>=1.10,<1.16", "x~=1.15", "x==2.13.0", "x!=1.0,>0.9", "x<=0.19.8", "x~=0.19.2"],
)
@pytest.mark.parametrize(
    "installed",
    [
        "2.13.0+cpu",
        "2.15.0",
        "2.4.1",
        "1.15.0",
        "1.16.0",
        "0.19.8",
        "0.19.9",
        "2.14.0rc1",
        "1.0",
        "0.95",
        "1.15.3",
        "2.0",
    ],
)
def test_version_ranges_agree_with_packaging(supports, installed):
    """The startup-cheap range check gives packaging.specifiers' answer (local labels ignored)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from accel_npu.patching import parse_supports, version_satisfies

    dist, clauses = parse_supports(supports)
    spec = SpecifierSet(supports[len(dist) :])
    assert version_satisfies(installed, clauses) == spec.contains(Version(installed).public, prereleases=True)


def test_an_installed_version_reads_the_same_whether_or_not_its_package_is_imported(monkeypatch):
    """A package's __version__ serves while it is the metadata's; one with a local label (torch's CUDA wheels:
    2.9.1+cu128 there, 2.9.1 in their metadata) gives way to the metadata, so a status reads the same in
    every process."""
    import importlib.metadata
    import types

    from accel_npu.patching.versions import installed_version

    def read(module):  # the answer is cached per process: read afresh with the package as given
        monkeypatch.setitem(sys.modules, "pluggy", module)
        installed_version.cache_clear()
        return installed_version("pluggy")

    metadata = importlib.metadata.version("pluggy")
    try:
        assert read(None) == metadata
        assert read(types.SimpleNamespace(__version__=metadata + "+cu128")) == metadata
        assert read(types.SimpleNamespace(__version__="9.9.9")) == "9.9.9"  # the cheap path: no metadata scan
    finally:
        monkeypatch.undo()
        installed_version.cache_clear()


LOCK_ORDER = r"""
import sys, threading
sys.path.insert(0, sys.argv[1])
import sync_point
from accel_npu.patching import Patch, PatchLedger

def _plus_one(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1

ledger = PatchLedger()
# the wrapper module imports slow_target, which thread "importer" is importing; slow_target's own
# patch then runs in the importer's post-import hook, holding slow_target's import lock
ledger.register(Patch(target="plain_target:f", supports="pytest>=7", reason="t", remove_when="t",
                      wrapper="wrapper_module:wrap"))
ledger.register(Patch(target="slow_target:g", supports="pytest>=7", reason="t", remove_when="t",
                      wrapper=_plus_one))
import plain_target
importer = threading.Thread(target=lambda: __import__("slow_target"), daemon=True)
importer.start()
sync_point.importer_inside.wait()
applier = threading.Thread(target=ledger.arm, daemon=True)
applier.start()
applier.join(10); importer.join(10)
if applier.is_alive() or importer.is_alive():
    print("DEADLOCK", flush=True)
    import os; os._exit(3)
import slow_target
print("RESULT", plain_target.f(), slow_target.g(), flush=True)
"""


@pytest.mark.slow
def test_a_wrapper_module_importing_a_module_another_thread_imports_does_not_deadlock(tmp_path):
    """The ledger resolves wrapper modules with its lock released (wrapt's importer.py calls hooks
    outside its lock for the same reason): a thread importing a patched module runs the ledger's
    post-import hook while it holds that module's import lock, so a ledger that imports a wrapper
    module (which imports that same module) while holding its own lock waits on the importer forever."""
    import subprocess
    import textwrap

    (tmp_path / "sync_point.py").write_text(
        "import threading\nimporter_inside = threading.Event()\nwrapper_importing = threading.Event()\n"
    )
    (tmp_path / "plain_target.py").write_text("def f():\n    return 1\n")
    (tmp_path / "slow_target.py").write_text(
        textwrap.dedent("""
        import sync_point
        sync_point.importer_inside.set()
        sync_point.wrapper_importing.wait(10)  # the applier is inside the wrapper module's import

        def g():
            return 10
        """)
    )
    (tmp_path / "wrapper_module.py").write_text(
        textwrap.dedent("""
        import sync_point
        sync_point.wrapper_importing.set()
        import slow_target  # waits for the importer thread, which finishes slow_target first

        def wrap(wrapped, instance, args, kwargs):
            return wrapped(*args, **kwargs) * 100
        """)
    )
    proc = subprocess.run(
        [sys.executable, "-c", LOCK_ORDER, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert "DEADLOCK" not in proc.stdout, "the ledger held its lock while importing a wrapper module"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("RESULT", 1)[1].split() == ["100", "11"]


def test_argument_accessors_read_and_replace_a_parameter_however_it_was_passed():
    from accel_npu.patching import argument, passed, with_argument

    def call(*args, **kwargs):  # a wrapped f(module, device_ids=None, output_device=None)
        return args, kwargs

    for args, kwargs in (call("m", [0]), call("m", device_ids=[0]), call(module="m", device_ids=[0])):
        assert argument(args, kwargs, 1, "device_ids") == [0] and passed(args, kwargs, 1, "device_ids")
        new_args, new_kwargs = with_argument(args, kwargs, 1, "device_ids", None)
        assert argument(new_args, new_kwargs, 1, "device_ids") is None
        assert len(new_args) + len(new_kwargs) == len(args) + len(kwargs)  # replaced where it was, nothing added
        assert (args, kwargs) != (new_args, new_kwargs) and argument(args, kwargs, 1, "device_ids") == [0]
    args, kwargs = call("m")
    assert argument(args, kwargs, 2, "output_device", "cpu") == "cpu" and not passed(args, kwargs, 2, "output_device")
    assert with_argument(args, kwargs, 2, "output_device", 1) == (("m",), {"output_device": 1})
