"""The wrapper of ``torch.library.register_fake`` (named by path in this package's patch): while
torchvision's C++ operators are missing, the fake impls its ``_meta_registrations.py`` registers for
them are skipped (there is no operator to attach them to), with one warning naming the mismatch."""

from __future__ import annotations

from accel_npu.patching import argument

_NAMESPACE = "torchvision::"


def _operator_exists(qualname: str) -> bool:
    import torch

    name = qualname[len(_NAMESPACE) :].split(".", 1)[0]
    return hasattr(torch.ops.torchvision, name)


def _ops_missing_with_warning(op: str) -> bool:
    # imported on torchvision's first register_fake: this module loads inside `import torch`
    from accel_npu.plugins.torchvision_compat.mismatch import ops_missing, warn_once

    if ops_missing() and not _operator_exists(op):
        warn_once()
        return True
    return False


def skip_fake_impl_of_missing_torchvision_op(wrapped, instance, args, kwargs):
    op = argument(args, kwargs, 0, "op")
    func = argument(args, kwargs, 1, "func")  # positional-only: register_fake(op, func=None, /, ...)
    if isinstance(op, str) and op.startswith(_NAMESPACE) and _ops_missing_with_warning(op):
        if func is not None:  # register_fake(op, func)
            return func
        return lambda func: func  # @register_fake(op): leave the function as it is
    if func is not None:
        # register_fake(op, func) records the caller's file and line `_stacklevel` frames up; this
        # wrapper is one more frame (the decorator form registers from the caller's own frame).
        kwargs["_stacklevel"] = kwargs.get("_stacklevel", 1) + 1
    return wrapped(*args, **kwargs)
