"""Where a family of patches applies: a condition on the process, checked beside the version range.

A patch with a scope is applied only in the processes its scope admits; elsewhere its status says
why not ("inactive here: ...") and the target stays the library's own object. The torch.cuda façade
is the example: it answers for the user's script in launched ranks, and is absent from a pytest run
or a notebook that merely imports diffusers (accel_npu/scopes.py).
"""

from __future__ import annotations

from collections.abc import Callable


class Scope:
    """A named condition. ``why_not()`` returns None where the patches apply, else the reason they
    stay off in this process (one line of ``accel-npu env``). A plain class: declared inside
    ``import torch``."""

    __slots__ = ("name", "why_not")

    def __init__(self, name: str, why_not: Callable[[], str | None]) -> None:
        self.name, self.why_not = name, why_not

    def __repr__(self) -> str:
        return f"Scope({self.name!r})"
