"""Plain DDP (accelerate launch --num_processes N, no config) on a tiny QwenImageTransformer2DModel,
whose last block's text stream gets no gradient. Each rank trains on its slice of the same global
batch; rank 0 saves the final weights for the test to compare with a one-process run."""

import argparse
import json

import torch
from accelerate import Accelerator
from tiny_models import qwen

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--out", required=True)
args = parser.parse_args()

accelerator = Accelerator()
model = qwen(num_layers=2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = accelerator.prepare(model, optimizer)
world, rank = accelerator.num_processes, accelerator.process_index
batch, h, w, text = 4, 4, 4, 5
generator = torch.Generator().manual_seed(1)
losses = []
for _step in range(args.steps):
    x = torch.randn(batch, h * w, 16, generator=generator)
    encoder = torch.randn(batch, text, 32, generator=generator)
    target = torch.randn(batch, h * w, 16, generator=generator)
    timestep = torch.rand(batch, generator=generator)
    mine = slice(rank * batch // world, (rank + 1) * batch // world)
    out = model(
        hidden_states=x[mine],
        encoder_hidden_states=encoder[mine],
        encoder_hidden_states_mask=torch.ones(mine.stop - mine.start, text, dtype=torch.long),
        timestep=timestep[mine],
        img_shapes=[(1, h, w)] * (mine.stop - mine.start),
        return_dict=False,
    )[0]
    loss = (out - target[mine]).pow(2).mean()
    accelerator.backward(loss)
    no_grad = sorted(n for n, p in accelerator.unwrap_model(model).named_parameters() if p.grad is None)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
unwrapped = accelerator.unwrap_model(model)
if accelerator.is_main_process:
    torch.save({k: v.detach().clone() for k, v in unwrapped.state_dict().items()}, args.out)
print(
    "RESULT "
    + json.dumps({"rank": rank, "world": world, "steps": len(losses), "last_loss": losses[-1], "no_grad": no_grad}),
    flush=True,
)
accelerator.end_training()
