"""What a patch declares: its target, the versions it knows, why it exists, when it can go."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from accel_npu.patching.scope import Scope
from accel_npu.patching.versions import installed_version, parse_supports, version_satisfies

Wrapper = Callable[[Callable, Any, tuple, dict], Any]

NOT_IMPORTED = "not imported"
APPLIED = "applied"
UNPATCHED = "unpatched"
DISABLED = "disabled (ACCEL_NPU_DISABLED_PATCHES)"
INACTIVE = "inactive here"
NOT_NEEDED = "not needed"


class Patch:
    """One declared patch.

    target:      "defining.module:Qualified.name" — the module that *defines* the object,
                 never a lazy re-export (diffusers swaps its package module in sys.modules).
    supports:    a requirement on the distribution that owns the target, e.g.
                 "accelerate>=1.10,<1.16". Other versions: skipped with a reason.
    reason:      the pitfall or upstream issue this patch removes.
    remove_when: the condition under which the patch can be deleted.
    wrapper:     wrapt-style ``wrapper(wrapped, instance, args, kwargs)``, or its import path:
                 ".module:function", relative to the package of the plugin that declares the patch
                 (resolved when the ledger registers it, see :meth:`anchor`), or absolute,
                 "package.module:function". A path is imported only when the patch is applied —
                 when the target's module is imported — so declaring a patch costs nothing
                 inside ``import torch``.
    scope:       optional :class:`~accel_npu.patching.scope.Scope`: the processes the patch applies in
                 (elsewhere its status is "inactive here: <why>" and the target stays stock).
    stock_correct: optional requirement on the same distribution, e.g. "deepspeed<0.19": the versions
                 where the defect does not exist (it came with a later release). There the patch is
                 "not needed: ...", neither applied nor counted as a version the patch lacks.

    A plain class, not a dataclass: plugins declare patches inside ``import torch``, and a
    dataclass's generated methods cost an ``exec`` per class there.
    """

    __slots__ = (
        "target",
        "supports",
        "reason",
        "remove_when",
        "wrapper_path",
        "_wrapper",
        "plugin",
        "scope",
        "stock_correct",
        "status",
        "_parent",
        "_attribute",
        "_original",
        "_had_own_attribute",
        "_installed",
    )

    def __init__(
        self,
        target: str,
        supports: str,
        reason: str,
        remove_when: str,
        wrapper: Wrapper | str,
        plugin: str = "",
        scope: Scope | None = None,
        stock_correct: str = "",
    ) -> None:
        if ":" not in target:
            raise ValueError(f"Patch target {target!r} must be 'module:qualified.name'")
        if isinstance(wrapper, str) and ":" not in wrapper:
            raise ValueError(f"Patch wrapper {wrapper!r} must be a callable or 'module:function'")
        self.target, self.supports, self.reason, self.remove_when = target, supports, reason, remove_when
        # The declared path stays readable after the wrapper is resolved (accel-npu env, tests).
        self.wrapper_path = wrapper if isinstance(wrapper, str) else ""
        self._wrapper, self.plugin, self.scope = wrapper, plugin, scope
        if stock_correct and parse_supports(stock_correct)[0] != parse_supports(supports)[0]:
            raise ValueError(
                f"Patch {target!r}: stock_correct {stock_correct!r} names another distribution "
                f"than supports {supports!r}"
            )
        self.stock_correct = stock_correct
        # ledger-owned state
        self.status = NOT_IMPORTED
        self._parent: Any = None
        self._attribute = ""
        self._original: Any = None
        self._had_own_attribute = True
        self._installed: Any = None

    def __repr__(self) -> str:
        return f"Patch(target={self.target!r}, plugin={self.plugin!r}, status={self.status!r})"

    def anchor(self, package: str) -> None:
        """Resolve a relative wrapper path (".module:function") in ``package``, the declaring plugin's
        package, to the absolute one; ValueError naming the patch when there is no package to resolve it in."""
        if not self.wrapper_path.startswith("."):
            return
        if not package:
            raise ValueError(
                f"Patch {self.target!r}: wrapper {self.wrapper_path!r} is relative to its plugin's package, "
                "but the patch was registered without one (name it absolutely, 'package.module:function')"
            )
        module, _, name = self.wrapper_path.partition(":")
        self.wrapper_path = self._wrapper = f"{importlib.util.resolve_name(module, package)}:{name}"

    @property
    def wrapper(self) -> Wrapper:
        """The wrapper function (importing its module the first time, when given as a path)."""
        if isinstance(self._wrapper, str):
            self.anchor("")  # a relative path nobody resolved: the error names the patch
            module, _, name = self.wrapper_path.partition(":")
            obj: Any = importlib.import_module(module)
            for part in name.split("."):
                obj = getattr(obj, part)
            self._wrapper = obj
        return self._wrapper

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]

    @property
    def applied(self) -> bool:
        return self.status == APPLIED

    def scope_problem(self) -> str | None:
        """Why this process is outside the patch's scope, or None (no scope, or inside it)."""
        return None if self.scope is None else self.scope.why_not()

    def _installed_against_range(self):
        """(distribution, its installed version or None, the range's clauses); ValueError when unreadable."""
        dist, clauses = parse_supports(self.supports)
        return dist, installed_version(dist), clauses

    def not_needed(self) -> str | None:
        """Why the installed version needs no patch (it is in ``stock_correct``), or None."""
        if not self.stock_correct:
            return None
        dist, clauses = parse_supports(self.stock_correct)
        installed = installed_version(dist)
        if installed is None or not version_satisfies(installed, clauses):
            return None
        return f"{dist} {installed} is in {self.stock_correct}, where stock has no such defect"

    def version_problem(self) -> str | None:
        """Why the installed version is not supported, or None when it is."""
        try:
            dist, installed, clauses = self._installed_against_range()
        except ValueError as exc:
            return f"unreadable version range {self.supports!r}: {exc}"
        if installed is None:
            return f"{dist} is not installed"
        if not version_satisfies(installed, clauses):
            return f"{dist} {installed} is outside the supported range {','.join(op + v for op, v in clauses)}"
        return None

    def installed_outside_range(self) -> str | None:
        """ "<distribution> <version>" when that distribution is installed at a version outside the range
        (not when it is absent or the range unreadable), else None."""
        try:
            dist, installed, clauses = self._installed_against_range()
        except ValueError:
            return None
        if installed is None or version_satisfies(installed, clauses) or self.not_needed():
            return None
        return f"{dist} {installed}"
