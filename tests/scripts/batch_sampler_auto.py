"""A DataLoader built with batch_sampler= (as diffusers' bucketing dreambooth scripts build theirs)
under a DeepSpeed config whose micro batch size is "auto"; first an IterableDataset that yields
whole batches (no batch size anywhere), prepared in a call of its own: nothing in that call needs the
value, so it is prepared and the config's "auto" is left for the model's call."""

import json

import torch
from accelerate import Accelerator
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset


class WholeBatches(IterableDataset):
    def __iter__(self):
        for _ in range(4):
            yield torch.randn(5, 4)


accelerator = Accelerator()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
try:
    accelerator.prepare(DataLoader(WholeBatches(), batch_size=None))
    whole_batches = "prepared"
except Exception as exc:  # noqa: BLE001 - reported, then the real run
    whole_batches = f"{type(exc).__name__}: {exc}"
after_whole_batches = accelerator.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"]

data = TensorDataset(torch.arange(48, dtype=torch.float32).view(12, 4))
loader = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), batch_size=3, drop_last=False))
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
shapes = []
for (x,) in loader:
    loss = model(x).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    shapes.append(list(x.shape))
print(
    "RESULT "
    + json.dumps(
        {
            "rank": accelerator.process_index,
            "whole_batches": whole_batches,
            "after_whole_batches": after_whole_batches,
            "shapes": shapes,
            "engine_micro_batch": model.train_micro_batch_size_per_gpu(),
            "engine_train_batch": model.train_batch_size(),
        }
    ),
    flush=True,
)
accelerator.end_training()
