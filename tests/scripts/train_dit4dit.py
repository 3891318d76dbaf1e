"""A DiT4DiT-shaped training script, written the way DiT4DiT's CUDA code is written.

No accel_npu import anywhere. One nn.Module holds a trainable diffusers Cosmos transformer, a
frozen fp32 Wan VAE and a frozen transformers T5 encoder, all loaded with from_pretrained
*after* the Accelerator exists (so under a ZeRO-3 config transformers builds T5 under
zero.Init) and frozen only afterwards -- the order of the real code.

Prints ``RESULT {json}`` lines (kind=step / kind=final / kind=error) as it goes.
Usage: train_dit4dit.py --pretrained DIR --steps N [--save-at K --save-dir D] [--resume D]
       [--kill-in-save K] [--final-save D] [--gathered FILE] [--save-model D]
       [--towers-out FILE] [--rank0-get-state-dict]
"""

import argparse
import json
import os
import signal
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers import AutoencoderKLWan, CosmosTransformer3DModel
from transformers import T5EncoderModel


class DiT4DiT(torch.nn.Module):
    def __init__(self, pretrained):
        super().__init__()
        self.transformer = CosmosTransformer3DModel.from_pretrained(pretrained, subfolder="transformer")
        self.vae = AutoencoderKLWan.from_pretrained(pretrained, subfolder="vae")
        self.text_encoder = T5EncoderModel.from_pretrained(pretrained, subfolder="text_encoder")
        # as in Cosmos25.py: freeze the towers after loading them
        self.vae.requires_grad_(False)
        self.text_encoder.requires_grad_(False)

    def forward(self, video, input_ids, noise, t):
        with torch.no_grad():
            latents = self.vae.encode(video).latent_dist.mode()
            text = self.text_encoder(input_ids).last_hidden_state
        dtype = next(self.transformer.parameters()).dtype
        noisy = (1 - t.view(-1, 1, 1, 1, 1)) * latents + t.view(-1, 1, 1, 1, 1) * noise
        pred = self.transformer(
            hidden_states=noisy.to(dtype), timestep=t.to(dtype), encoder_hidden_states=text.to(dtype)
        ).sample
        return torch.nn.functional.mse_loss(pred.float(), (noise - latents).float())


def emit(**rec):
    # one write() per line: ranks share the pipe, and a single short write is not interleaved
    sys.stdout.write("RESULT " + json.dumps(rec) + "\n")
    sys.stdout.flush()


def batch_for(step, rank, bs=2):
    g = torch.Generator().manual_seed(1000 * step + rank)
    video = torch.randn(bs, 3, 1, 16, 16, generator=g)
    ids = torch.randint(0, 64, (bs, 5), generator=g)
    noise = torch.randn(bs, 4, 1, 8, 8, generator=g)
    t = torch.rand(bs, generator=g)
    return video, ids, noise, t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-at", type=int, action="append", default=[])
    p.add_argument("--save-dir", default=None)
    p.add_argument("--kill-in-save", type=int, default=None, help="rank 1 SIGKILLs itself inside this save")
    p.add_argument("--resume", default=None)
    p.add_argument("--start-step", type=int, default=0)
    p.add_argument("--final-save", default=None)
    p.add_argument("--gathered", default=None)
    p.add_argument("--save-model", default=None)
    p.add_argument("--towers-out", default=None)
    p.add_argument("--rank0-get-state-dict", action="store_true")
    a = p.parse_args()

    accelerator = Accelerator()
    set_seed(0)
    model = DiT4DiT(a.pretrained)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    ds = torch.utils.data.TensorDataset(torch.zeros(8, 1))
    loader = torch.utils.data.DataLoader(ds, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    rank = accelerator.process_index
    net = accelerator.unwrap_model(model)

    saves = {"n": 0}
    if a.kill_in_save is not None:

        def maybe_die(models, weights, output_dir):
            if saves["n"] == a.kill_in_save and rank == 1:
                emit(kind="dying", rank=rank, output_dir=output_dir)
                os.kill(os.getpid(), signal.SIGKILL)

        accelerator.register_save_state_pre_hook(maybe_die)

    if a.resume:
        accelerator.load_state(a.resume)

    model.train()
    for step in range(a.start_step + 1, a.start_step + a.steps + 1):
        video, ids, noise, t = batch_for(step, rank)
        loss = model(
            video.to(accelerator.device),
            ids.to(accelerator.device),
            noise.to(accelerator.device),
            t.to(accelerator.device),
        )
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        emit(kind="step", rank=rank, step=step, loss=loss.item())
        if step in a.save_at:
            saves["n"] += 1
            accelerator.save_state(a.save_dir)
            emit(kind="saved", rank=rank, step=step, dir=a.save_dir)

    tower_params = [q for m in (net.vae, net.text_encoder) for q in m.parameters()]
    engine_param_ids = {id(q) for q in model.parameters()}
    model.eval()
    eval_reaches = (not net.vae.training) and (not net.text_encoder.training)
    model.train()
    train_reaches = net.vae.training and net.text_encoder.training
    info = {
        "tower_dtypes": sorted({str(q.dtype) for q in tower_params}),
        "tower_partitioned": any(hasattr(q, "ds_id") for q in tower_params),
        "towers_in_engine": sum(id(q) in engine_param_ids for q in tower_params),
        "tower_grads": sum(q.grad is not None for q in tower_params),
        "tower_requires_grad": sum(q.requires_grad for q in tower_params),
        "transformer_dtype": str(next(net.transformer.parameters()).dtype),
        "eval_reaches_towers": eval_reaches,
        "train_reaches_towers": train_reaches,
    }
    if a.towers_out and rank == 0:
        torch.save(
            {
                "vae": {k: v.detach().cpu().clone() for k, v in net.vae.state_dict().items()},
                "text_encoder": {k: v.detach().cpu().clone() for k, v in net.text_encoder.state_dict().items()},
            },
            a.towers_out,
        )
    if a.final_save:
        accelerator.save_state(a.final_save)
    if a.gathered:
        sd = accelerator.get_state_dict(model)  # every rank calls it: the documented way
        if accelerator.is_main_process:
            torch.save({k: v.detach().cpu().clone() for k, v in sd.items()}, a.gathered)
        del sd
    if a.save_model:
        accelerator.save_model(model, a.save_model, max_shard_size="100KB")
    emit(kind="final", rank=rank, **info)

    if a.rank0_get_state_dict:
        # DiT4DiT's own saving pattern: a collective called by the main process only
        if accelerator.is_main_process:
            t0 = time.time()
            try:
                sd = accelerator.get_state_dict(model)
                emit(
                    kind="rank0_gsd",
                    rank=rank,
                    ok=True,
                    seconds=time.time() - t0,
                    sums={k: v.float().sum().item() for k, v in sd.items()},
                )
            except Exception as exc:
                emit(
                    kind="rank0_gsd",
                    rank=rank,
                    ok=False,
                    seconds=time.time() - t0,
                    error=f"{type(exc).__name__}: {exc}",
                )
                raise
        accelerator.wait_for_everyone()
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
