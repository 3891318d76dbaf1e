"""The patch ledger: the one mechanism every accel-npu patch goes through.

A :class:`~accel_npu.patching.patch.Patch` declares *what* it wraps (the defining module and
qualified name), *which versions* of the owning library it knows, *why* it exists and *when* it
can go. Declaring one changes nothing. Once the ledger is armed, a patch is applied when its
target module is imported (a wrapt post-import hook on the defining module) — or at once if it
already is, or, if that module is still importing, the moment it finishes.

Guarantees, each covered by tests/test_patch_lifecycle.py for every patch in the ledger:
- idempotent: applying twice wraps once;
- reversible: :meth:`PatchLedger.unpatch_all` puts back the *identical* original object
  (and removes the attribute again where the original was inherited from a base class);
- queryable: each patch is "not imported", "applied", "skipped: <reason>", "failed: <error>",
  "inactive here: <why>" (outside its scope, e.g. the CUDA façade in a process no launcher started),
  "not needed: <why>" (a version the patch declares stock correct) or "disabled (ACCEL_NPU_DISABLED_PATCHES)";
- transparent to TorchScript: a wrapped torch function still compiles as its aten op (torchscript.py);
- never raises: an unknown library version, a missing attribute or a broken version string
  becomes "skipped"/"failed" with the reason, not an exception.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
from typing import Any

import wrapt

from accel_npu import environment
from accel_npu.patching import torchscript
from accel_npu.patching.imports import call_when_imported, still_importing
from accel_npu.patching.patch import APPLIED, DISABLED, INACTIVE, NOT_IMPORTED, NOT_NEEDED, UNPATCHED, Patch

log = logging.getLogger("accel_npu")


class PatchLedger:
    def __init__(self) -> None:
        self.patches: list[Patch] = []
        self.armed = False
        self._hooked_modules: set[str] = set()
        self._lock = threading.RLock()
        self._scope_errors: set[str] = set()

    # -- declaration ---------------------------------------------------------------------------
    def register(self, patch: Patch, plugin: str = "", package: str = "") -> Patch:
        """Declare ``patch`` (of ``plugin``); ``package``: where its relative wrapper path is resolved,
        the declaring plugin's package (ValueError when the path is relative and there is none)."""
        patch.anchor(package)
        with self._lock:
            if any(p.target == patch.target and p.plugin == (plugin or patch.plugin) for p in self.patches):
                return patch
            if plugin:
                patch.plugin = plugin
            self.patches.append(patch)
            first_of_module = patch.module not in self._hooked_modules
            self._hooked_modules.add(patch.module)
        if first_of_module:
            # Outside the lock: wrapt calls the hook at once if the module is already imported.
            # Registered once per module; the hook checks `armed`, so unpatch/repatch need no
            # hook bookkeeping.
            wrapt.register_post_import_hook(self._on_import, patch.module)
        return patch

    def find(self, target: str) -> Patch | None:
        return next((p for p in self.patches if p.target == target), None)

    # -- applying ------------------------------------------------------------------------------
    def arm(self) -> None:
        with self._lock:
            self.armed = True
            patches = list(self.patches)
        for patch in patches:
            module = sys.modules.get(patch.module)
            if module is not None:
                self.apply(patch, module)

    def _on_import(self, module) -> None:
        if not self.armed:
            return
        with self._lock:
            patches = [p for p in self.patches if p.module == module.__name__]
        for patch in patches:
            self.apply(patch, module)

    def apply(self, patch: Patch, module=None) -> None:
        """Apply one patch if its module is imported and its version is supported. Never raises.

        The lock guards the ledger's state only. Importing a wrapper module (``Patch.wrapper`` given
        as a path) runs other modules' post-import hooks, and another thread may hold an import lock
        while its hook waits for ours: so, as wrapt's importer.py calls hooks outside its own lock,
        the wrapper is resolved with the lock released, and the target is re-checked after.
        """
        with self._lock:
            target = self._resolve(patch, module)
        if target is None:
            return
        parent, attribute, original = target
        try:
            wrapper = patch.wrapper
        except Exception as exc:  # noqa: BLE001 - a wrapper path that does not import: the patch fails, training goes on stock
            with self._lock:
                patch.status = f"failed: {type(exc).__name__}: {exc}"
            log.warning("accel-npu: could not apply %s: %s", patch.target, patch.status)
            return
        with self._lock:
            if self._resolve(patch, module) != target:
                return  # applied or changed by another thread meanwhile: its outcome stands
            try:
                had_own = (attribute in vars(parent)) if inspect.isclass(parent) else True
                wrapped = wrapt.FunctionWrapper(original, wrapper)
                setattr(parent, attribute, wrapped)
                torchscript.wrapper_installed(original, wrapped)
            except Exception as exc:  # noqa: BLE001 - a target that cannot be wrapped: recorded as failed, left stock
                patch.status = f"failed: {type(exc).__name__}: {exc}"
                log.warning("accel-npu: could not apply %s: %s", patch.target, patch.status)
                return
            patch._parent, patch._attribute, patch._original = parent, attribute, original
            patch._had_own_attribute, patch._installed = had_own, wrapped
            patch.status = APPLIED
            self._trace(patch)

    def _resolve(self, patch: Patch, module):
        """(parent, attribute, original) when ``patch`` should be applied now, else None with its
        status set. Called with the lock held."""
        if patch.applied:
            return None
        module = module if module is not None else sys.modules.get(patch.module)
        if module is None:
            patch.status = NOT_IMPORTED
            return None
        if still_importing(module) and call_when_imported(module, self._on_import):
            # e.g. `import accelerate` before torch: accelerate.accelerator imports torch (and so
            # activates us) before it defines Accelerator. Apply once its body has run.
            patch.status = NOT_IMPORTED
            return None
        if patch.target in environment.disabled_patches():
            patch.status = DISABLED
            self._trace(patch)
            return None
        needless = patch.not_needed()
        if needless:
            patch.status = f"{NOT_NEEDED}: {needless}"
            self._trace(patch)
            return None
        problem = patch.version_problem()
        if problem:
            patch.status = f"skipped: {problem}"
            self._trace(patch)
            return None
        try:
            off = patch.scope_problem()
        except Exception as exc:  # noqa: BLE001 - e.g. an unreadable ACCEL_NPU_CUDA_FACADE: named once, never raised
            patch.status = f"failed: {type(exc).__name__}: {exc}"
            if patch.status not in self._scope_errors:
                self._scope_errors.add(patch.status)
                log.warning("accel-npu: %s patches not applied: %s", patch.scope.name, patch.status)
            return None
        if off:
            patch.status = f"{INACTIVE}: {off}"
            self._trace(patch)
            return None
        try:
            parent, attribute, original = wrapt.resolve_path(module, patch.qualname)
        except Exception as exc:  # noqa: BLE001 - wrapt raises whatever the attribute lookup raises: skipped with the reason
            patch.status = f"skipped: {patch.qualname} not found in {patch.module} ({exc})"
            self._trace(patch)
            return None
        if original is patch._installed and patch._installed is not None:
            patch.status = APPLIED  # someone else's reload restored our wrapper; nothing to do
            return None
        return parent, attribute, original

    def _trace(self, patch: Patch) -> None:
        if environment.flag("ACCEL_NPU_TRACE"):
            sys.stderr.write(f"[accel-npu trace] patch {patch.target} ({patch.plugin}): {patch.status}\n")

    # -- undoing -------------------------------------------------------------------------------
    def unpatch(self, patch: Patch) -> None:
        with self._lock:
            if not patch.applied:
                return
            parent, attribute = patch._parent, patch._attribute
            current = inspect.getattr_static(parent, attribute, None)
            if current is not patch._installed:
                log.warning("accel-npu: %s was re-wrapped by someone else; restoring the original anyway", patch.target)
            if patch._had_own_attribute:
                setattr(parent, attribute, patch._original)
            else:
                delattr(parent, attribute)
            torchscript.wrapper_removed(patch._original, patch._installed)
            patch._parent = patch._original = patch._installed = None
            patch.status = UNPATCHED

    def unpatch_all(self) -> None:
        with self._lock:
            self.armed = False
            for patch in reversed(self.patches):
                self.unpatch(patch)

    # -- querying ------------------------------------------------------------------------------
    def outside_their_range(self) -> list[Patch]:
        """Declared patches the installed libraries' versions leave off (asked of the installed
        metadata: no import), e.g. every accelerate patch under an accelerate newer than they know."""
        return [p for p in self.patches if p.installed_outside_range()]

    def report(self) -> list[dict[str, str]]:
        return [
            {
                "target": p.target,
                "plugin": p.plugin,
                "supports": p.supports,
                "status": _reported_status(p),
                "reason": p.reason,
                "remove_when": p.remove_when,
                **({"stock_correct": p.stock_correct} if p.stock_correct else {}),
            }
            for p in self.patches
        ]


def _reported_status(patch: Patch) -> str:
    """The patch's status; "not needed" for one not imported at a release it declares stock correct, where its
    module may not even exist (deepspeed.runtime.sequence_parallel before 0.18.2) and would never be patched."""
    if patch.status == NOT_IMPORTED:
        needless = patch.not_needed()
        if needless:
            return f"{NOT_NEEDED}: {needless}"
    return patch.status


_ledger = PatchLedger()


def get_ledger() -> PatchLedger:
    return _ledger


def original_of(target: str) -> Any:
    """The unwrapped original of an applied patch (for code that must bypass it)."""
    patch = _ledger.find(target)
    return patch._original if patch is not None and patch.applied else None
