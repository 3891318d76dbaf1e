"""One torch.compile'd training run, in two shapes (argv[1]):

- ``accelerate``: a plain accelerate script, no CUDA-isms: Accelerator(), prepare, two steps; compiled by
  accelerate itself when launched with ``--dynamo_backend inductor``.
- ``cuda-idiom``: the common idiom ``device = "cuda" if torch.cuda.is_available() else "cpu"``, diffusers
  imported, ``torch.compile(model)`` (inductor), two steps.

Prints RESULT {shape, device, compiled (the model's type), graphs (dynamo's unique graphs), losses, weights}.
"""

import json
import sys

import torch

shape = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
data = torch.randn(4, 8), torch.randn(4, 1)

if shape == "accelerate":
    from accelerate import Accelerator

    accelerator = Accelerator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    device, backward = str(accelerator.device), accelerator.backward
else:
    import diffusers  # noqa: F401  (what a DiT script imports: it activates accel-npu in a plain process)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.compile(model.to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backward = torch.Tensor.backward

losses = []
for _ in range(2):
    x, y = (t.to(device) for t in data)
    loss = torch.nn.functional.mse_loss(model(x), y)
    backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())

from torch._dynamo.utils import counters  # noqa: E402 - read after the compiled steps ran

weights = [p.detach().cpu().double().sum().item() for p in model.parameters()]
print(
    "RESULT "
    + json.dumps(
        {
            "shape": shape,
            "device": device,
            "compiled": type(model).__name__,
            "graphs": counters["stats"]["unique_graphs"],
            "losses": losses,
            "weights": weights,
        }
    )
)
