"""Between ``accelerator.backward`` and ``optimizer.step()``: the whole gradient of a parameter whose gradient
DeepSpeed holds in its partitions, shown as ``param.grad`` when the script reads it, and what the script leaves
there written back before the step.

Under DDP, for which diffusers' scripts are written, ``param.grad`` after the backward is the whole averaged gradient
and a script may edit it before the step: custom_diffusion/train_custom_diffusion.py zeroes the embedding rows of all
but its new tokens (lines 1192-1205). DeepSpeed ZeRO-1/2 keeps a whole parameter's gradient in its optimizer's flat
partitions, ZeRO-3 the parameter too (outside a forward its ``.data`` is a shape-[0] placeholder); either way
``param.grad`` is None there ("'NoneType' object has no attribute 'data'"). DeepSpeed's own accessors are
``deepspeed.utils.safe_get_full_grad`` / ``safe_set_full_grad`` (utils/tensor_fragment.py; ZeRO-3:
stage3.py ``get_fp32_grad_for_param`` / ``set_fp32_grad_for_param``), collectives over the data-parallel group.
torch hangs a gradient on a parameter of its own shape only ("assigned grad has data of a different size"), so under
ZeRO-3 the parameter is gathered, read-only (``deepspeed.zero.GatheredParameters``, ``modifier_rank=None``), for as
long as its gradient is shown, and partitioned again before the step.

Only what the script reads is shown. After a backward at an accumulation boundary each trainable parameter whose
gradient DeepSpeed holds elsewhere is *offered*: its class becomes, until the step, a subclass of its own whose
``grad`` getter shows the gradient at the first read and then gives the parameter its own class back. A job that never
reads a gradient pays the class swaps alone; one that reads one embedding's gradient gathers that embedding and its
gradient, nothing else (the other trainable parameters stay partitioned).

A read is a collective, so every rank reads the same parameters in the same order, as a script's own lines between
backward and step do. The first read of a window meets the other ranks over the process group's store
(``accel_npu._torch.dist.rendezvous``: a read some ranks skip is one clear error within
``ACCEL_NPU_COLLECTIVE_TIMEOUT``, not a hang); a read under ``if accelerator.is_main_process:`` gets None, as stock,
with one warning.

Written back at ``optimizer.step()`` (``safe_set_full_grad``) in the dtype DeepSpeed accumulates in: where that is
wider than the parameter (bf16 weights over an fp32 accumulation, shown in bf16 as a bf16 ``param.grad`` is) only the
elements the script changed take the value it left; the others keep DeepSpeed's. A gradient the script set to None is
zero. Under ZeRO-3 the value is padded to the partitions' whole length first: ``set_fp32_grad_for_param`` narrows the
last rank's share from the unpadded gradient (stage3.py), out of range where the size does not divide evenly.
"""

from __future__ import annotations

import logging

from accel_npu import environment
from accel_npu._torch import dist
from accel_npu._torch.callsite import guarded_caller, user_frame
from accel_npu._torch.once import FirstTime

log = logging.getLogger("accel_npu")

#: a parameter's instance-dict key while it is offered: the window that shows its gradient
_WINDOW = "_accel_npu_gradient_window"
_offered_classes: dict = {}
_first = FirstTime()


def _offered_class(cls):
    """``cls`` (torch.nn.Parameter or a subclass) with a ``grad`` getter that shows the gradient DeepSpeed holds."""
    offered = _offered_classes.get(cls)
    if offered is not None:
        return offered
    import torch

    tensor_grad = torch._C.TensorBase.grad  # torch's own getset descriptor, below every Python subclass

    def get(param):
        grad = tensor_grad.__get__(param)
        if grad is None:
            window = param.__dict__.get(_WINDOW)
            if window is not None:
                grad = window.show(param)
        return grad

    def set_(param, value):
        tensor_grad.__set__(param, value)

    def delete(param):
        tensor_grad.__delete__(param)

    offered = type(
        cls.__name__,
        (cls,),
        {
            "grad": property(get, set_, delete, doc="torch's grad; DeepSpeed's whole gradient at the first read"),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        },
    )
    _offered_classes[cls] = offered
    return offered


def _held_elsewhere(param) -> bool:
    """A trainable parameter whose gradient DeepSpeed keeps in its optimizer's partitions (``param.grad`` None)."""
    import torch

    if not param.requires_grad or torch._C.TensorBase.grad.__get__(param) is not None:
        return False
    # ZeRO-3 (ds_id) or ZeRO-1/2 and the bf16 optimizer (_hp_mapping, None where the parameter lies outside
    # this rank's partition: it still takes part in the collective)
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


class GradientWindow:
    """The gradients of one backward at an accumulation boundary, offered to the script until the step."""

    def __init__(self):
        self.offered: dict = {}  # {id(param): (param, its own class)}
        self.shown: list = []  # [(param, DeepSpeed's whole gradient, the gather holding the parameter or None)]
        self.met = False  # the first read met the other ranks

    @classmethod
    def open(cls, module) -> GradientWindow:
        """Offer the gradient of every trainable parameter of ``module`` that DeepSpeed holds elsewhere."""
        window = cls()
        for param in module.parameters():
            if _held_elsewhere(param):
                own = type(param)
                param.__class__ = _offered_class(own)
                param.__dict__[_WINDOW] = window
                window.offered[id(param)] = (param, own)
        return window

    def _withdraw(self, param) -> None:
        entry = self.offered.pop(id(param), None)
        if entry is not None:
            param.__class__ = entry[1]
            param.__dict__.pop(_WINDOW, None)

    def show(self, param):
        """The whole gradient of ``param`` as its ``.grad`` (None where it cannot be shown on this rank alone)."""
        if not self._may_show():
            return None  # still offered: a read every rank makes later shows it
        self._withdraw(param)
        from deepspeed.utils import safe_get_full_grad

        gathered = None
        with dist.every_rank_collectives():
            if hasattr(param, "ds_id"):
                from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

                if param.ds_status == ZeroParamStatus.NOT_AVAILABLE:  # else whole already (persistent, gathered)
                    gathered = GatheredParameters([param], modifier_rank=None)
                    gathered.__enter__()
            whole = safe_get_full_grad(param)
        if whole is None:
            self._release(gathered)
            return None
        whole = whole.reshape(param.shape)
        # the parameter's dtype, as torch requires of .grad (safe_get_full_grad upcasts its copy)
        shown = whole if whole.dtype == param.dtype else whole.to(param.dtype)
        param.grad = shown
        self.shown.append((param, whole, gathered))
        return shown

    def _may_show(self) -> bool:
        if self.met:
            return True
        import sys

        site, guard = guarded_caller(sys._getframe(1))
        if guard is not None:
            if _first(("guarded", site)):
                log.warning(
                    "accel-npu: %s:%d reads a parameter's .grad between accelerator.backward() and optimizer.step() "
                    "inside `%s` (line %d): DeepSpeed holds that gradient in every rank's partitions, and gathering "
                    "it is a collective the other ranks do not join, so this rank gets None, as stock. Read it on "
                    "every rank.",
                    site[0],
                    site[1],
                    guard[1],
                    guard[0],
                )
            return False

        def advice() -> str:
            where = user_frame()
            at = f"{where[0]}:{where[1]} " if where else "The script "
            return (
                f"{at}reads a parameter's .grad between accelerator.backward() and optimizer.step(); DeepSpeed holds "
                "it in every rank's partitions, so each read is a collective: make it on every rank, or on none."
            )

        dist.rendezvous(
            "shown_gradient",
            environment.seconds("ACCEL_NPU_COLLECTIVE_TIMEOUT"),
            advice,
            call="reading param.grad between accelerator.backward() and optimizer.step()",
            stock="Stock DeepSpeed hands this rank None here.",
        )
        self.met = True
        where = user_frame()
        if _first(("shown", where)):
            log.info(
                "accel-npu: %s reads a parameter's .grad between accelerator.backward() and optimizer.step(): "
                "DeepSpeed's whole gradient (safe_get_full_grad) is shown there and written back before the step.",
                f"{where[0]}:{where[1]}" if where else "the script",
            )
        return True

    def close(self) -> None:
        """Before the step: every parameter its own class again, and each shown gradient, as the script left it,
        written back into DeepSpeed's partitions."""
        offered, self.offered = self.offered, {}
        for param, own in offered.values():
            param.__class__ = own
            param.__dict__.pop(_WINDOW, None)
        shown, self.shown = self.shown, []
        for param, whole, gathered in shown:
            left = param.grad
            param.grad = None  # safe_set_full_grad writes into param.grad when there is one
            self._release(gathered)
            _write_back(param, _merged(left, whole))

    @staticmethod
    def _release(gathered) -> None:
        if gathered is not None:
            with dist.every_rank_collectives():  # DeepSpeed's sanity checks, when on, all-reduce here
                gathered.__exit__(None, None, None)


def _merged(left, whole):
    """What to write back: ``left`` (the script's ``param.grad``) in the dtype of DeepSpeed's ``whole``, its
    unchanged elements DeepSpeed's own where ``left`` is narrower."""
    import torch

    if left is None:
        return torch.zeros_like(whole)
    if left.dtype == whole.dtype:
        return left
    changed = left != whole.to(left.dtype)
    return torch.where(changed, left.to(whole.dtype), whole)


def _write_back(param, value) -> None:
    from deepspeed.utils import safe_set_full_grad

    if hasattr(param, "ds_id"):
        import torch.distributed

        length = param.partition_numel() * torch.distributed.get_world_size(group=param.ds_process_group)
        padded = value.new_zeros(length)
        padded[: value.numel()] = value.reshape(-1)
        value = padded
    safe_set_full_grad(param, value)
