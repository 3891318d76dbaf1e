"""Reading and replacing one argument of a wrapped call, however the caller passed it.

Wrappers see ``(args, kwargs)`` as the caller wrote them; a parameter arrives by position or by
keyword, never both (Python raises before the call). ddtrace's ``get_argument_value`` and
``set_argument_value`` (ddtrace/internal/utils/__init__.py) are the model.
"""

from __future__ import annotations

from typing import Any


def argument(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    """The value passed for parameter ``name`` (at ``position`` among the positional arguments the
    wrapper sees: ``self`` excluded for methods), or ``default`` when the caller left it out."""
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def passed(args: tuple, kwargs: dict, position: int, name: str) -> bool:
    """Whether the caller passed parameter ``name`` at all."""
    return name in kwargs or len(args) > position


def with_argument(args: tuple, kwargs: dict, position: int, name: str, value: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with parameter ``name`` set to ``value`` where the caller passed it (by
    keyword when it was left out); the caller's own tuple and dict are not changed."""
    if name not in kwargs and len(args) > position:
        return (*args[:position], value, *args[position + 1 :]), kwargs
    return args, {**kwargs, name: value}
