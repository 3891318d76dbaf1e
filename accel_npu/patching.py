"""The patch ledger: the one mechanism every accel-npu patch goes through.

A :class:`Patch` declares *what* it wraps (the defining module and qualified name), *which
versions* of the owning library it knows, *why* it exists and *when* it can go. Declaring one
changes nothing. Once the ledger is armed, a patch is applied when its target module is
imported (a wrapt post-import hook on the defining module) — or at once if it already is.

Guarantees, each covered by tests/test_patch_lifecycle.py for every patch in the ledger:
- idempotent: applying twice wraps once;
- reversible: :meth:`PatchLedger.unpatch_all` puts back the *identical* original object
  (and removes the attribute again where the original was inherited from a base class);
- queryable: each patch is "not imported", "applied", "skipped: <reason>" or "failed: <error>";
- never raises: an unknown library version, a missing attribute or a broken version string
  becomes "skipped"/"failed" with the reason, not an exception.
"""
from __future__ import annotations

import functools
import importlib.machinery
import importlib.metadata
import inspect
import re
import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import wrapt

from accel_npu import environment

log = logging.getLogger("accel_npu")

Wrapper = Callable[[Callable, Any, tuple, dict], Any]

NOT_IMPORTED = "not imported"
APPLIED = "applied"
UNPATCHED = "unpatched"


@dataclass(eq=False)
class Patch:
    """One declared patch.

    target:      "defining.module:Qualified.name" — the module that *defines* the object,
                 never a lazy re-export (diffusers swaps its package module in sys.modules).
    supports:    a requirement on the distribution that owns the target, e.g.
                 "accelerate>=1.10,<1.16". Other versions: skipped with a reason.
    reason:      the pitfall or upstream issue this patch removes.
    remove_when: the condition under which the patch can be deleted.
    wrapper:     wrapt-style ``wrapper(wrapped, instance, args, kwargs)``.
    """

    target: str
    supports: str
    reason: str
    remove_when: str
    wrapper: Wrapper
    plugin: str = ""

    # ledger-owned state
    status: str = field(default=NOT_IMPORTED, init=False)
    _parent: Any = field(default=None, init=False, repr=False)
    _attribute: str = field(default="", init=False, repr=False)
    _original: Any = field(default=None, init=False, repr=False)
    _had_own_attribute: bool = field(default=True, init=False, repr=False)
    _installed: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise ValueError(f"Patch target {self.target!r} must be 'module:qualified.name'")

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]

    @property
    def applied(self) -> bool:
        return self.status == APPLIED

    def version_problem(self) -> str | None:
        """Why the installed version is not supported, or None when it is."""
        try:
            dist, clauses = parse_supports(self.supports)
        except ValueError as exc:
            return f"unreadable version range {self.supports!r}: {exc}"
        installed = installed_version(dist)
        if installed is None:
            return f"{dist} is not installed"
        if not version_satisfies(installed, clauses):
            return f"{dist} {installed} is outside the supported range {','.join(op + v for op, v in clauses)}"
        return None


# Version ranges are checked inside `import torch`, so this avoids packaging.specifiers (whose
# regexes cost ~10-20 ms to compile) and compares with packaging.version.Version directly.
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)")
_CLAUSE = re.compile(r"\s*(~=|==|!=|>=|<=|>|<)\s*([0-9][0-9A-Za-z.+!-]*)\s*")
_COMPARE = {
    "==": lambda v, r: v == r, "!=": lambda v, r: v != r, ">=": lambda v, r: v >= r,
    "<=": lambda v, r: v <= r, ">": lambda v, r: v > r, "<": lambda v, r: v < r,
}


def parse_supports(supports: str) -> tuple[str, list[tuple[str, str]]]:
    """"accelerate>=1.10,<1.16" -> ("accelerate", [(">=", "1.10"), ("<", "1.16")])."""
    match = _NAME.fullmatch(supports)
    if not match or not match.group(2).strip():
        raise ValueError("expected 'distribution<op>version[,<op>version...]'")
    clauses = []
    for part in match.group(2).split(","):
        clause = _CLAUSE.fullmatch(part)
        if not clause:
            raise ValueError(f"cannot read the clause {part.strip()!r}")
        clauses.append((clause.group(1), clause.group(2)))
    return match.group(1), clauses


def version_satisfies(installed: str, clauses: list[tuple[str, str]]) -> bool:
    # Inside `import torch` torch's vendored copy of packaging.version is already loaded: the same
    # code, without a second import.
    vendored = sys.modules.get("torch._vendor.packaging.version")
    Version = vendored.Version if vendored is not None else importlib.import_module("packaging.version").Version

    # Local labels ("2.13.0+cpu") do not change which release it is.
    v = Version(Version(installed).public)
    for op, ref in clauses:
        r = Version(ref)
        if op == "~=":  # compatible release: >= ref, same prefix but the last component
            prefix = r.release[:-1] or r.release
            if not (v >= r and v.release[:len(prefix)] == prefix):
                return False
        elif not _COMPARE[op](v, r):
            return False
    return True


@functools.lru_cache(maxsize=None)
def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


class PatchLedger:
    def __init__(self) -> None:
        self.patches: list[Patch] = []
        self.armed = False
        self._hooked_modules: set[str] = set()
        self._lock = threading.RLock()

    # -- declaration ---------------------------------------------------------------------------
    def register(self, patch: Patch, plugin: str = "") -> Patch:
        with self._lock:
            if any(p.target == patch.target and p.plugin == (plugin or patch.plugin) for p in self.patches):
                return patch
            if plugin:
                patch.plugin = plugin
            self.patches.append(patch)
            if patch.module not in self._hooked_modules:
                self._hooked_modules.add(patch.module)
                # Registered once per module; the hook checks `armed`, so unpatch/repatch need no
                # hook bookkeeping. wrapt calls it at once if the module is already imported.
                wrapt.register_post_import_hook(self._on_import, patch.module)
            return patch

    def find(self, target: str) -> Patch | None:
        return next((p for p in self.patches if p.target == target), None)

    # -- applying ------------------------------------------------------------------------------
    def arm(self) -> None:
        with self._lock:
            self.armed = True
            for patch in self.patches:
                module = sys.modules.get(patch.module)
                if module is not None:
                    self.apply(patch, module)

    def _on_import(self, module) -> None:
        if not self.armed:
            return
        with self._lock:
            for patch in self.patches:
                if patch.module == module.__name__:
                    self.apply(patch, module)

    def apply(self, patch: Patch, module=None) -> None:
        """Apply one patch if its module is imported and its version is supported. Never raises."""
        with self._lock:
            if patch.applied:
                return
            module = module if module is not None else sys.modules.get(patch.module)
            if module is None:
                patch.status = NOT_IMPORTED
                return
            if still_importing(module) and call_when_imported(module, self._on_import):
                # e.g. `import accelerate` before torch: accelerate.accelerator imports torch (and so
                # activates us) before it defines Accelerator. Apply once its body has run.
                patch.status = NOT_IMPORTED
                return
            problem = patch.version_problem()
            if problem:
                patch.status = f"skipped: {problem}"
                self._trace(patch)
                return
            try:
                parent, attribute, original = wrapt.resolve_path(module, patch.qualname)
            except Exception as exc:
                patch.status = f"skipped: {patch.qualname} not found in {patch.module} ({exc})"
                self._trace(patch)
                return
            if original is patch._installed and patch._installed is not None:
                patch.status = APPLIED  # someone else's reload restored our wrapper; nothing to do
                return
            try:
                had_own = (attribute in vars(parent)) if inspect.isclass(parent) else True
                wrapped = wrapt.FunctionWrapper(original, patch.wrapper)
                setattr(parent, attribute, wrapped)
            except Exception as exc:
                patch.status = f"failed: {type(exc).__name__}: {exc}"
                log.warning("accel-npu: could not apply %s: %s", patch.target, patch.status)
                return
            patch._parent, patch._attribute, patch._original = parent, attribute, original
            patch._had_own_attribute, patch._installed = had_own, wrapped
            patch.status = APPLIED
            self._trace(patch)

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
                log.warning("accel-npu: %s was re-wrapped by someone else; restoring the original anyway",
                            patch.target)
            if patch._had_own_attribute:
                setattr(parent, attribute, patch._original)
            else:
                delattr(parent, attribute)
            patch._parent = patch._original = patch._installed = None
            patch.status = UNPATCHED

    def unpatch_all(self) -> None:
        with self._lock:
            self.armed = False
            for patch in reversed(self.patches):
                self.unpatch(patch)

    # -- querying ------------------------------------------------------------------------------
    def report(self) -> list[dict[str, str]]:
        return [
            {"target": p.target, "plugin": p.plugin, "supports": p.supports, "status": p.status,
             "reason": p.reason, "remove_when": p.remove_when}
            for p in self.patches
        ]


def still_importing(module) -> bool:
    """True while the module's body is still running (it is in sys.modules half-initialised)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _SpecThatReportsImported(importlib.machinery.ModuleSpec):
    """A ModuleSpec that calls back when importlib marks the module initialised.

    importlib's ``_load_unlocked`` (CPython 3.4 to 3.14) sets ``spec._initializing = True``, runs
    the module body, puts the module back in sys.modules and sets ``spec._initializing = False``
    in a ``finally``: that assignment is the one moment "this module finished importing" exists.
    """

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "_initializing" and not value:
            callbacks = self.__dict__.pop("_accel_npu_when_imported", ())
            self.__class__ = importlib.machinery.ModuleSpec  # back to a plain spec
            module = sys.modules.get(self.name)
            if module is None:  # the module body raised: nothing to patch
                return
            for callback in callbacks:
                try:
                    callback(module)
                except Exception as exc:  # noqa: BLE001 - never break someone's import
                    log.warning("accel-npu: post-import callback for %s failed: %r", self.name, exc)


def call_when_imported(module, callback: Callable[[Any], None]) -> bool:
    """Call ``callback(module)`` once the half-initialised ``module`` finishes importing.

    Returns False when that cannot be arranged (not a standard ModuleSpec), and the caller then
    goes on at once.
    """
    spec = getattr(module, "__spec__", None)
    if type(spec) is importlib.machinery.ModuleSpec:
        try:
            spec.__class__ = _SpecThatReportsImported
        except TypeError:
            return False
    elif not isinstance(spec, _SpecThatReportsImported):
        return False
    pending = spec.__dict__.setdefault("_accel_npu_when_imported", [])
    if callback not in pending:
        pending.append(callback)
    return True


_ledger = PatchLedger()


def get_ledger() -> PatchLedger:
    return _ledger


def original_of(target: str) -> Any:
    """The unwrapped original of an applied patch (for code that must bypass it)."""
    patch = _ledger.find(target)
    return patch._original if patch is not None and patch.applied else None
