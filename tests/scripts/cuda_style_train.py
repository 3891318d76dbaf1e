"""A training script written for CUDA, exactly the way DiT4DiT-style repos write it.

No accel_npu import, no device checks: hard-coded ``torch.autocast("cuda", dtype=torch.bfloat16)``
in the forward, ``AdamW(fused=True)``, an eval pass under ``@torch.inference_mode()`` after step 2
whose bf16 predictions go through ``.cpu().numpy()`` for a metric, then training continues.

Prints ``RESULT {json}`` per rank at the end.
Usage: cuda_style_train.py [--steps N] [--eval-after K]
"""

import argparse
import json
import os

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Cfg", (), {"hidden_size": 16})()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 1)
        self.activation_dtype = None

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = torch.nn.functional.gelu(self.fc1(x))
            self.activation_dtype = str(h.dtype).replace("torch.", "")
            return self.fc2(h)


@torch.inference_mode()
def evaluate(model, x, y):
    pred = model(x)
    actions = pred.cpu().numpy()  # bf16 under autocast: numpy has no bfloat16
    return float(np.mean((actions.astype(np.float64) - y.numpy()) ** 2)), str(pred.dtype), str(actions.dtype)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--eval-after", type=int, default=2)
    a = p.parse_args()

    accelerator = Accelerator()
    set_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(64, 8, generator=g)
    target = data.sum(dim=1, keepdim=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data, target), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    unwrapped = accelerator.unwrap_model(model)

    losses, metric, activation_dtypes = [], None, []
    batches = iter(loader)
    for step in range(a.steps):
        x, y = next(batches)
        model.train()
        out = model(x)
        activation_dtypes.append(unwrapped.activation_dtype)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))
        if step + 1 == a.eval_after:
            model.eval()
            metric = evaluate(model, data[:8], target[:8])
    rec = {
        "rank": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "losses": losses,
        "activation_dtypes": activation_dtypes,
        "eval_metric": metric[0],
        "eval_pred_dtype": metric[1],
        "eval_numpy_dtype": metric[2],
        "param_dtype": str(next(model.parameters()).dtype),
        "ds_bf16": (
            accelerator.state.deepspeed_plugin.deepspeed_config.get("bf16")
            if accelerator.state.deepspeed_plugin
            else None
        ),
        "world_size": os.environ.get("WORLD_SIZE"),
    }
    print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
