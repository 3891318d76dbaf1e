"""Batches and noise of a shuffled, prepared DataLoader across a save_state / load_state resume, on 2 ranks.

usage: resume_data_order.py MODE OUT_DIR, MODE one of
- ``straight``: 3 epochs of 4 steps (8 samples, batch 1, 2 ranks), no checkpoint;
- ``first``: the same seed, ``save_state`` at step 4 (an epoch's last batch) and step 6 (mid-epoch), stops at 6;
- ``resume_end``: ``load_state(checkpoint-4)``, then on to step 12 from the epoch of the restored step, as
  diffusers' scripts resume (first_epoch = global_step // steps_per_epoch);
- ``resume_mid``: ``load_state(checkpoint-6)``, then the same, skipping the epoch's batches already trained on
  as the scripts that count a resume_step do.
Beside the shuffled loader, two loaders draw their batches from diffusers' own ``BucketBatchSampler`` classes
(upstream_samplers.py): Flux Kontext's reorders a list in place with the global ``random`` each epoch, Flux2's
shuffles with a private ``random.Random(seed)``.
Each rank prints ``RESULT {json}``: its steps as [global_step, sample index, the step's noise draw, Kontext's
sampler's index, Flux2's sampler's index].
"""

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from upstream_samplers import OneBucket, flux2_sampler, kontext_sampler

mode, out_dir = sys.argv[1], sys.argv[2]
STEPS_PER_EPOCH, EPOCHS = 4, 3

accelerator = Accelerator()
set_seed(0)
loader = torch.utils.data.DataLoader(torch.arange(8), batch_size=1, shuffle=True)
# diffusers' samplers are built after set_seed, as the scripts build them
samplers = (kontext_sampler(), flux2_sampler(seed=0))
loaders = [loader] + [torch.utils.data.DataLoader(OneBucket(), batch_sampler=b) for b in samplers]
loader, kontext_loader, flux2_loader = accelerator.prepare(*loaders)

global_step, first_epoch, resume_step = 0, 0, 0
if mode.startswith("resume"):
    checkpoint = "checkpoint-4" if mode == "resume_end" else "checkpoint-6"
    accelerator.load_state(f"{out_dir}/{checkpoint}")
    global_step = int(checkpoint.split("-")[1])
    first_epoch, resume_step = divmod(global_step, STEPS_PER_EPOCH)

seen = []
for epoch in range(first_epoch, EPOCHS):
    for step, (batch, kontext_batch, flux2_batch) in enumerate(zip(loader, kontext_loader, flux2_loader)):
        if epoch == first_epoch and step < resume_step:
            continue
        global_step += 1
        seen.append([global_step, int(batch[0]), torch.randn(()).item(), int(kontext_batch[0]), int(flux2_batch[0])])
        if mode == "first" and global_step in (4, 6):
            accelerator.save_state(f"{out_dir}/checkpoint-{global_step}")
        if mode == "first" and global_step == 6:
            break
    if mode == "first" and global_step == 6:
        break

print("RESULT " + json.dumps({"rank": accelerator.process_index, "seen": seen}), flush=True)
accelerator.end_training()
