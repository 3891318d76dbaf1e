"""torchvision beside a torch build its wheel was not made for.

PyPI's x86-64 torchvision wheels are CUDA builds: beside torch's CPU build (the one torch_npu
runs on, and the one CPU debugging uses) their C++ library cannot load (``libc10_cuda.so``
missing). torchvision means to carry on without it — ``extension._has_ops()`` turns False and
``torchvision.ops`` raise "Couldn't load custom C++ ops" when called — but
``torchvision/_meta_registrations.py`` registers the fake impls of ``torchvision::nms`` and
``qnms`` unguarded, so ``import torchvision`` itself dies with "operator torchvision::nms does
not exist" (pytorch/vision#9085; the guard, pytorch/vision#9086, was closed unmerged). Every
script that only wants ``torchvision.transforms`` is stopped, and so is ``import transformers``'s
model code, which imports torchvision whenever it is installed.

Here, while torchvision's operators are missing, their fake-impl registration is skipped (there
is no operator to attach it to) and one warning names the mismatch and the wheel to install;
calling an operator still raises torchvision's own "Couldn't load custom C++ ops" error. With a
matching torchvision the registrations pass straight through.
"""
from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch, argument

_NAMESPACE = "torchvision::"


def _operator_exists(qualname: str) -> bool:
    import torch

    name = qualname[len(_NAMESPACE):].split(".", 1)[0]
    return hasattr(torch.ops.torchvision, name)


def _ops_missing_with_warning(op: str) -> bool:
    # imported on torchvision's first register_fake: plugin modules load inside `import torch`
    from accel_npu.plugins.torchvision_compat.mismatch import ops_missing, warn_once

    if ops_missing() and not _operator_exists(op):
        warn_once()
        return True
    return False


def _skip_fake_impl_of_missing_torchvision_op(wrapped, instance, args, kwargs):
    op = argument(args, kwargs, 0, "op")
    if isinstance(op, str) and op.startswith(_NAMESPACE) and _ops_missing_with_warning(op):
        if len(args) > 1 and args[1] is not None:  # register_fake(op, func)
            return args[1]
        return lambda func: func  # @register_fake(op): leave the function as it is
    if len(args) > 1 and args[1] is not None:
        # register_fake(op, func) records the caller's file and line `_stacklevel` frames up; this
        # wrapper is one more frame (the decorator form registers from the caller's own frame).
        kwargs["_stacklevel"] = kwargs.get("_stacklevel", 1) + 1
    return wrapped(*args, **kwargs)


FAKE_IMPL_OF_MISSING_OPS = Patch(
    target="torch.library:register_fake",
    supports="torch>=2.4,<2.15",
    reason="A torchvision wheel built for another torch dies on import: 'operator torchvision::nms does "
           "not exist' (pytorch/vision#9085); its fake impls are skipped.",
    remove_when="torchvision/_meta_registrations.py guards register_fake with extension._has_ops()",
    wrapper=_skip_fake_impl_of_missing_torchvision_op,
)


@hookimpl
def accel_npu_register_patches():
    return [FAKE_IMPL_OF_MISSING_OPS]
