"""TorchScript keeps compiling a patched torch function as the aten op it is.

``torch.jit.script`` resolves a global such as ``torch.stack`` by identity: ``torch/jit/_builtins.py``
maps ``id(function)`` to its aten op (``_find_builtin``), in a table built once, the first time
something is scripted. A wrapper is another object, so a script calling ``torch.stack`` would meet it
as an unknown Python callable and fail to compile ("Expected a value of type 'Tensor' for argument
'0' but instead found type 'List[Tensor]'"). The ledger therefore gives each wrapper its original's
entry when it installs the wrapper, and gives the entry back to the original when it removes it (a
table built while the wrapper was installed holds the wrapper's id only). Scripted code then calls
the aten op directly, as stock does: wrappers never run inside TorchScript.

A table built while someone else's function held the name holds neither: ``deepspeed.zero.Init``
swaps ``torch.zeros``/``empty``/``ones``/``full``/``tensor`` for its own wrappers while a model is built
(``deepspeed/runtime/zero/partition_parameters.py``), and anything scripted in there builds the table. The
entry is then derived as the table derives it, from the name the function has in torch's builtin
modules (``register_all`` in ``torch/jit/_builtins.py``).
"""

from __future__ import annotations

import sys


def _builtins():
    return sys.modules.get("torch.jit._builtins")


def _table():
    """TorchScript's builtin table, or None while it has not been built (nothing to keep in step:
    when it is built, it reads torch's attributes as they are then)."""
    return getattr(_builtins(), "_builtin_table", None)


def _op_by_name(function) -> str | None:
    """The aten op torch's table would give ``function`` if it were built now: ``aten::<name>`` where one of
    torch's builtin modules holds ``function`` under its own name."""
    name = getattr(function, "__name__", None)
    modules = getattr(_builtins(), "_modules_containing_builtins", ())
    if not isinstance(name, str) or not any(getattr(m, name, None) is function for m in modules):
        return None
    return "aten::" + ("segment_reduce" if name == "_segment_reduce" else name)  # torch's own fix-up


def wrapper_installed(original, installed) -> None:
    table = _table()
    if table is None:
        return
    op = table.get(id(original)) or _op_by_name(installed)
    if op is not None:
        # kept alive for the process, as torch keeps its own entries' functions (``_builtin_ops``): an id is
        # reused once its object is freed, and a removed wrapper can come back (deepspeed.zero.Init puts back
        # the torch.zeros it saved at import on exit, partition_parameters.py), so its entry stays
        _builtins()._builtin_ops.append((installed, op))
        table[id(installed)] = op


def wrapper_removed(original, installed) -> None:
    table = _table()
    if table is None:
        return
    op = table.get(id(installed)) or _op_by_name(original)
    if op is not None:
        table.setdefault(id(original), op)
