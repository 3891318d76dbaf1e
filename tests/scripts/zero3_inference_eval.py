"""ZeRO-3 training with an eval pass under @torch.inference_mode() between steps.

Plain DeepSpeed, one process (run with RANK/WORLD_SIZE/MASTER_* set), no accel_npu import.
Prints ``RESULT {json}`` when all steps ran.
"""

import json

import deepspeed
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@torch.inference_mode()
def evaluate(engine, x):
    return engine(x).sum().item()


def main():
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = deepspeed.initialize(model=Net(), model_parameters=None, config=config)
    x = torch.randn(4, 8)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for step in range(4):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 6))
        if step == 1:
            evaluate(engine, x)
    print("RESULT " + json.dumps({"losses": losses}), flush=True)


if __name__ == "__main__":
    main()
