"""CUDA attention flags as a training script writes them, on tiny models built from the real classes.

- diffusers, the way the official scripts do it (examples/text_to_image/train_text_to_image.py):
  ``if is_xformers_available(): import xformers; version.parse(xformers.__version__);
  unet.enable_xformers_memory_efficient_attention()``, on a UNet2DConditionModel (diffusers'
  ``Attention``) and on a FluxTransformer2DModel (``AttentionModuleMixin``);
- transformers: ``LlamaForCausalLM.from_pretrained(folder, attn_implementation="flash_attention_2")``
  of a tiny model saved locally.

Each step's outcome (or exception) goes into one ``RESULT {json}`` line; outputs are compared with
the same weights under the default SDPA attention. Usage: attention_flags.py WORKDIR [--no-forward]
(--no-forward: build and switch only; the torch_npu stand-in has no kernels, and with torch_npu installed
diffusers' GEGLU calls torch_npu.npu_geglu, transformers' flash attention torch_npu.npu_fusion_attention).
"""

import copy
import json
import os
import sys
import sysconfig

import torch

work, forward = sys.argv[1], "--no-forward" not in sys.argv
out = {}


def attempt(name, fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        out[name + "_error"] = f"{type(exc).__name__}: {exc}"[:400]
        return None


# -- diffusers ----------------------------------------------------------------------------------------
from diffusers import FluxTransformer2DModel, UNet2DConditionModel  # noqa: E402 - each library's section imports what it probes
from diffusers.utils.import_utils import is_xformers_available  # noqa: E402 - each library's section imports what it probes
from packaging import version  # noqa: E402 - each library's section imports what it probes

out["script_sees_xformers"] = is_xformers_available()
# the same function asked from a file inside site-packages, as an installed library asks it
library_file = os.path.join(sysconfig.get_paths()["purelib"], "some_library", "attention.py")
out["library_sees_xformers"] = eval(compile("is_xformers_available()", library_file, "eval"))


def import_xformers():
    import xformers

    return str(version.parse(xformers.__version__))


if out["script_sees_xformers"]:
    out["xformers_version"] = attempt("import_xformers", import_xformers)
    out["xformers_has_ops"] = attempt("xformers_ops", lambda: __import__("xformers.ops") and True)

torch.manual_seed(0)
unet = UNet2DConditionModel(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=8,
)
reference = copy.deepcopy(unet)
out["unet_processors_before"] = sorted({type(p).__name__ for p in unet.attn_processors.values()})
out["unet_enabled"] = attempt("unet_enable", lambda: unet.enable_xformers_memory_efficient_attention() or True)
out["unet_processors"] = sorted({type(p).__name__ for p in unet.attn_processors.values()})
if forward:
    sample, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 5, 32)
    with torch.no_grad():
        ours, sdpa = unet(sample, t, text).sample, reference(sample, t, text).sample
    out["unet_max_abs_diff_vs_sdpa"] = float((ours - sdpa).abs().max())

torch.manual_seed(0)
flux = FluxTransformer2DModel(
    patch_size=1,
    in_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=[4, 4, 8],
)
out["flux_enabled"] = attempt("flux_enable", lambda: flux.enable_xformers_memory_efficient_attention() or True)
out["flux_backends"] = sorted({str(getattr(p, "_attention_backend", None)) for p in flux.attn_processors.values()})

# -- transformers --------------------------------------------------------------------------------------
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402 - each library's section imports what it probes

folder = os.path.join(work, "llama")
if not os.path.isdir(folder):
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ).save_pretrained(folder)
llama = attempt("llama_fa2", lambda: LlamaForCausalLM.from_pretrained(folder, attn_implementation="flash_attention_2"))
if llama is not None:
    out["llama_attn_implementation"] = llama.config._attn_implementation
    if forward:
        reference = LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out["llama_max_abs_diff_vs_sdpa"] = float((llama(ids).logits - reference(ids).logits).abs().max())
print("RESULT " + json.dumps(out), flush=True)
