"""A script that saves inside ``if accelerator.is_main_process:`` under DeepSpeed ZeRO-3 or FSDP (a common
mistake: DiT4DiT, diffusers #2606). usage: rank0_only_save.py MODE OUT_DIR

MODE: save_state | save_state_busy | save_state_midstep | save_state_every_rank | save_model | save_model_busy.
Rank 0 saves right after the optimizer step; with ``_busy`` the other ranks are not idle while it does
(they sleep ACCEL_NPU_COLLECTIVE_TIMEOUT + 5 s first, as a rank training on would be elsewhere);
otherwise they wait in ``accelerator.wait_for_everyone()``. ``save_state_midstep``: rank 0 saves between forward
and backward while the others go on into backward (its collectives); the exception propagates.
``save_state_every_rank``: the one-line fix (every rank calls save_state), the reference checkpoint.
``save_model``: the model is a tiny transformers Qwen2ForCausalLM (random weights, tied embeddings); after
the save_model and the reference, it goes on as diffusers' train_llada2.py does (l. 296-315):
``wait_for_everyone(); if accelerator.is_main_process: unwrap_model(model).save_pretrained(OUT_DIR/ckpt,
save_function=accelerator.save)`` while the other ranks train on (their next batch, a second step), then the
same into OUT_DIR/final, after which the other ranks simply finish. The weights gathered on every rank before
each save are written to OUT_DIR/reference_{ckpt,final}.pt (torch.save) for the test to compare.

Prints ``RESULT {json}`` from the main process: the exception it got, or "saved" with the sum of
every parameter (gathered on every rank afterwards, the documented way) to compare with the file.
"""

import json
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

mode, out_dir = sys.argv[1], sys.argv[2]
accelerator = Accelerator()
set_seed(0)  # python, numpy and torch: the checkpoint's RNG states compare across runs
if mode == "save_model":
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    )
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 6)))
else:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    data = torch.utils.data.TensorDataset(torch.randn(8, 16), torch.randn(8, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(data, batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
batches = iter(loader)


def step_loss(batch):
    if mode == "save_model":
        return model(input_ids=batch[0], labels=batch[0]).loss
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


loss = step_loss(next(batches))
if mode == "save_state_midstep" and accelerator.is_main_process:
    # mid-step: the other ranks go on into backward's collectives, no step boundary to wait at
    started = time.monotonic()
    try:
        accelerator.save_state(out_dir)
    except Exception as exc:  # reported, then re-raised
        print(
            "RESULT "
            + json.dumps(
                {"rank": 0, "error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started}
            ),
            flush=True,
        )
        raise
accelerator.backward(loss)
optimizer.step()
if mode == "save_state_every_rank":
    accelerator.save_state(out_dir)
if mode.endswith("_busy") and not accelerator.is_main_process:
    time.sleep(float(os.environ.get("ACCEL_NPU_COLLECTIVE_TIMEOUT", "30")) + 5)
outcome = None
if accelerator.is_main_process:
    started = time.monotonic()
    try:
        if mode == "save_state_every_rank":
            pass  # saved above, on every rank
        elif mode.startswith("save_state"):
            accelerator.save_state(out_dir)
        else:
            accelerator.save_model(model, out_dir)
        outcome = {"result": "saved"}
    except Exception as exc:  # noqa: BLE001 - reported, then re-raised
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - started
    if "error" in outcome:
        print("RESULT " + json.dumps({"rank": 0, **outcome}), flush=True)
        raise SystemExit(1)
accelerator.wait_for_everyone()
state = accelerator.get_state_dict(model)  # every rank: the reference
if accelerator.is_main_process:
    outcome["reference"] = {k: v.float().sum().item() for k, v in state.items()}
if mode == "save_model":  # train_llada2.py's saves: rank 0 alone after wait_for_everyone, the others go on
    if accelerator.is_main_process:
        torch.save(state, os.path.join(out_dir, "reference_ckpt.pt"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(os.path.join(out_dir, "ckpt"), save_function=accelerator.save)
    accelerator.backward(step_loss(next(batches)))  # the others: their next batch, a second step
    optimizer.step()
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save(state, os.path.join(out_dir, "reference_final.pt"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(
            os.path.join(out_dir, "final"), save_function=accelerator.save, max_shard_size="20KB"
        )
if accelerator.is_main_process:
    print("RESULT " + json.dumps({"rank": 0, **outcome}), flush=True)
