"""Load a QwenImageTransformer2DModel the way a training script does; print one RESULT line.

No accel_npu import: this is an unchanged user script. Usage: load_qwen.py CKPT [--num-layers N]
"""

import argparse
import json
import os
import time

import torch
from diffusers import QwenImageTransformer2DModel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--num-layers", type=int, default=None)
    a = p.parse_args()
    t = time.time()
    kw = {"num_layers": a.num_layers} if a.num_layers else {}
    model = QwenImageTransformer2DModel.from_pretrained(a.path, **kw)
    rec = {
        "rank": int(os.environ.get("RANK", "0")),
        "blocks": len(model.transformer_blocks),
        "dtype": str(next(model.parameters()).dtype),
        "seconds": round(time.time() - t, 2),
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
