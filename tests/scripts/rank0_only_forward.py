"""A ZeRO-3 forward rank 0 runs alone after an epoch, as diffusers' train_unconditional.py samples
(l. 675-692: ``accelerator.wait_for_everyone(); if accelerator.is_main_process: ... DDPMPipeline(unet=
accelerator.unwrap_model(model))(...)``) while the other rank goes on to its next epoch.
usage: rank0_only_forward.py MODE   (MODE: forward | none: the same run without rank 0's forwards)

Three epochs of two optimizer steps each (a tiny MLP, every parameter a ZeRO-3 partition at threshold 0).
After each epoch every rank gathers the weights (``get_state_dict``, the witness), then
``wait_for_everyone()``; with MODE forward, rank 0 alone runs two no-grad forwards of the unwrapped model.
Prints ``RESULT {json}`` from rank 0: its forward outputs, the outputs of the same forward computed with plain
torch from the gathered weights, and the final gathered weights.
"""

import json
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed

mode = sys.argv[1]
accelerator = Accelerator()
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
data = torch.utils.data.TensorDataset(torch.randn(8, 16), torch.randn(8, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(data, batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
probe = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))

forwards = []
for epoch in range(3):
    model.train()
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    state = accelerator.get_state_dict(model)  # every rank: the consolidated weights, the witness
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and mode == "forward":
        net = accelerator.unwrap_model(model)
        with torch.no_grad():
            outputs = [net(probe * (i + 1)) for i in range(2)]  # two sampling steps
        expected = [
            F.linear(
                F.relu(F.linear(probe * (i + 1), state["0.weight"], state["0.bias"])),
                state["2.weight"],
                state["2.bias"],
            )
            for i in range(2)
        ]
        forwards.append(
            {"epoch": epoch, "outputs": [o.tolist() for o in outputs], "expected": [e.tolist() for e in expected]}
        )
accelerator.wait_for_everyone()  # rank 1 serves rank 0's last forwards here (train_unconditional.py: end_training)
state = accelerator.get_state_dict(model)  # whole on rank 0 (ZeRO-3: accelerate gathers it there)
if accelerator.is_main_process:
    print(
        "RESULT "
        + json.dumps({"forwards": forwards, "final": {k: v.float().flatten().tolist() for k, v in state.items()}}),
        flush=True,
    )
accelerator.end_training()
