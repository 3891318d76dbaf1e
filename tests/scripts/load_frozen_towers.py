"""A diffusers-style training script under ZeRO-3 (zero3_init_flag on) loading frozen towers the
documented way: inside ``zero3_init_context_manager(enable=False)``. No accel_npu import.

Usage: load_frozen_towers.py LLAMA_CKPT   (an fp32 checkpoint; the DeepSpeed config is bf16)
"""

import json
import sys

import torch
from accelerate import Accelerator
from transformers import LlamaForCausalLM


def describe(model):
    p = next(model.parameters())
    return {"partitioned": hasattr(p, "ds_id"), "dtype": str(p.dtype), "numel": p.numel()}


def main():
    path = sys.argv[1]
    accelerator = Accelerator()
    plugin = accelerator.state.deepspeed_plugin
    with plugin.zero3_init_context_manager(enable=False):
        frozen = LlamaForCausalLM.from_pretrained(path)  # e.g. the text encoder
    frozen.requires_grad_(False)
    trained = LlamaForCausalLM.from_pretrained(path)  # the model being trained: zero.Init is right here
    rec = {"rank": accelerator.process_index, "frozen": describe(frozen), "trained": describe(trained)}
    print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
