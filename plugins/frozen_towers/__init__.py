"""Frozen towers kept out of the DeepSpeed engine.

Under DeepSpeed, a frozen fp32 VAE / text encoder held as an attribute of the trained model is
cast to bf16 by the engine ("Input type (float) and bias type (BFloat16) should be the same")
and, under ZeRO-3, partitioned and hooked although nobody trains it. At
``accelerator.prepare`` such children are taken out of the module tree before
``deepspeed.initialize`` and kept as plain attributes (towers.py; towers built under zero.Init
are made whole first: rematerialize.py).
``ACCEL_NPU_FROZEN_MODULES`` names them explicitly ("none" turns this off).
The engines it returns are noted (``accel_npu._torch.zero.note_engine_built``): while one lives, the
loading plugin builds models whole (they can only be used outside it).

This module declares the patch and the ``accel-npu env`` section; ``towers.py`` holds the wrapper and
the section's content.
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

PREPARE_DEEPSPEED = Patch(
    target="accelerate.accelerator:Accelerator._prepare_deepspeed",
    supports="accelerate>=1.10.1,<1.17",
    reason="DeepSpeed casts a frozen fp32 VAE/text encoder held by the model to bf16 ('Input type "
    "(float) and bias type (BFloat16)'); ZeRO-3 also partitions it.",
    remove_when="DeepSpeed leaves modules without trainable parameters alone (no cast, no partitioning)",
    wrapper=".towers:prepare_deepspeed",
)


@hookimpl
def accel_npu_register_patches():
    return [PREPARE_DEEPSPEED]


@hookimpl
def accel_npu_env_report(backend):
    from accel_npu.plugins.frozen_towers import towers

    return ("frozen towers", towers.env_report())
