"""Train a diffusion transformer (DiT) with flow matching, the way CUDA repos write it.

This is an ordinary CUDA-style Accelerate/DeepSpeed training script (it follows the structure
of DiT4DiT, field report 001): a wrapper ``nn.Module`` holds a trainable diffusers DiT, a
frozen fp32 VAE and a frozen text encoder; the forward runs under
``torch.autocast("cuda", dtype=torch.bfloat16)``; the optimizer is ``AdamW(fused=True)``; an
eval pass runs under ``@torch.inference_mode()`` and turns bf16 predictions into numpy.
There is no device branch and nothing specific to Ascend or CPU in it.

    accelerate launch --config_file <accelerate.yaml> docs/examples/train_dit.py [--max_steps N]

Without ``--model_path`` it trains an *embedded default*: on first run it builds tiny models
from the real diffusers/transformers classes (random weights, seeded), ``save_pretrained``s
them into ``--cache_dir`` and loads them back with ``from_pretrained``, then trains on
synthetic, seeded images and captions. ``--model_path DIR`` loads a real checkpoint laid out
like a diffusers pipeline (``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``).

Outputs in ``--output_dir``: ``checkpoints/checkpoint-<step>/`` (``accelerator.save_state``
every ``--checkpointing_steps``; the latest one is resumed automatically), ``loss_history.json``,
``loss_curve.png`` and the trained ``transformer/`` directory (loadable with
``from_pretrained``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import time

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from tqdm.auto import tqdm

logger = get_logger(__name__)

COLORS = {
    "red": (1.0, -0.6, -0.6),
    "green": (-0.6, 1.0, -0.6),
    "blue": (-0.6, -0.6, 1.0),
    "yellow": (1.0, 1.0, -0.8),
    "white": (1.0, 1.0, 1.0),
    "black": (-1.0, -1.0, -1.0),
}
SHAPES = ("stripes", "rings", "checkers", "gradient")
SPECIAL = ("<pad>", "<unk>", "</s>")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model_type",
        choices=("qwen-image", "cosmos"),
        default="qwen-image",
        help="DiT family: QwenImageTransformer2DModel + AutoencoderKLQwenImage, or "
        "CosmosTransformer3DModel + AutoencoderKLWan (both with a T5 text encoder)",
    )
    p.add_argument(
        "--model_path",
        default=None,
        help="pipeline-style checkpoint dir (transformer/, vae/, text_encoder/, tokenizer/); "
        "default: tiny models built on first run into --cache_dir",
    )
    p.add_argument("--cache_dir", default="outputs/tiny-models", help="where the embedded default lives")
    p.add_argument("--output_dir", default="outputs/train_dit")
    p.add_argument("--max_steps", type=int, default=60, help="total optimizer steps (resume counts)")
    p.add_argument("--train_batch_size", type=int, default=2, help="per process")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--checkpointing_steps", type=int, default=20)
    p.add_argument("--checkpoints_total_limit", type=int, default=2)
    p.add_argument("--eval_steps", type=int, default=20)
    p.add_argument("--log_steps", type=int, default=5, help="a loss-table row every N steps")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--num_samples", type=int, default=64, help="synthetic dataset size")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Embedded default: tiny models from the real classes, saved and loaded like a real checkpoint.
# ----------------------------------------------------------------------------------------------
def caption_vocabulary():
    words = ["a", "an", "image", "of", "on", "with", "background", *COLORS, *SHAPES]
    return {w: i for i, w in enumerate([*SPECIAL, *words])}


def build_tiny_models(model_type: str, path: str, seed: int) -> None:
    """Build the tiny pipeline with random (seeded) weights and save_pretrained it to ``path``."""
    from diffusers import (
        AutoencoderKLQwenImage,
        AutoencoderKLWan,
        CosmosTransformer3DModel,
        QwenImageTransformer2DModel,
    )
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    z_dim, text_dim = 8, 32
    vocab = caption_vocabulary()
    vae_kwargs = dict(
        base_dim=16,
        z_dim=z_dim,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    )
    if model_type == "qwen-image":
        vae = AutoencoderKLQwenImage(**vae_kwargs)
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * z_dim,
            out_channels=z_dim,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=text_dim,
            axes_dims_rope=(4, 6, 6),
        )
    else:
        vae = AutoencoderKLWan(**vae_kwargs)
        transformer = CosmosTransformer3DModel(
            in_channels=z_dim,
            out_channels=z_dim,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=2,
            mlp_ratio=2.0,
            text_embed_dim=text_dim,
            adaln_lora_dim=16,
            max_size=(4, 32, 32),
            patch_size=(1, 2, 2),
            rope_scale=(1.0, 1.0, 1.0),
            concat_padding_mask=False,  # True needs torchvision
            extra_pos_embed_type="learnable",
            encoder_hidden_states_channels=text_dim,
            crossattn_proj_in_channels=text_dim,
        )
    text_encoder = T5EncoderModel(
        T5Config(
            vocab_size=len(vocab),
            d_model=text_dim,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            pad_token_id=0,
            eos_token_id=2,
        )
    )
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>", model_max_length=16
    )

    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    transformer.save_pretrained(os.path.join(tmp, "transformer"))
    vae.save_pretrained(os.path.join(tmp, "vae"))
    text_encoder.save_pretrained(os.path.join(tmp, "text_encoder"))
    tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
    with open(os.path.join(tmp, "model_index.json"), "w") as f:
        json.dump(
            {
                "_class_name": "TinyDiTPipeline",
                "model_type": model_type,
                "seed": seed,
                "transformer": ["diffusers", type(transformer).__name__],
                "vae": ["diffusers", type(vae).__name__],
                "text_encoder": ["transformers", "T5EncoderModel"],
                "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
            },
            f,
            indent=2,
        )
    os.replace(tmp, path)  # a half-written cache never looks complete


def load_components(model_type: str, path: str):
    """Load the four components; model_index.json (as in any diffusers pipeline dir) names their classes."""
    import diffusers
    import transformers

    classes = {
        "transformer": (
            "diffusers",
            "QwenImageTransformer2DModel" if model_type == "qwen-image" else "CosmosTransformer3DModel",
        ),
        "vae": ("diffusers", "AutoencoderKLQwenImage" if model_type == "qwen-image" else "AutoencoderKLWan"),
        "text_encoder": ("transformers", "T5EncoderModel"),
        "tokenizer": ("transformers", "AutoTokenizer"),
    }
    index = os.path.join(path, "model_index.json")
    if os.path.exists(index):
        with open(index) as f:
            for name, entry in json.load(f).items():
                if name in classes and isinstance(entry, list) and entry[0] in ("diffusers", "transformers"):
                    classes[name] = tuple(entry)
    lib = {"diffusers": diffusers, "transformers": transformers}
    cls = {name: getattr(lib[library], class_name) for name, (library, class_name) in classes.items()}
    transformer = cls["transformer"].from_pretrained(path, subfolder="transformer")
    vae = cls["vae"].from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
    text_encoder = cls["text_encoder"].from_pretrained(path, subfolder="text_encoder", dtype=torch.float32)
    tokenizer = cls["tokenizer"].from_pretrained(path, subfolder="tokenizer")
    return transformer, vae, text_encoder, tokenizer


# ----------------------------------------------------------------------------------------------
# Data: synthetic images whose content follows their caption (so conditioning matters).
# ----------------------------------------------------------------------------------------------
class SyntheticCaptions(torch.utils.data.Dataset):
    def __init__(self, tokenizer, num_samples: int, resolution: int, seed: int):
        self.tokenizer, self.n, self.res, self.seed = tokenizer, num_samples, resolution, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        names = list(COLORS)
        fg, bg = (names[j] for j in torch.randperm(len(names), generator=g)[:2].tolist())
        shape = SHAPES[int(torch.randint(len(SHAPES), (1,), generator=g))]
        freq = 1.0 + 3.0 * float(torch.rand((), generator=g))
        y, x = torch.meshgrid(torch.linspace(-1, 1, self.res), torch.linspace(-1, 1, self.res), indexing="ij")
        pattern = {
            "stripes": torch.sin(math.pi * freq * x),
            "rings": torch.cos(math.pi * freq * (x**2 + y**2)),
            "checkers": torch.sin(math.pi * freq * x) * torch.sin(math.pi * freq * y),
            "gradient": (x + y) / 2,
        }[shape]
        alpha = (pattern + 1) / 2
        image = alpha * torch.tensor(COLORS[fg]).view(3, 1, 1) + (1 - alpha) * torch.tensor(COLORS[bg]).view(3, 1, 1)
        caption = f"an image of {fg} {shape} on a {bg} background"
        ids = self.tokenizer(caption, padding="max_length", truncation=True, max_length=16, return_tensors="pt")
        return {
            "pixel_values": image.clamp(-1, 1).unsqueeze(1),  # (C, T=1, H, W): a one-frame video
            "input_ids": ids.input_ids[0],
            "attention_mask": ids.attention_mask[0],
        }


# ----------------------------------------------------------------------------------------------
# The model: trainable DiT + frozen fp32 VAE + frozen text encoder in one nn.Module (DiT4DiT style)
# ----------------------------------------------------------------------------------------------
def qwen_needs_txt_seq_lens() -> bool:
    """Whether this diffusers' Qwen-Image transformer must be given ``txt_seq_lens``.

    Up to diffusers 0.36 its RoPE takes the text length from ``txt_seq_lens`` (the pipeline passes
    it; without it the forward fails with ``max(None)``). From 0.37 it reads the length from
    ``encoder_hidden_states`` itself: 0.37 and 0.38 deprecate the argument, 0.39 removes it (passing
    it is then a TypeError). So it is passed exactly where it is needed.
    """
    import diffusers
    from packaging.version import Version

    return Version(Version(diffusers.__version__).base_version) < Version("0.37")


class FlowMatchingDiT(torch.nn.Module):
    def __init__(self, model_type, transformer, vae, text_encoder):
        super().__init__()
        self.model_type = model_type
        self.pass_txt_seq_lens = model_type == "qwen-image" and qwen_needs_txt_seq_lens()
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        # The towers are frozen and stay fp32 (a bf16 VAE visibly degrades decoding).
        self.vae.requires_grad_(False)
        self.text_encoder.requires_grad_(False)
        self.vae.eval()
        self.text_encoder.eval()

    @torch.no_grad()
    def encode(self, pixel_values, input_ids, attention_mask):
        latents = self.vae.encode(pixel_values).latent_dist.mode()
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
        latents = (latents - mean) / std
        out = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        text = out.hidden_states[-1]  # T5 encoder or a decoder-only LM (Qwen-Image's) alike
        return latents, text

    def denoise(self, noisy, t, text, attention_mask):
        """The DiT's velocity prediction for ``noisy`` latents (B, C, T, H, W) at times ``t`` (B,)."""
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if self.model_type == "qwen-image":
                b, c, f, h, w = noisy.shape
                packed = noisy.view(b, c, f, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
                packed = packed.reshape(b, f * (h // 2) * (w // 2), c * 4)
                # the whole (padded) text length, which is what diffusers >= 0.37 uses by itself
                extra = {"txt_seq_lens": [text.shape[1]] * b} if self.pass_txt_seq_lens else {}
                out = self.transformer(
                    hidden_states=packed,
                    encoder_hidden_states=text,
                    encoder_hidden_states_mask=attention_mask,
                    timestep=t,
                    img_shapes=[[(f, h // 2, w // 2)]] * b,
                    return_dict=False,
                    **extra,
                )[0]
                out = out.view(b, f, h // 2, w // 2, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
                return out.reshape(b, c, f, h, w)
            extra = {}
            if self.transformer.config.concat_padding_mask:  # real Cosmos checkpoints (needs torchvision)
                extra["padding_mask"] = torch.zeros(1, 1, noisy.shape[-2], noisy.shape[-1], device=noisy.device)
            return self.transformer(
                hidden_states=noisy, timestep=t, encoder_hidden_states=text, return_dict=False, **extra
            )[0]

    def forward(self, pixel_values, input_ids, attention_mask, noise=None, t=None):
        latents, text = self.encode(pixel_values, input_ids, attention_mask)
        noise = torch.randn_like(latents) if noise is None else noise
        if t is None:  # logit-normal timesteps (SD3 / Qwen-Image)
            t = torch.sigmoid(torch.randn(latents.shape[0], device=latents.device))
        tt = t.view(-1, 1, 1, 1, 1)
        noisy = (1 - tt) * latents + tt * noise
        target = noise - latents  # rectified-flow velocity
        pred = self.denoise(noisy, t, text, attention_mask)
        return pred, target


@torch.inference_mode()
def evaluate(model, batch, seed):
    """Velocity MSE on a fixed batch with fixed noise and timesteps, computed in numpy."""
    g = torch.Generator().manual_seed(seed)
    b = batch["pixel_values"].shape[0]
    t = torch.linspace(0.1, 0.9, b).to(batch["pixel_values"].device)
    latents_shape = model.encode(batch["pixel_values"], batch["input_ids"], batch["attention_mask"])[0].shape
    noise = torch.randn(latents_shape, generator=g).to(batch["pixel_values"].device)
    pred, target = model(**batch, noise=noise, t=t)
    pred = pred.cpu().numpy()  # bf16 predictions straight to numpy, as DiT4DiT's predict_action does
    target = target.float().cpu().numpy()
    return float(np.mean((pred.astype(np.float32) - target) ** 2))


# ----------------------------------------------------------------------------------------------
def latest_checkpoint(directory):
    if not os.path.isdir(directory):
        return None, 0
    found = [
        (int(m.group(1)), name) for name in os.listdir(directory) if (m := re.fullmatch(r"checkpoint-(\d+)", name))
    ]
    if not found:
        return None, 0
    step, name = max(found)
    return os.path.join(directory, name), step


def write_loss_table(history, accelerator):
    rows = [
        f"{'step':>6} | {'loss':>9} | {'eval mse':>9} | {'s/step':>7}",
        f"{'-' * 6}-+-{'-' * 9}-+-{'-' * 9}-+-{'-' * 7}",
    ]
    for r in history:
        ev = f"{r['eval_mse']:9.4f}" if r.get("eval_mse") is not None else " " * 9
        rows.append(f"{r['step']:>6} | {r['loss']:9.4f} | {ev} | {r['sec_per_step']:7.2f}")
    accelerator.print("\n".join(rows))


def plot_loss(history, path):
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], marker="o", label="train loss")
    evals = [r for r in history if r.get("eval_mse") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_mse"] for r in evals], marker="s", label="eval mse")
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator()
    set_seed(args.seed)

    model_path = args.model_path
    if model_path is None:
        model_path = os.path.join(args.cache_dir, args.model_type)
        with accelerator.main_process_first():
            if accelerator.is_main_process and not os.path.isdir(model_path):
                accelerator.print(f"Building the tiny {args.model_type} models into {model_path} (first run)")
                build_tiny_models(args.model_type, model_path, args.seed)
    transformer, vae, text_encoder, tokenizer = load_components(args.model_type, model_path)
    model = FlowMatchingDiT(args.model_type, transformer, vae, text_encoder)
    # under ZeRO-3 (zero3_init_flag) parameters are partitioned from from_pretrained on, as in
    # transformers' Trainer: count their full size (ds_numel), not this rank's empty placeholder
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731 - one expression, read where it is used
    n_train = sum(numel(p) for p in model.parameters() if p.requires_grad)
    n_frozen = sum(numel(p) for p in model.parameters() if not p.requires_grad)

    dataset = SyntheticCaptions(tokenizer, args.num_samples, args.resolution, args.seed)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.train_batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.learning_rate, weight_decay=1e-2, fused=True
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    eval_batch = {k: v[: args.train_batch_size] for k, v in next(iter(loader)).items()}
    towers = accelerator.unwrap_model(model)
    accelerator.print(
        "frozen towers: "
        + ", ".join(
            f"{name} {str(next(getattr(towers, name).parameters()).dtype).replace('torch.', '')}"
            for name in ("vae", "text_encoder")
        )
    )

    ckpt_root = os.path.join(args.output_dir, "checkpoints")
    history_path = os.path.join(args.output_dir, "loss_history.json")
    history = []
    resume_dir, start_step = latest_checkpoint(ckpt_root)
    if resume_dir:
        accelerator.print(f"Resuming from {resume_dir} (step {start_step})")
        accelerator.load_state(resume_dir)
        if os.path.exists(history_path):
            with open(history_path) as f:
                history = [r for r in json.load(f) if r["step"] <= start_step]
    accelerator.print(
        f"{args.model_type}: {n_train / 1e6:.2f}M trainable + {n_frozen / 1e6:.2f}M frozen parameters, "
        f"{accelerator.num_processes} process(es), {accelerator.distributed_type}, "
        f"steps {start_step} -> {args.max_steps}"
    )

    if start_step >= args.max_steps:
        accelerator.print(
            f"Already trained to step {start_step} (--max_steps {args.max_steps}): nothing to train; "
            "pass a larger --max_steps to continue, or a new --output_dir to start over."
        )
    steps_per_epoch = len(loader)
    progress = tqdm(
        total=args.max_steps, initial=start_step, desc="train", disable=not accelerator.is_local_main_process
    )
    step, last_time = start_step, time.time()
    while step < args.max_steps:
        epoch, skip = divmod(step, steps_per_epoch)
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in batches:
            model.train()
            pred, target = model(**batch)
            loss = F.mse_loss(pred.float(), target.float())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            mean_loss = accelerator.gather(loss.detach().float().reshape(1)).mean().item()
            progress.update(1)
            progress.set_postfix(loss=f"{mean_loss:.4f}")

            eval_mse = None
            if step % args.eval_steps == 0 or step == args.max_steps:
                model.eval()
                eval_mse = evaluate(accelerator.unwrap_model(model), eval_batch, args.seed)
            if step % args.log_steps == 0 or step == start_step + 1 or eval_mse is not None:
                now = time.time()
                row = {
                    "step": step,
                    "loss": mean_loss,
                    "eval_mse": eval_mse,
                    "sec_per_step": (now - last_time) / max(1, step - (history[-1]["step"] if history else start_step)),
                }
                last_time = now
                history.append(row)
                ev = f" | eval mse {eval_mse:.4f}" if eval_mse is not None else ""
                if accelerator.is_local_main_process:
                    progress.write(f"step {step:>5} | loss {mean_loss:.4f}{ev}")
            if step % args.checkpointing_steps == 0 or step == args.max_steps:
                save_dir = os.path.join(ckpt_root, f"checkpoint-{step}")
                accelerator.save_state(save_dir)
                if accelerator.is_main_process:
                    with open(history_path, "w") as f:
                        json.dump(history, f, indent=1)
                    kept = sorted(
                        (int(m.group(1)), m.group(0))
                        for n in os.listdir(ckpt_root)
                        if (m := re.fullmatch(r"checkpoint-(\d+)", n))
                    )
                    for _, name in kept[: max(0, len(kept) - args.checkpoints_total_limit)]:
                        shutil.rmtree(os.path.join(ckpt_root, name), ignore_errors=True)
            if step >= args.max_steps:
                break
    progress.close()

    # The trained transformer as a diffusers directory. get_state_dict is a collective under
    # ZeRO-3: every rank calls it; the main process writes.
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        trained = accelerator.unwrap_model(model).transformer
        weights = {k[len("transformer.") :]: v for k, v in state_dict.items() if k.startswith("transformer.")}
        final = type(trained).from_config(trained.config)
        final.load_state_dict(weights)
        final.save_pretrained(os.path.join(args.output_dir, "transformer"))
        with open(history_path, "w") as f:
            json.dump(history, f, indent=1)
        plot_loss(history, os.path.join(args.output_dir, "loss_curve.png"))
        accelerator.print("\nLoss table")
        write_loss_table(history, accelerator)
        accelerator.print(
            f"\nSaved {os.path.join(args.output_dir, 'transformer')} "
            f"and {os.path.join(args.output_dir, 'loss_curve.png')}"
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
