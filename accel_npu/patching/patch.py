"""What a patch declares: its target, the versions it knows, why it exists, when it can go."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from accel_npu.patching.versions import installed_version, parse_supports, version_satisfies

Wrapper = Callable[[Callable, Any, tuple, dict], Any]

NOT_IMPORTED = "not imported"
APPLIED = "applied"
UNPATCHED = "unpatched"
DISABLED = "disabled (ACCEL_NPU_DISABLED_PATCHES)"


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
