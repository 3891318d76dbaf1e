"""The wrapper of ``sys.excepthook`` (named by path in this package's patch): after Python's traceback,
the plugins' lines for the error (the ``accel_npu_explain_error`` hook)."""

from __future__ import annotations

import sys

from accel_npu.patching import argument


def explanations(error: BaseException) -> list[str]:
    """The plugins' lines for ``error``, each once; none for an interrupt or an exit."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return []
    from accel_npu.manager import get_plugin_manager

    lines = get_plugin_manager().hook.accel_npu_explain_error(error=error)
    return list(dict.fromkeys(line for line in lines if line))


def excepthook(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    error = argument(args, kwargs, 1, "value")
    try:
        lines = explanations(error) if isinstance(error, BaseException) else []
    except Exception:  # noqa: BLE001 - an explanation must never hide the error itself
        return
    for line in lines:
        sys.stderr.write(f"accel-npu: {line}\n")
    sys.stderr.flush()
