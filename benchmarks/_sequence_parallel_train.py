"""A video DiT training step as a user writes one, for benchmarks/sequence_parallel.py: nothing in it knows about
sequence parallelism (``accelerate launch --use_parallelism_config --parallelism_config_sp_size N`` switches it on).

The real ``CogVideoXTransformer3DModel`` class (RoPE, as CogVideoX-5B) at tiny widths, random weights, fp32,
AdamW on every parameter; each sample is a latent video of ``--frames`` x 16 channels x ``--height`` x ``--width``
(patch 2: frames x height/2 x width/2 video tokens) and ``--text`` text-embedding tokens, drawn from a seed per
index by the Dataset; noise, timesteps and the rotary tables are drawn and built in the loop, as
diffusers' ``cogvideo/train_cogvideox_lora.py`` does.

Each rank writes ``--out``/rank<R>.json: its pid, its anonymous RSS (/proc/self/status RssAnon) once the libraries
are loaded, before the model is built (``libraries``), and after ``prepare`` (``before_step1``), the wall and CPU
(``time.process_time``: every thread of the rank) seconds of each step, the losses, and the (heads, tokens) of the
attention calls it made (torch's SDPA, wrapped here: the witness that the sequence was split).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _proc import rss_anon  # benchmarks/: the script's own folder, first on sys.path


class LatentVideos(torch.utils.data.Dataset):
    def __init__(self, size: int, shape: tuple[int, ...], text: tuple[int, int]):
        self.size, self.shape, self.text = size, shape, text

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        return torch.randn(self.shape, generator=generator), torch.randn(self.text, generator=generator)


def load_lazy_libraries() -> None:
    """Import what ``prepare`` would import later, so that the ``libraries`` RssAnon holds every library's own
    memory: DeepSpeed's ZeRO optimizer check imports its Muon optimizer (deepspeed/runtime/zero/utils.py
    ``is_zero_supported_optimizer``), whose ``@compiler.compile()`` loads torch's inductor (~50 MB of Python
    objects on every rank, with or without sequence parallelism)."""
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401 - imported for its memory only
    except ImportError:  # a DeepSpeed without Muon imports nothing more in prepare
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, required=True, help="latent frames")
    parser.add_argument("--height", type=int, required=True, help="latent height")
    parser.add_argument("--width", type=int, required=True, help="latent width")
    parser.add_argument("--text", type=int, default=224, help="text tokens")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from accelerate import Accelerator
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    accelerator = Accelerator()
    load_lazy_libraries()
    # torch, accelerate, DeepSpeed, diffusers and the process group: host memory, not device memory, on an NPU
    libraries = rss_anon()
    torch.manual_seed(0)
    width = args.heads * args.head_dim
    model = CogVideoXTransformer3DModel(
        num_attention_heads=args.heads,
        attention_head_dim=args.head_dim,
        in_channels=16,
        out_channels=16,
        time_embed_dim=width,
        text_embed_dim=width,
        num_layers=args.layers,
        sample_width=args.width,
        sample_height=args.height,
        sample_frames=(args.frames - 1) * 4 + 1,
        max_text_seq_length=args.text,
        use_rotary_positional_embeddings=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dataset = LatentVideos(args.steps, (args.frames, 16, args.height, args.width), (args.text, width))
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    attention: set[tuple[int, int]] = set()
    sdpa = F.scaled_dot_product_attention

    def recorded_sdpa(query, *rest, **kwargs):
        attention.add((int(query.shape[1]), int(query.shape[2])))  # (batch, heads, tokens, head_dim)
        return sdpa(query, *rest, **kwargs)

    F.scaled_dot_product_attention = recorded_sdpa
    grid_h, grid_w = args.height // 2, args.width // 2
    rope = get_3d_rotary_pos_embed(
        args.head_dim, ((0, 0), (grid_h, grid_w)), (grid_h, grid_w), args.frames, use_real=True
    )
    before_step1 = rss_anon()
    walls, cpus, losses = [], [], []
    model.train()
    for latents, text in loader:
        wall, cpu = time.perf_counter(), time.process_time()
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, 1000, (latents.shape[0],))
        noisy = latents + noise * (timesteps.float() / 1000).view(-1, 1, 1, 1, 1)
        pred = model(noisy, text, timesteps, image_rotary_emb=rope, return_dict=False)[0]
        loss = F.mse_loss(pred, noise)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        losses.append(loss.item())
        accelerator.print(f"step {len(walls)}: {walls[-1]:.2f} s, loss {losses[-1]:.6f}", flush=True)
    accelerator.wait_for_everyone()
    result = {
        "rank": accelerator.process_index,
        "pid": os.getpid(),
        "libraries": libraries,
        "before_step1": before_step1,
        "wall": walls,
        "cpu": cpus,
        "loss": losses,
        "attention": sorted(attention),
        "threads": torch.get_num_threads(),
    }
    Path(args.out, f"rank{accelerator.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
