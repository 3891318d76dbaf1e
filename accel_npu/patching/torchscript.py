"""TorchScript keeps compiling a patched torch function as the aten op it is.

``torch.jit.script`` resolves a global such as ``torch.stack`` by identity: ``torch/jit/_builtins.py``
maps ``id(function)`` to its aten op (``_find_builtin``), in a table built once, the first time
something is scripted. A wrapper is another object, so a script calling ``torch.stack`` would meet it
as an unknown Python callable and fail to compile ("Expected a value of type 'Tensor' for argument
'0' but instead found type 'List[Tensor]'"). The ledger therefore gives each wrapper its original's
entry when it installs the wrapper, and gives the entry back to the original when it removes it (a
table built while the wrapper was installed holds the wrapper's id only). Scripted code then calls
the aten op directly, as stock does: wrappers never run inside TorchScript.
"""
from __future__ import annotations

import sys


def _table():
    """TorchScript's builtin table, or None while it has not been built (nothing to keep in step:
    when it is built, it reads torch's attributes as they are then)."""
    builtins = sys.modules.get("torch.jit._builtins")
    return getattr(builtins, "_builtin_table", None)


def wrapper_installed(original, installed) -> None:
    table = _table()
    if table is not None and id(original) in table:
        table[id(installed)] = table[id(original)]


def wrapper_removed(original, installed) -> None:
    table = _table()
    if table is None:
        return
    op = table.pop(id(installed), None)
    if op is not None:
        table.setdefault(id(original), op)
