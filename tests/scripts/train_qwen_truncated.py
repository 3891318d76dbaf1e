"""A Qwen-Image DiT training pattern that runs out of host memory stock (load whole, slice blocks), scaled
down. No accel_npu import (unchanged user script).

Loads the whole QwenImageTransformer2DModel without torch_dtype, keeps the first 2 blocks by
slicing, trains with Accelerate on a fixed global batch (split across ranks) and prints the
gathered loss of every step.
Usage: train_qwen_truncated.py CKPT --steps N [--batch 4] [--keep 2]
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, set_seed
from diffusers import QwenImageTransformer2DModel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vae", help="also load this AutoencoderKL, frozen, and decode with it (not prepared)")
    p.add_argument("--vae-child", action="store_true", help="hold the VAE as model.vae (given to prepare)")
    a = p.parse_args()

    # the same global batch whatever the rank count; the last block's text stream is unused
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    )
    set_seed(0)
    # observe, not change: which shard files this rank opens to load the DiT (a file may be opened
    # twice, once by a read-ahead thread: the count is of distinct files)
    import safetensors
    import safetensors.torch

    real_open, real_load_file, opened, read = safetensors.safe_open, safetensors.torch.load_file, [], [0]

    class CountingHandle:  # the bytes of every tensor this rank takes out of a shard
        def __init__(self, handle):
            self._handle = handle

        def __enter__(self):
            self._handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

        def get_tensor(self, key):
            tensor = self._handle.get_tensor(key)
            read[0] += tensor.numel() * tensor.element_size()
            return tensor

        def __getattr__(self, name):
            return getattr(self._handle, name)

    def counting_load_file(path, *args, **kw):  # stock diffusers reads whole shards with load_file
        opened.append(path)
        tensors = real_load_file(path, *args, **kw)
        read[0] += sum(t.numel() * t.element_size() for t in tensors.values())
        return tensors

    safetensors.safe_open = lambda path, *args, **kw: (
        opened.append(path),
        CountingHandle(real_open(path, *args, **kw)),
    )[1]
    safetensors.torch.load_file = counting_load_file
    model = QwenImageTransformer2DModel.from_pretrained(a.path)
    safetensors.safe_open, safetensors.torch.load_file = real_open, real_load_file
    loaded = [p for p in model.parameters()]
    partitioned = all(hasattr(p, "ds_id") for p in loaded)
    held = sum(p.ds_tensor.numel() if hasattr(p, "ds_id") else p.numel() for p in loaded)
    whole = sum(p.ds_numel if hasattr(p, "ds_id") else p.numel() for p in loaded)
    vae = None
    if a.vae:  # a frozen VAE, used directly (or held by the trained model with --vae-child)
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(a.vae).requires_grad_(False)
        if a.vae_child:
            model.vae = vae
    before = len(model.transformer_blocks)
    model.transformer_blocks = model.transformer_blocks[: a.keep]
    accelerator.print(f"Truncated transformer blocks: {before} -> {len(model.transformer_blocks)}")
    accelerator.print(f"Model params: {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M")
    model.train()
    cfg = model.config
    h = w = 4
    g = torch.Generator().manual_seed(1234)
    n = a.batch * a.steps
    latents = torch.randn(n, h * w, cfg.in_channels, generator=g)
    text = torch.randn(n, 5, cfg.joint_attention_dim, generator=g)
    noise = torch.randn(n, h * w, cfg.in_channels, generator=g)
    t = torch.rand(n, generator=g)
    data = torch.utils.data.TensorDataset(latents, text, noise, t)
    loader = torch.utils.data.DataLoader(data, batch_size=a.batch, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    dtype = next(model.parameters()).dtype  # bf16 under a DeepSpeed bf16 engine: inputs must match
    for x0, txt, eps, tt in loader:
        b = x0.shape[0]
        x0, txt, eps, tt = (v.to(dtype) for v in (x0, txt, eps, tt))
        xt = (1 - tt[:, None, None]) * x0 + tt[:, None, None] * eps
        pred = model(
            hidden_states=xt,
            encoder_hidden_states=txt,
            encoder_hidden_states_mask=torch.ones(b, txt.shape[1], dtype=torch.long),
            timestep=tt,
            img_shapes=[[(1, h, w)]] * b,
            return_dict=False,
        )[0]
        target = pred.new_tensor(0) + (eps - x0)[..., : pred.shape[-1]]
        loss = torch.nn.functional.mse_loss(pred.float(), target.float())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
    decoded = None
    if vae is not None:
        vae = accelerator.unwrap_model(model).vae if a.vae_child else vae
        with torch.no_grad():
            img = vae.decode(
                torch.randn(1, vae.config.latent_channels, 4, 4, generator=torch.Generator().manual_seed(3))
            ).sample
        decoded = {
            "sum": img.double().sum().item(),
            "abs": img.double().abs().sum().item(),
            "dtype": str(next(vae.parameters()).dtype),
        }
    if accelerator.is_main_process:
        for i in range(9, len(losses), 10):
            print(f"Step {i + 1}: loss={losses[i]:.4f}")
    rec = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "losses": losses,
        "blocks": len(accelerator.unwrap_model(model).transformer_blocks),
        "before": before,
        "pid": os.getpid(),
        "partitioned": partitioned,
        "held": held,
        "whole": whole,
        "params": len(loaded),
        "decoded": decoded,
        "shards_opened": len(set(opened)),
        "bytes_read": read[0],
    }
    print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
