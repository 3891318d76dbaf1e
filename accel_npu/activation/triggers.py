"""When ``import torch`` activates at once, and when activation waits for the stack it patches.

Every process that imports torch pays for what happens inside ``import torch`` — inductor's
compile workers, DataLoader workers, tools, a quick ``python -c`` — while accel-npu's patches
matter only where Accelerate, DeepSpeed, diffusers, transformers, peft, torchvision, decord or
torchrun are used, or on an Ascend machine. So ``import torch`` activates at once only when

- one of :data:`TRIGGER_MODULES` is already being imported (e.g. ``import accelerate`` before
  torch: accelerate's own ``import torch`` is what runs us),
- torch_npu is imported or installed (an Ascend machine: the NPU plugin diagnoses its import and
  ``autocast("cuda")`` must reach the NPU in any script), or
- the process is a launched rank (``LOCAL_RANK`` set by torchrun / ``accelerate launch`` /
  the DeepSpeed launcher): a training worker, whatever it imports, or
- a third-party plugin is installed (entry-point group ``accel_npu``): it may patch anything, so
  its targets cannot wait for ours (the lookup reads each distribution's entry_points.txt, ~1 ms);

and otherwise puts :class:`_ActivateOnImport` on ``sys.meta_path``: the first import of a trigger
module activates — before that module's body runs, so its patches (and the torch ones) are in
place when it is used. The finder only compares names; it never finds anything itself.

tests/test_activation.py checks that every declared patch's module is a trigger module (or inside
one), or part of torch itself (applied with the first trigger, or at once in a worker).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

#: Third-party plugins' entry-point group (the plugin manager loads them from it).
PLUGIN_ENTRY_POINT_GROUP = "accel_npu"

#: Importing any of these (or, for the dotted ones, that subpackage) activates accel-npu.
#: ``torch.distributed.launcher`` is what ``torchrun`` imports; ``torch_npu`` and ``mx_driving``
#: are imported by NPU scripts (usually torch_npu is already imported by torch's autoload).
TRIGGER_MODULES = frozenset(
    {
        "accelerate",
        "deepspeed",
        "diffusers",
        "transformers",
        "peft",
        "safetensors",
        "torchvision",
        "decord",
        "torch_npu",
        "mx_driving",
        "torch.distributed.launcher",
    }
)


def activate_now(
    modules=None,
    environ=None,
    npu_installed: Callable[[], bool] | None = None,
    third_party_plugins: Callable[[], bool] | None = None,
) -> bool:
    """True when ``import torch`` should activate at once (see the module docstring)."""
    modules = sys.modules if modules is None else modules
    if any(name in modules for name in TRIGGER_MODULES):
        return True
    if environ is None:
        import os

        environ = os.environ
    if environ.get("LOCAL_RANK", "") != "":
        return True
    if (npu_installed or _torch_npu_installed)():
        return True
    return (third_party_plugins or third_party_plugins_declared)()


def _torch_npu_installed() -> bool:
    # A spec lookup, not an import: FileFinder's directory caches make it a few dict probes.
    import importlib.util

    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def third_party_plugins_declared() -> bool:
    """Does any installed distribution declare the :data:`PLUGIN_ENTRY_POINT_GROUP` group?

    A substring check of each distribution's ``entry_points.txt`` (~1 ms): parsing every
    distribution's entry points (``importlib.metadata.entry_points``) costs several times that,
    and the group is empty almost everywhere. The plugin manager parses them only when this says
    yes. Unreadable metadata counts as yes (the parse then reports it).
    """
    from importlib.metadata import distributions

    header = f"[{PLUGIN_ENTRY_POINT_GROUP}]"  # a section header, as importlib.metadata reads it
    try:
        for dist in distributions():
            text = dist.read_text("entry_points.txt")
            if text and header in text:
                return True
    except Exception:  # noqa: BLE001 - broken metadata of some distribution
        return True
    return False


class _ActivateOnImport:
    """A ``sys.meta_path`` entry that activates accel-npu at the first import of a trigger module.

    It finds nothing (``find_spec`` always returns None): it activates — which registers the
    patches' own post-import hooks — and lets the normal finders import the module. Once fired it
    stays on ``sys.meta_path``, inert: removing it while importlib walks that list would make the
    walk skip the next finder (an editable install's, say).
    """

    def __init__(self, activate: Callable[[], object]) -> None:
        self._activate = activate
        self._lock = threading.Lock()
        self.waiting = True

    def find_spec(self, fullname, path=None, target=None):
        if not self.waiting or fullname not in TRIGGER_MODULES:
            return None
        with self._lock:
            if not self.waiting:
                return None
            self.waiting = False
        self._activate()  # never raises (activate(strict=False))
        return None

    def __repr__(self) -> str:
        state = "waiting for" if self.waiting else "fired; was waiting for"
        return f"<accel-npu activation: {state} the first import of {', '.join(sorted(TRIGGER_MODULES))}>"


def activate_on_first_trigger(activate: Callable[[], object]) -> None:
    """Put the trigger finder first on ``sys.meta_path`` (once per process)."""
    if not pending():
        sys.meta_path.insert(0, _ActivateOnImport(activate))


def _finders() -> list:
    return [finder for finder in sys.meta_path if isinstance(finder, _ActivateOnImport)]


def pending() -> bool:
    """True while activation waits for a trigger import (a finder is on ``sys.meta_path``, not yet fired)."""
    return any(finder.waiting for finder in _finders())


def stop_waiting() -> None:
    """Activation happened some other way: a later trigger import must not re-arm after unpatch()."""
    for finder in _finders():
        finder.waiting = False
