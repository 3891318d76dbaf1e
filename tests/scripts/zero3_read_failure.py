"""Rank 0 meets a shard that broke after validation while loading into ZeRO-3 partitions.

Fault injection: once accel-npu has validated the checkpoint, rank 0 truncates one of the shards
it is about to read (as a disk or a concurrent writer would). Every rank must fail with a clear
LoadError, none may hang in the broadcast. Usage (torchrun): zero3_read_failure.py CKPT_COPY
"""

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from diffusers import QwenImageTransformer2DModel

import accel_npu.plugins.loading.diffusers as loading
from accel_npu.errors import LoadError


def main():
    path = sys.argv[1]
    ds = {
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
    }
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds, zero3_init_flag=True))
    validate = loading.validate

    def validate_then_break(ckpt, keys):
        needed = validate(ckpt, keys)
        accelerator.wait_for_everyone()  # every rank has validated the intact files
        if accelerator.is_main_process:
            victim = ckpt.path(needed[-1])
            os.truncate(victim, os.path.getsize(victim) // 2)
        return needed

    loading.validate = validate_then_break
    try:
        QwenImageTransformer2DModel.from_pretrained(path)
        outcome = {"ok": True}
    except LoadError as exc:
        outcome = {"ok": False, "error": str(exc)}
    print("RESULT " + json.dumps({"rank": accelerator.process_index, **outcome}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
