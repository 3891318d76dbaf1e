"""The validated-scripts matrix: diffusers v0.40.0's official ``train_*.py`` scripts, unchanged, on 2 CPU
ranks under each launch config, measured and recorded in ``benchmarks/results/compatibility.md``.

For each script with a tiny builder (tests/scripts/tiny_*.py: real classes, random weights, configs of
diffusers' own tests) × config:

- ``zero2``: the shipped launch_configs/cpu_zero2.yaml (bf16);
- ``zero3_t0``: the shipped cpu_zero3.yaml with ``stage3_param_persistence_threshold: 0`` (every
  parameter partitioned, as a real-size model is under the shipped threshold);
- ``stock_zero2``: cpu_zero2 as stock runs it, as far as this machine lets stock form 2 ranks (see STOCK);
- ``fsdp2``: only for scripts that handle FSDP (``DistributedType.FSDP`` / ``accelerator.state.fsdp_plugin``):
  FSDP2_CONFIG below (torch's ``fully_shard``, each ``_no_split_modules`` block its own group, sharded
  ``torch.distributed.checkpoint`` state, bf16 mixed precision as the zero configs);
- ``zero2_async``, ``zero3_t0_async``, ``fsdp2_async``: the same with ``ACCEL_NPU_ASYNC_CHECKPOINT=1`` (save_state
  written in the background, accel-npu's default in launched ranks), for one script per shape (ASYNC_SCRIPTS); the
  other columns run with ``0`` (synchronous);
- ``zero2_sp2``, ``zero3_t0_sp2``, ``fsdp2_sp2``: the same with ``parallelism_config: {parallelism_config_sp_size:
  2}`` (Ulysses sequence parallelism, one group of the 2 ranks, docs/sequence-parallel.md), for the scripts whose
  trained transformer sequence parallelism splits (SP_SCRIPTS).

it launches the vendored script (third_party/) for ``--steps`` steps with ``--checkpointing_steps``,
then again with ``--resume_from_checkpoint latest`` to ``--resume-to``, then a third time straight to
``--resume-to`` with the same seed in a folder of its own. A fresh interpreter with ``ACCEL_NPU_DISABLE=1``
(a user's inference box without accel-npu) loads the final artifacts as a user does (``load_lora_weights``
into the pipeline / ``from_pretrained``) and hands back what it loaded. A row is ✔ when every launch exits 0
and all four checks (CHECKS) hold:

- ``master``: every loaded tensor equals DeepSpeed's own fp32 master weight of the last checkpoint
  (``zero_to_fp32``; under ``fsdp2`` the checkpoint's model folder, consolidated with torch's
  ``dcp_to_torch_save``), or that weight rounded to bf16;
- ``trained``: every tensor the script trains differs from its initial value (``trained_check``: LoRA B
  matrices from zero, their initialisation; a textual inversion's new token rows from the initializer
  token's row; a full model's tensors from the model folder the builder wrote, or, where the script builds
  the model otherwise, from the first checkpoint's master weights); the row says which;
- ``resume = straight``: the resumed run's artifact equals the straight run's, bit for bit unless the
  Spec states a tolerance (``resume_tolerance``), which the row then names;
- ``stock load``: the loads above ran without accel-npu.

Otherwise the row is ✘ with the first error or failed check and whose it is (the file of the traceback's
innermost frame). A launch is killed after ``--timeout`` s, or as a hang once every process it started has sat
idle for ``--idle-timeout`` s (together under 5 % of a core: ranks waiting in a collective their peers never
join; stock's hangs took the whole per-launch limit before). Wall time covers all launches; peak node RSS
is the largest sum, over the launch's process tree, of ``RssAnon`` (/proc/<pid>/status), sampled every 0.5 s.

Rows are merged into the results file: a partial run (``--only``, ``--family``, ``--configs``) replaces
its rows and keeps the others with their own commit and date. Scripts not run get a row saying why.

needs: pip install ".[test,matrix]" (setup.cfg: webdataset for the LCM scripts, tensorboard for train_unconditional.py)
usage: python tools/compatibility.py [--family SD,CogVideoX] [--only NAME,...] [--configs zero2,...]
       python tools/compatibility.py --list
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "scripts"))

from benchmarks._results import (  # noqa: E402 - after sys.path names the repository
    RESULTS,
    command_line,
    git_commit,
    git_state,
    versions,
)
from tests.launch_utils import (  # noqa: E402 - after sys.path names the repository
    BIN,
    UPSTREAM_EXAMPLES,
    base_env,
    free_port,
    kill_tree,
    process_tree,
    shipped_zero_configs,
)

RESULT_FILE = RESULTS / "compatibility.md"
#: the code this tool measures besides itself (tests/test_docs_figures.py: a later change makes its results stale)
MEASURES = ("accel_npu/", "plugins/", "_accel_npu_startup.py", "launch_configs/", "third_party/")
CONFIGS = (
    "zero2",
    "zero3_t0",
    "stock_zero2",
    "fsdp2",
    "zero2_async",
    "zero3_t0_async",
    "fsdp2_async",
    "zero2_sp2",
    "zero3_t0_sp2",
    "fsdp2_sp2",
)
# the asynchronous save_state column (ACCEL_NPU_ASYNC_CHECKPOINT=1, docs/checkpoints.md § 2c): one script per
# shape — a LoRA saved on every rank, a LoRA saved by rank 0 alone (its save_state served by the other ranks),
# a full fine-tune, a video LoRA, and a LoRA script that handles FSDP (the fsdp2_async rows need one)
ASYNC_SCRIPTS = (
    "train_dreambooth_lora_sd3.py",
    "train_dreambooth_lora_sdxl.py",
    "train_text_to_image.py",
    "train_cogvideox_lora.py",
    "train_dreambooth_lora_z_image.py",
)
# the sequence-parallel column: the scripts that train a transformer with a plan (diffusers' _cp_plan or
# plugins/sequence_parallel/plans.py), a LoRA or the whole model
SP_SCRIPTS = (
    "train_dreambooth_lora_flux.py",
    "train_dreambooth_flux.py",
    "train_dreambooth_lora_flux_kontext.py",
    "train_dreambooth_lora_flux2.py",
    "train_dreambooth_lora_flux2_img2img.py",
    "train_dreambooth_lora_flux2_klein.py",
    "train_dreambooth_lora_flux2_klein_img2img.py",
    "train_dreambooth_lora_qwen_image.py",
    "train_dreambooth_lora_sd3.py",
    "train_dreambooth_sd3.py",
    "train_cogvideox_lora.py",
    "train_cogvideox_image_to_video_lora.py",
    "train_cosmos_predict25_lora.py",
)
# stock on CPU: ACCEL_NPU_DISABLE=1 makes every rank rank 0 of 1 (stock accelerate starts no gloo group
# without an accelerator), so stock runs with every plugin off but those that form the 2 CPU ranks
# (devices.cpu, launch.launcher and deepspeed, the last two essential) and torchvision_compat (the registry's
# CUDA torchvision fails stock's imports here), and the deepspeed plugin's training-time patches off
STOCK_ENV = {
    "ACCEL_NPU_DISABLED_PLUGINS": "devices.npu,devices.cuda,precision,video,ddp,loading,frozen_towers,checkpoints,"
    "launch.settings,hang_watch,trackers,sequence_parallel",
    "ACCEL_NPU_DISABLED_PATCHES": "deepspeed.runtime.engine:DeepSpeedEngine.forward,"
    "deepspeed.runtime.zero.partitioned_param_coordinator:"
    "PartitionedParameterCoordinator.fetch_sub_module,"
    "accelerate.accelerator:Accelerator.prepare",
}
PROMPT = "a photo of sks dog"
# FSDP2 on the 2 CPU ranks, as tests/test_checkpoints.py launches it, with the zero configs' bf16; wrap policy
# TRANSFORMER_BASED_WRAP with no class list: accelerate wraps each of the model's own _no_split_modules
# (accelerate/utils/fsdp_utils.py fsdp2_prepare_auto_wrap_policy), so one config fits every script
FSDP2_CONFIG = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    },
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 2,
    "machine_rank": 0,
    "use_cpu": False,
}
FSDP_MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate's FSDP_MODEL_NAME + model index, a DCP folder


# the runner's launches in an official script's flags: "model", "common" (every launch), "first" (to
# --steps), "resume" (to --resume-to; None: the script cannot resume, one launch), "straight" (optional: the
# straight run to --resume-to, by default "first" with {steps} = {resume_to} and {out} its own folder);
# {model} {out} {steps} {every} {resume_to} {more} (= resume_to - steps) substituted. A Spec's ``cli``
# replaces some of these keys.
OFFICIAL_CLI = {
    "model": ["--pretrained_model_name_or_path", "{model}"],
    "common": ["--seed", "0", "--output_dir", "{out}", "--checkpointing_steps", "{every}"],
    "first": ["--max_train_steps", "{steps}"],
    "resume": ["--max_train_steps", "{resume_to}", "--resume_from_checkpoint", "latest"],
}


@dataclass
class Spec:
    """How to run one official script (or a user's own script, ``path`` under tests/) on a tiny pipeline."""

    path: str  # relative to examples/, or to the repository when it starts with "tests/"
    family: str
    builder: str  # key of BUILDERS
    data: list[str]  # arguments naming the data, {work} substituted
    # "lora:<PipelineClass>:<component>", "textual_inversion:<PipelineClass>:<text encoders>:<files>" (the
    # scripts' learned_embeds files, one per text encoder, loaded with load_textual_inversion; compared: the new
    # token's rows of each encoder's embedding), "peft:<ModelClass>:<subfolder>" (peft's save_pretrained loaded with
    # PeftModel.from_pretrained), "full:<ModelClass>:<subfolder>", "module:<module>.<Class>:<subfolder>"
    # (a class of tests/scripts/ built from the tiny model folder, accelerate's save_model output loaded into it)
    # or "pretrained:<transformers class>:<subfolder>" (with checkpoint None: compare_pretrained)
    artifact: str
    extra: list[str] = field(default_factory=list)
    cli: dict = field(default_factory=dict)  # keys of OFFICIAL_CLI this script spells otherwise
    # the checkpoint whose master weights the artifact is compared with ("latest": the highest-numbered
    # checkpoint-* written; None: the script writes no DeepSpeed checkpoint, see compare_pretrained) and what
    # the resumed launch's output must name (None: a script that prints no such line; the witness is then
    # DeepSpeed's own step count, global_steps, in that checkpoint = --resume-to)
    checkpoint: str | None = "checkpoint-{resume_to}"
    resumed_from: str | None = "checkpoint-{steps}"
    # "checkpoint": the artifact compared is the one the script's save hook wrote into that checkpoint (the
    # final one in output_dir must load too, with the same tensors' names)
    artifact_in: str = "output"
    # optional pipeline components the script itself passes to from_pretrained as stand-ins (Cosmos 2.5's
    # MockSafetyChecker): the witness passes a stand-in too
    stand_ins: tuple = ()
    # components the ACCEL_NPU_DISABLE=1 load leaves out (None) because this machine cannot build them without
    # accel-npu, and the artifact never touches them (Flux2's PixtralProcessor needs torchvision, whose only wheel
    # here is a CUDA build that stock cannot import); the row names them
    left_out_of_stock_load: tuple = ()
    epoch_steps: int = 0  # > 0: optimizer steps per epoch of a script counting epochs ({epochs}, {resume_epochs})
    env: dict[str, str] = field(default_factory=dict)  # set for the launches, {work} substituted
    site: list[str] = field(default_factory=list)  # "name==version" put on PYTHONPATH (torchvision_site.package_site)
    # the largest |resumed - straight| accepted, where the script is not deterministic across a resume on CPU
    # (None: bit for bit); the row names it
    resume_tolerance: float | None = None
    # a regex of artifact tensors the script never trains (frozen parts the artifact carries), left out of the
    # trained check; the row names it
    untrained: str = ""

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def script(self) -> Path:
        if Path(self.path).is_absolute():  # a copy made elsewhere (the runner's own tests)
            return Path(self.path)
        return REPO / self.path if self.path.startswith("tests/") else UPSTREAM_EXAMPLES / self.path

    @property
    def official(self) -> bool:
        """A diffusers script (vendored), not a user's own script of tests/scripts/."""
        return self.script.is_relative_to(UPSTREAM_EXAMPLES)


DREAMBOOTH = ["--instance_data_dir", "{work}/images", "--instance_prompt", PROMPT]
LORA_T = [
    "--rank",
    "4",
    "--resolution",
    "16",
    "--train_batch_size",
    "1",
    "--learning_rate",
    "1e-2",
    "--dataloader_num_workers",
    "0",
]
SD = ["--resolution", "32", "--train_batch_size", "2", "--learning_rate", "1e-3", "--dataloader_num_workers", "0"]
FLUX2_TEXT = ["--max_sequence_length", "16"]
# the script's own switch for a forward without accelerate's autocast, as under DeepSpeed: it casts the fp32
# latents and text features to the weights' dtype (train_dreambooth_lora_ideogram4.py, --disable_training_autocast)
IDEOGRAM4 = ["--max_sequence_length", "64", "--disable_training_autocast"]
IMG2IMG = [
    "--dataset_name",
    "{work}/img2img",
    "--image_column",
    "image",
    "--cond_image_column",
    "cond_image",
    "--caption_column",
    "prompt",
    "--instance_prompt",
    PROMPT,
]
# Kandinsky 2.2 takes a prior and a decoder ({work}: the builder's folder)
KANDINSKY = [
    "--pretrained_decoder_model_name_or_path",
    "{work}/model/decoder",
    "--pretrained_prior_model_name_or_path",
    "{work}/model/prior",
]
KANDINSKY_DATA = ["--train_data_dir", "{work}/data"]
# SDXL UNet: tiny_sdxl_family.py's VAE downsamples x8 (ControlNetModel.from_unet's conditioning embedding
# does), so --resolution 32; the LCM wds scripts divide by --dataloader_num_workers and read --max_train_samples
SDXL_T = ["--resolution", "32", "--train_batch_size", "1", "--learning_rate", "1e-3", "--dataloader_num_workers", "0"]
SDXL_TEXT = ["--train_data_dir", "{work}/data/text", "--caption_column", "text"]
SDXL_WDS = ["--train_shards_path_or_url", "{work}/data/shards/{{00000..00001}}.tar", "--max_train_samples", "8"]
# the LCM scripts' webdataset loader divides by its worker count: at least one worker
LCM = ["--resolution", "32", "--train_batch_size", "2", "--learning_rate", "1e-3", "--dataloader_num_workers", "1"]
LCM_WDS = ["--train_shards_path_or_url", "{work}/shards/shard-{{000000..000001}}.tar", "--max_train_samples", "8"]
COG = [
    "--instance_data_root",
    "{work}/videos",
    "--caption_column",
    "prompts.txt",
    "--video_column",
    "videos.txt",
    "--max_num_frames",
    "9",
    "--train_batch_size",
    "1",
    "--rank",
    "4",
    "--lora_alpha",
    "8",
    "--learning_rate",
    "1e-2",
]
# Flux.1 and SD3: full fine-tunes (no --rank); the control scripts read a local parquet dataset (--dataset_name)
FULL_T = ["--resolution", "16", "--train_batch_size", "1", "--learning_rate", "1e-3", "--dataloader_num_workers", "0"]
CONTROL = ["--dataset_name", "{work}/controlnet_data"]
# upstream README's flags; "dog" is one token of the tiny tokenizers
# --repeats 1: an epoch is the 4 images (2 steps on 2 ranks), so the checkpoint at step 4 ends an epoch; the scripts
# resume at the epoch of the restored step without skipping its batches (the default 100 repeats make step 4
# mid-epoch, and the resumed run trains on that epoch's first batches again)
TEXTUAL_INVERSION = [
    "--placeholder_token",
    "<new1>",
    "--initializer_token",
    "dog",
    "--learnable_property",
    "object",
    "--repeats",
    "1",
]

SPECS = [
    Spec(
        "text_to_image/train_text_to_image.py",
        "SD",
        "sd",
        ["--train_data_dir", "{work}/data", "--caption_column", "text"],
        "full:UNet2DConditionModel:unet",
        ["--resolution", "16", "--train_batch_size", "2", "--learning_rate", "1e-3", "--dataloader_num_workers", "0"],
    ),
    Spec("dreambooth/train_dreambooth.py", "SD", "sd_family", DREAMBOOTH, "full:UNet2DConditionModel:unet", SD),
    Spec("dreambooth/train_dreambooth_lora.py", "SD", "sd_family", DREAMBOOTH, "lora:StableDiffusionPipeline:unet", SD),
    Spec(
        "controlnet/train_controlnet.py",
        "SD",
        "sd_family",
        ["--train_data_dir", "{work}/controlnet_data"],
        "full:ControlNetModel:",
        SD,
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_sdxl.py",
        "SDXL",
        "sdxl",
        DREAMBOOTH,
        "lora:StableDiffusionXLPipeline:unet",
        LORA_T,
    ),
    # -- SD / SDXL UNet scripts --
    # SD 1.x UNet
    Spec(
        "text_to_image/train_text_to_image_lora.py",
        "SD",
        "sd",
        ["--train_data_dir", "{work}/data", "--caption_column", "text"],
        "lora:StableDiffusionPipeline:unet",
        [
            "--resolution",
            "16",
            "--train_batch_size",
            "2",
            "--learning_rate",
            "1e-3",
            "--dataloader_num_workers",
            "0",
            "--rank",
            "4",
        ],
    ),
    Spec(
        "advanced_diffusion_training/train_dreambooth_lora_sd15_advanced.py",
        "SD",
        "sd_family",
        DREAMBOOTH,
        "lora:StableDiffusionPipeline:unet",
        SD + ["--rank", "4"],
    ),
    # with upstream README's --modifier_token
    Spec(
        "custom_diffusion/train_custom_diffusion.py",
        "SD",
        "sd_family",
        ["--instance_data_dir", "{work}/images", "--instance_prompt", "a photo of <new1> dog"],
        "attn_procs:StableDiffusionPipeline:unet:pytorch_custom_diffusion_weights.safetensors",
        SD + ["--modifier_token", "<new1>", "--initializer_token", "dog"],
    ),
    # an official training script not named train_*.py: it trains the new token's embedding row only; its
    # artifact, learned_embeds.safetensors, loads with load_textual_inversion
    Spec(
        "textual_inversion/textual_inversion.py",
        "SD",
        "sd_family",
        ["--train_data_dir", "{work}/images"] + TEXTUAL_INVERSION,
        "textual_inversion:StableDiffusionPipeline:text_encoder:learned_embeds.safetensors",
        SD,
    ),
    Spec(
        "instruct_pix2pix/train_instruct_pix2pix.py",
        "SD",
        "sd15_data",
        ["--dataset_name", "{work}/pix2pix_data"],
        "full:UNet2DConditionModel:unet",
        SD,
    ),
    Spec(
        "consistency_distillation/train_lcm_distill_sd_wds.py",
        "SD",
        "sd15_lcm",
        LCM_WDS,
        "full:UNet2DConditionModel:unet",
        LCM,
        cli={"model": ["--pretrained_teacher_model", "{model}"]},
    ),
    # the LoRA the LCM LoRA scripts save with save_lora_weights (unet_lora/) keeps peft's "base_model.model."
    # prefix (get_peft_model_state_dict of their PeftModel), which load_lora_weights refuses on any hardware
    # (NoMatchingPeftModuleError); their other final save, unet.save_pretrained(output_dir) in peft's format
    # ("to be able to load them back"), loads with PeftModel.from_pretrained
    Spec(
        "consistency_distillation/train_lcm_distill_lora_sd_wds.py",
        "SD",
        "sd15_lcm",
        LCM_WDS,
        "peft:UNet2DConditionModel:unet",
        LCM + ["--lora_rank", "4"],
        cli={"model": ["--pretrained_teacher_model", "{model}"]},
    ),
    # builds its UNet2DModel from a config and counts epochs (4 images, batch 1 on 2 ranks: 2 steps an epoch)
    Spec(
        "unconditional_image_generation/train_unconditional.py",
        "unconditional",
        "sd15_data",
        ["--train_data_dir", "{work}/unconditional/images", "--model_config_name_or_path", "{work}/unconditional/unet"],
        "full:UNet2DModel:unet",
        [
            "--resolution",
            "16",
            "--train_batch_size",
            "1",
            "--learning_rate",
            "1e-3",
            "--dataloader_num_workers",
            "0",
            "--eval_batch_size",
            "1",
            "--ddpm_num_inference_steps",
            "2",
            "--save_images_epochs",
            "100",
            "--save_model_epochs",
            "100",
        ],
        epoch_steps=2,
        cli={
            "model": [],
            "common": ["--output_dir", "{out}", "--checkpointing_steps", "{every}"],
            "first": ["--num_epochs", "{epochs}"],
            "resume": ["--num_epochs", "{resume_epochs}", "--resume_from_checkpoint", "latest"],
        },
    ),
    # SDXL UNet
    Spec(
        "text_to_image/train_text_to_image_sdxl.py",
        "SDXL",
        "sdxl_family",
        SDXL_TEXT,
        "full:UNet2DConditionModel:unet",
        SDXL_T,
    ),
    Spec(
        "text_to_image/train_text_to_image_lora_sdxl.py",
        "SDXL",
        "sdxl_family",
        SDXL_TEXT,
        "lora:StableDiffusionXLPipeline:unet",
        SDXL_T + ["--rank", "4"],
    ),
    Spec(
        "controlnet/train_controlnet_sdxl.py",
        "SDXL",
        "sdxl_family",
        ["--train_data_dir", "{work}/data/controlnet"],
        "full:ControlNetModel:",
        SDXL_T,
    ),
    Spec(
        "t2i_adapter/train_t2i_adapter_sdxl.py",
        "SDXL",
        "sdxl_adapter",
        ["--train_data_dir", "{work}/data/controlnet"],
        "full:T2IAdapter:",
        SDXL_T,
    ),
    Spec(
        "instruct_pix2pix/train_instruct_pix2pix_sdxl.py",
        "SDXL",
        "sdxl_family",
        ["--train_data_dir", "{work}/data/pix2pix"],
        "full:UNet2DConditionModel:unet",
        SDXL_T,
    ),
    Spec(
        "advanced_diffusion_training/train_dreambooth_lora_sdxl_advanced.py",
        "SDXL",
        "sdxl_family",
        ["--instance_data_dir", "{work}/data/instance", "--instance_prompt", PROMPT],
        "lora:StableDiffusionXLPipeline:unet",
        SDXL_T + ["--rank", "4"],
    ),
    # both text encoders' new token rows: learned_embeds.safetensors and learned_embeds_2.safetensors
    Spec(
        "textual_inversion/textual_inversion_sdxl.py",
        "SDXL",
        "sdxl_family",
        ["--train_data_dir", "{work}/data/instance"] + TEXTUAL_INVERSION,
        "textual_inversion:StableDiffusionXLPipeline:text_encoder,text_encoder_2:"
        "learned_embeds.safetensors,learned_embeds_2.safetensors",
        SDXL_T,
    ),
    Spec(
        "consistency_distillation/train_lcm_distill_lora_sdxl.py",
        "SDXL",
        "sdxl_family",
        SDXL_TEXT,
        "lora:StableDiffusionXLPipeline:unet",
        SDXL_T + ["--lora_rank", "4"],
        cli={"model": ["--pretrained_teacher_model", "{model}"]},
    ),
    # the artifact: see train_lcm_distill_lora_sd_wds.py's
    Spec(
        "consistency_distillation/train_lcm_distill_lora_sdxl_wds.py",
        "SDXL",
        "sdxl_lcm",
        SDXL_WDS,
        "peft:UNet2DConditionModel:unet",
        SDXL_T[:-1] + ["1", "--lora_rank", "4"],
        cli={"model": ["--pretrained_teacher_model", "{model}"]},
    ),
    Spec(
        "consistency_distillation/train_lcm_distill_sdxl_wds.py",
        "SDXL",
        "sdxl_lcm",
        SDXL_WDS,
        "full:UNet2DConditionModel:unet",
        SDXL_T[:-1] + ["1"],
        cli={"model": ["--pretrained_teacher_model", "{model}"]},
    ),
    # the tiny transformer's one block is its last, context_pre_only (transformer_sd3.py): the text tokens'
    # attention output is dropped, so their query projection gets no gradient and its LoRA B stays zero
    Spec(
        "dreambooth/train_dreambooth_lora_sd3.py",
        "SD3",
        "sd3",
        DREAMBOOTH,
        "lora:StableDiffusion3Pipeline:transformer",
        LORA_T + ["--max_sequence_length", "16"],
        untrained=r"^transformer_blocks\.0\.attn\.add_q_proj\.",
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_flux.py",
        "Flux",
        "flux",
        DREAMBOOTH,
        "lora:FluxPipeline:transformer",
        LORA_T + ["--max_sequence_length", "16"],
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_sana.py",
        "Sana",
        "sana",
        DREAMBOOTH,
        "lora:SanaPipeline:transformer",
        LORA_T + ["--max_sequence_length", "16"],
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_qwen_image.py",
        "Qwen-Image",
        "qwen",
        DREAMBOOTH,
        "lora:QwenImagePipeline:transformer",
        LORA_T + ["--lora_alpha", "8", "--max_sequence_length", "16", "--skip_final_inference"],
    ),
    Spec(
        "cogvideo/train_cogvideox_lora.py",
        "CogVideoX",
        "cog_t2v",
        COG,
        "lora:CogVideoXPipeline:transformer",
        ["--height", "16", "--width", "16"],
    ),
    Spec(
        "cogvideo/train_cogvideox_image_to_video_lora.py",
        "CogVideoX",
        "cog_i2v",
        COG,
        "lora:CogVideoXImageToVideoPipeline:transformer",
        ["--height", "32", "--width", "32"],
    ),
    # -- Flux, Flux2, SD3 DiT scripts --
    # Flux.1 and SD3
    Spec(
        "dreambooth/train_dreambooth_flux.py",
        "Flux",
        "flux",
        DREAMBOOTH,
        "full:FluxTransformer2DModel:transformer",
        FULL_T + ["--max_sequence_length", "16"],
    ),
    Spec(
        "advanced_diffusion_training/train_dreambooth_lora_flux_advanced.py",
        "Flux",
        "flux",
        DREAMBOOTH,
        "lora:FluxPipeline:transformer",
        LORA_T + ["--max_sequence_length", "16"],
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_flux_kontext.py",
        "Flux",
        "flux",
        DREAMBOOTH,
        "lora:FluxKontextPipeline:transformer",
        LORA_T + ["--max_sequence_length", "16"],
    ),
    Spec("flux-control/train_control_flux.py", "Flux", "flux_control", CONTROL, "full:FluxTransformer2DModel:", FULL_T),
    Spec(
        "flux-control/train_control_lora_flux.py",
        "Flux",
        "flux_control",
        CONTROL,
        "lora:FluxControlPipeline:transformer",
        LORA_T,
    ),
    Spec(
        "controlnet/train_controlnet_flux.py",
        "Flux",
        "flux_control",
        CONTROL,
        "full:FluxControlNetModel:",
        FULL_T + ["--num_double_layers", "1", "--num_single_layers", "1"],
    ),
    Spec(
        "dreambooth/train_dreambooth_sd3.py",
        "SD3",
        "sd3",
        DREAMBOOTH,
        "full:SD3Transformer2DModel:transformer",
        FULL_T + ["--max_sequence_length", "16"],
        # the last block's text query projection, as for its LoRA above, and the fixed sin-cos position table,
        # a buffer the saved model carries (embeddings.py PatchEmbed: register_buffer("pos_embed", ...))
        untrained=r"^transformer_blocks\.0\.attn\.add_q_proj\.|^pos_embed\.pos_embed$",
    ),
    Spec(
        "controlnet/train_controlnet_sd3.py",
        "SD3",
        "sd3_control",
        CONTROL,
        "full:SD3ControlNetModel:",
        FULL_T + ["--max_sequence_length", "16"],
    ),
    # Flux2, Z-Image, Ideogram4
    Spec(
        "dreambooth/train_dreambooth_lora_flux2.py",
        "Flux2",
        "flux2",
        DREAMBOOTH,
        "lora:Flux2Pipeline:transformer",
        LORA_T + FLUX2_TEXT,
        left_out_of_stock_load=("tokenizer",),
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_flux2_img2img.py",
        "Flux2",
        "flux2",
        IMG2IMG,
        "lora:Flux2Pipeline:transformer",
        LORA_T + FLUX2_TEXT,
        left_out_of_stock_load=("tokenizer",),
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_flux2_klein.py",
        "Flux2",
        "flux2_klein",
        DREAMBOOTH,
        "lora:Flux2KleinPipeline:transformer",
        LORA_T + FLUX2_TEXT,
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_flux2_klein_img2img.py",
        "Flux2",
        "flux2_klein",
        IMG2IMG,
        "lora:Flux2KleinPipeline:transformer",
        LORA_T + FLUX2_TEXT,
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_z_image.py",
        "Z-Image",
        "z_image",
        DREAMBOOTH,
        "lora:ZImagePipeline:transformer",
        LORA_T + ["--max_sequence_length", "32"],
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_ideogram4.py",
        "Ideogram4",
        "ideogram4",
        DREAMBOOTH,
        "lora:Ideogram4Pipeline:transformer",
        LORA_T + IDEOGRAM4,
    ),
    # -- other image DiTs, video, discrete --
    # no --max_train_steps / --checkpointing_steps / resume: 2 clips on 2 ranks at batch 1 make an epoch one
    # step, so --num_train_epochs is the step count; it saves checkpoint-<epoch index> every
    # --checkpointing_epochs but never after the last epoch, and its save hook writes the LoRA into it
    Spec(
        "cosmos/train_cosmos_predict25_lora.py",
        "Cosmos",
        "cosmos25",
        ["--train_data_dir", "{work}/data"],
        "lora:Cosmos2_5_PredictBasePipeline:transformer",
        [
            "--height",
            "32",
            "--width",
            "32",
            "--num_frames",
            "5",
            "--train_batch_size",
            "1",
            "--lora_rank",
            "4",
            "--lora_alpha",
            "8",
            "--learning_rate",
            "1e-2",
            "--scheduler_warm_up_steps",
            "1",
            "--dataloader_num_workers",
            "0",
        ],
        cli={
            "common": ["--seed", "0", "--output_dir", "{out}"],
            "first": ["--num_train_epochs", "{steps}", "--checkpointing_epochs", "{every}"],
            "resume": None,
        },
        checkpoint="latest",
        artifact_in="checkpoint",
        stand_ins=("safety_checker",),
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_lumina2.py",
        "Lumina2",
        "lumina2",
        DREAMBOOTH,
        "lora:Lumina2Pipeline:transformer",
        LORA_T + ["--max_sequence_length", "16"],
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_krea2.py",
        "Krea2",
        "krea2",
        DREAMBOOTH,
        "lora:Krea2Pipeline:transformer",
        LORA_T + ["--lora_alpha", "8", "--max_sequence_length", "16", "--skip_final_inference"],
    ),
    Spec(
        "dreambooth/train_dreambooth_lora_hidream.py",
        "HiDream",
        "hidream",
        DREAMBOOTH
        + [
            "--pretrained_tokenizer_4_name_or_path",
            "{work}/model/tokenizer_4",
            "--pretrained_text_encoder_4_name_or_path",
            "{work}/model/text_encoder_4",
        ],
        "lora:HiDreamImagePipeline:transformer",
        LORA_T + ["--max_sequence_length", "16", "--skip_final_inference"],
    ),
    Spec(
        "cogview4-control/train_control_cogview4.py",
        "CogView4",
        "cogview4_control",
        [
            "--jsonl_for_train",
            "{work}/control/train.jsonl",
            "--image_column",
            "image",
            "--caption_column",
            "text",
            "--conditioning_image_column",
            "conditioning_image",
        ],
        "full:CogView4Transformer2DModel:",
        [
            "--resolution",
            "16",
            "--train_batch_size",
            "1",
            "--learning_rate",
            "1e-3",
            "--dataloader_num_workers",
            "0",
            "--max_sequence_length",
            "16",
        ],
    ),
    Spec(
        "amused/train_amused.py",
        "aMUSEd",
        "amused",
        ["--instance_data_dir", "{work}/images"],
        "full:UVit2DModel:",
        [
            "--resolution",
            "16",
            "--train_batch_size",
            "1",
            "--learning_rate",
            "1e-3",
            "--dataloader_num_workers",
            "0",
            "--report_to",
            "tensorboard",
        ],
    ),  # its default, wandb, must be installed (the others default to tensorboard)
    # no DeepSpeed checkpoint and no resume: it saves save_pretrained copies every --checkpointing_steps and
    # final/; random-token data (--use_dummy_data) instead of the hub's wikitext
    Spec(
        "discrete_diffusion/train_llada2.py",
        "LLaDA2",
        "llada2",
        ["--use_dummy_data", "--num_dummy_samples", "16"],
        "pretrained:AutoModelForCausalLM:final",
        [
            "--per_device_train_batch_size",
            "1",
            "--gradient_accumulation_steps",
            "1",
            "--max_length",
            "32",
            "--prompt_length",
            "8",
            "--block_length",
            "8",
            "--lr_warmup_steps",
            "0",
            "--learning_rate",
            "1e-2",
        ],
        cli={"model": ["--model_name_or_path", "{model}"], "resume": None},
        checkpoint=None,
    ),
    # a user's own script (DiT4DiT's shape, not a diffusers script): its flags, one save_state per save dir, the
    # artifact accelerate's save_model writes, loaded into the script's DiT4DiT module
    Spec(
        "tests/scripts/train_dit4dit.py",
        "DiT4DiT (user script)",
        "dit4dit",
        [],
        "module:train_dit4dit.DiT4DiT:model",
        cli={
            "model": ["--pretrained", "{model}"],
            "common": [],
            "first": ["--steps", "{steps}", "--save-at", "{steps}", "--save-dir", "{out}/checkpoint-{steps}"],
            "resume": [
                "--resume",
                "{out}/checkpoint-{steps}",
                "--start-step",
                "{steps}",
                "--steps",
                "{more}",
                "--final-save",
                "{out}/checkpoint-{resume_to}",
                "--save-model",
                "{out}/model",
            ],
            "straight": [
                "--steps",
                "{resume_to}",
                "--save-at",
                "{resume_to}",
                "--save-dir",
                "{out}/checkpoint-{resume_to}",
                "--save-model",
                "{out}/model",
            ],
        },
        resumed_from=None,
    ),
    # -- Kandinsky, VQGAN, aMUSEd, unconditional --
    # Kandinsky 2.2 and VQGAN
    Spec(
        "kandinsky2_2/text_to_image/train_text_to_image_decoder.py",
        "Kandinsky",
        "kandinsky",
        KANDINSKY_DATA,
        "full:UNet2DConditionModel:unet",
        SD,
        cli={"model": KANDINSKY},
    ),
    Spec(
        "kandinsky2_2/text_to_image/train_text_to_image_lora_decoder.py",
        "Kandinsky",
        "kandinsky",
        KANDINSKY_DATA,
        "lora:KandinskyV22Pipeline:unet",
        SD + ["--rank", "4"],
        cli={"model": KANDINSKY},
    ),
    Spec(
        "kandinsky2_2/text_to_image/train_text_to_image_prior.py",
        "Kandinsky",
        "kandinsky",
        KANDINSKY_DATA + ["--caption_column", "text"],
        "full:PriorTransformer:prior",
        SD,
        cli={"model": KANDINSKY},
    ),
    Spec(
        "kandinsky2_2/text_to_image/train_text_to_image_lora_prior.py",
        "Kandinsky",
        "kandinsky",
        KANDINSKY_DATA + ["--caption_column", "text"],
        "lora:KandinskyV22PriorPipeline:prior",
        SD + ["--rank", "4"],
        cli={"model": KANDINSKY},
    ),
    # the perceptual loss's timm backbone: random weights in a local hub cache (tiny_kandinsky.vqgan)
    Spec(
        "vqgan/train_vqgan.py",
        "VQGAN",
        "vqgan",
        ["--train_data_dir", "{work}/data", "--discriminator_config_name_or_path", "{work}/discriminator.json"],
        "full:VQModel:vqmodel",
        [
            # the discriminator (tiny_kandinsky.vqgan: depth 4) halves the side four times; InstanceNorm2d needs
            # more than one spatial element at the end
            "--resolution",
            "32",
            "--train_batch_size",
            "2",
            "--learning_rate",
            "1e-3",
            "--dataloader_num_workers",
            "0",
            "--timm_model_backend",
            "test_resnet",
            "--timm_model_layers",
            "layer1",
            "--timm_model_offset",
            "3",
        ],
        env={"HF_HUB_CACHE": "{work}/hub"},
        site=["timm==1.0.31"],
    ),
]


# kind -> code run in tests/scripts/ that writes the tiny pipeline to {w}/model and its data beside it
BUILDERS = {
    "sd": "import tiny_sd as t; t.build('{w}/model'); t.write_dataset('{w}/data')",
    "sd_family": "import tiny_sd_family as t; t.build('{w}/model'); t.write_instance_images('{w}/images'); "
    "t.write_controlnet_dataset('{w}/controlnet_data')",
    "sdxl": "import tiny_sana_sdxl as t, tiny_models as m; t.sdxl_pipeline('{w}/model'); "
    "m.dreambooth_images('{w}/images')",
    "sana": "import tiny_sana_sdxl as t, tiny_models as m; t.sana_pipeline('{w}/model'); "
    "m.dreambooth_images('{w}/images')",
    "sd3": "import tiny_sd3_flux as t; t.sd3_pipeline('{w}/model'); t.dreambooth_images('{w}/images')",
    "flux": "import tiny_sd3_flux as t; t.flux_pipeline('{w}/model'); t.dreambooth_images('{w}/images')",
    "qwen": "import tiny_models as m; m.qwen_image_pipeline('{w}/model'); m.dreambooth_images('{w}/images')",
    "cog_t2v": "import tiny_cogvideox as t; t.pipeline('t2v', '{w}/model'); t.videos('{w}/videos')",
    "cog_i2v": "import tiny_cogvideox as t; t.pipeline('i2v', '{w}/model'); t.videos('{w}/videos')",
    # -- SD / SDXL UNet scripts --
    # SD 1.x UNet
    "sd15_data": "import tiny_sd_family as f, tiny_sd15 as t; f.build('{w}/model'); "
    "t.write_pix2pix_dataset('{w}/pix2pix_data'); t.write_shards('{w}/shards'); "
    "t.write_unconditional('{w}/unconditional')",
    # the LCM scripts tokenize their unconditional prompt to a fixed 77 tokens
    "sd15_lcm": "import tiny_sd_family as f, tiny_sd15 as t; f.build('{w}/model', max_length=77); "
    "t.write_shards('{w}/shards')",
    # SDXL UNet
    "sdxl_family": "import tiny_sdxl_family as t; t.build('{w}/model'); t.write_data('{w}/data')",
    "sdxl_adapter": "import tiny_sdxl_family as t; t.build_adapter('{w}/model'); t.write_data('{w}/data')",
    "sdxl_lcm": "import tiny_sdxl_family as t; t.build_lcm('{w}/model'); t.write_data('{w}/data')",
    # -- Flux, Flux2, SD3 DiT scripts --
    # Flux.1 and SD3
    "flux_control": "import tiny_sd3_flux as t, tiny_sd_family as f; t.flux_pipeline('{w}/model'); "
    "f.write_controlnet_dataset('{w}/controlnet_data', size=16)",
    "sd3_control": "import tiny_sd3_flux as t, tiny_sd_family as f; t.sd3_pipeline('{w}/model', num_layers=13); "
    "f.write_controlnet_dataset('{w}/controlnet_data', size=16)",
    # Flux2, Z-Image, Ideogram4
    "flux2": "import tiny_flux2 as t; t.flux2_pipeline('{w}/model'); t.dreambooth_images('{w}/images'); "
    "t.img2img_dataset('{w}/img2img')",
    "flux2_klein": "import tiny_flux2 as t; t.klein_pipeline('{w}/model'); t.dreambooth_images('{w}/images'); "
    "t.img2img_dataset('{w}/img2img')",
    "z_image": "import tiny_flux2 as t; t.z_image_pipeline('{w}/model'); t.dreambooth_images('{w}/images')",
    "ideogram4": "import tiny_flux2 as t; t.ideogram4_pipeline('{w}/model'); t.dreambooth_images('{w}/images')",
    # -- other image DiTs, video, discrete --
    "cosmos25": "import tiny_dits as t; t.cosmos25_pipeline('{w}/model'); t.cosmos25_videos('{w}/data')",
    "dit4dit": "import tiny_dits as t; t.dit4dit('{w}/model')",
    "krea2": "import tiny_dits as t, tiny_models as m; t.krea2_pipeline('{w}/model'); "
    "m.dreambooth_images('{w}/images')",
    "hidream": "import tiny_dits as t, tiny_models as m; t.hidream_pipeline('{w}/model'); "
    "m.dreambooth_images('{w}/images')",
    "amused": "import tiny_dits as t, tiny_models as m; t.amused_pipeline('{w}/model'); "
    "m.dreambooth_images('{w}/images')",
    "cogview4_control": "import tiny_dits as t; t.cogview4_control_pipeline('{w}/model'); "
    "t.control_jsonl('{w}/control')",
    "llada2": "import tiny_dits as t; t.llada2_model('{w}/model')",
    "lumina2": "import tiny_dits as t, tiny_models as m; t.lumina2_pipeline('{w}/model'); "
    "m.dreambooth_images('{w}/images')",
    # -- Kandinsky, VQGAN, aMUSEd, unconditional --
    # Kandinsky 2.2 and VQGAN
    "kandinsky": "import tiny_kandinsky as t; t.build('{w}/model'); t.write_dataset('{w}/data')",
    "vqgan": "import tiny_kandinsky as t; t.vqgan('{w}')",
}


def _build(kind: str, work: Path) -> None:
    """The tiny pipeline at ``work/model`` and its data beside it (once per work directory)."""
    marker = work / ".built"
    if marker.exists():
        return
    work.mkdir(parents=True, exist_ok=True)
    code = BUILDERS[kind].format(w=work)
    env = dict(base_env(), PYTHONPATH=str(REPO / "tests" / "scripts"))
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(REPO / "tests" / "scripts"),
    )
    if done.returncode:  # the builder's own error: a missing matrix extra (`pip install ".[matrix]"`), a bad config
        raise SystemExit(f"building {kind!r} in {work} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    marker.write_text("ok")


# -- measuring a launch -------------------------------------------------------------------------------
def _rss_anon(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


#: a launch whose whole process tree ran less than IDLE_SHARE of one core over this many seconds is hung (ranks
#: waiting in a collective their peers never join: the tree of a stock hang runs ~0.5 % of a core, its launcher's
#: and watchdogs' polls); killed then rather than at --timeout. A tiny model's launch runs about a core while it
#: works; main() sets it from --idle-timeout (0: off)
IDLE_TIMEOUT_S = 120.0
IDLE_SHARE = 0.05


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has run (/proc/<pid>/stat fields 14 and 15); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def watch(proc: subprocess.Popen, timeout: float, idle_s: float = 0.0) -> dict:
    """Wait for ``proc`` (started in a session of its own): its exit code, or "timeout" after ``timeout`` s, or
    "idle" once its process tree has been idle for ``idle_s`` s (0: never); the output, the seconds and the peak
    node RSS (bytes), sampled every 0.5 s. A process killed for either is killed with its whole tree."""
    started = time.monotonic()
    peak, stop, hung = [0], threading.Event(), threading.Event()

    def sample():
        seen: dict[int, float] = {}  # pid -> CPU seconds at its last sample (a gone process adds nothing)
        ran, history = 0.0, collections.deque()  # CPU seconds the tree ran; (time, ran) of the last idle_s
        while not stop.is_set():
            tree = process_tree(proc.pid)
            peak[0] = max(peak[0], sum(_rss_anon(p) for p in tree))
            for pid in tree:
                cpu = _cpu_seconds(pid)
                ran += max(0.0, cpu - seen.get(pid, cpu))
                seen[pid] = cpu
            now = time.monotonic()
            if idle_s:
                history.append((now, ran))
                while len(history) > 1 and now - history[1][0] >= idle_s:
                    history.popleft()  # the oldest sample kept is idle_s or more ago
                since, before = history[0]
                if now - since >= idle_s and ran - before < IDLE_SHARE * (now - since):
                    hung.set()
                    kill_tree(proc.pid)  # the ranks run in sessions of their own (torch's elastic agent)
                    return
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = "idle" if hung.is_set() else proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        code = "timeout"
    stop.set()
    sampler.join()
    return {
        "code": code,
        "output": out.decode(errors="replace"),
        "seconds": time.monotonic() - started,
        "peak_rss": peak[0],
    }


def launch(args: list[str], env: dict, cwd: Path, timeout: float) -> dict:
    """One ``accelerate launch``: exit code ("timeout", "idle": :func:`watch`), output, seconds, peak node RSS."""
    proc = subprocess.Popen(
        [str(BIN / "accelerate"), "launch", "--main_process_port", str(free_port()), *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return watch(proc, timeout, IDLE_TIMEOUT_S)


def _killed(which: str, code, timeout: float) -> str | None:
    """What a killed launch's row says (None: it exited of itself)."""
    if code == "timeout":
        return f"{which}: no exit within {timeout:.0f} s (killed)"
    if code == "idle":
        return f"{which}: every process idle for {IDLE_TIMEOUT_S:.0f} s, a hang (killed)"
    return None


_ERROR = re.compile(r"^(?:\[rank\d+\]: )?((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt)\b:?.*)$")
_FRAME = re.compile(r'^(?:\[rank\d+\]: )?\s*File "([^"]+)", line (\d+)')


def first_error(text: str, script: Path) -> tuple[str, str]:
    """(the first error line, whose it is) from a failed launch's output."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _ERROR.match(line.strip())
        if not m or line.lstrip().startswith(("File ", "warnings.warn")) or "Warning" in m.group(1).split(":")[0]:
            continue
        if any("During handling of the above exception" in x for x in lines[i + 1 : i + 4]):
            continue  # a chained exception: the one raised while handling it is what stopped the run
        frames = [f.group(1) for f in (_FRAME.match(x) for x in lines[max(0, i - 80) : i]) if f]
        # torch raises for whatever called it wrongly: the innermost frame outside torch says whose call it was
        outside = [f for f in frames if "site-packages/torch/" not in f] or frames
        return m.group(1)[:300], _whose(outside[-1] if outside else "", m.group(1), script)
    return (lines[-1][:300] if lines else "no output"), "unknown"


# failures whose cause is known beyond the frame that raised them: (pattern, whose), the pattern searched in
# "<script name>: <first error or failed check>" (a pattern starting ^<script name> is that script's alone)
KNOWN_CAUSES = [
    (
        r"^textual_inversion(_sdxl)?\.py: IndexError: The shape of the mask \[\d+\] at index 0 does not match the "
        r"shape of the indexed tensor \[0\]",
        "accel-npu: not supported under ZeRO-3, because after each step the script writes the original rows back "
        "into the text encoder's embedding in place (`get_input_embeddings().weight[index_no_updates] = ...`, "
        "textual_inversion.py lines 911-917) and a ZeRO-3 parameter is partitioned (shape [0]); accel-npu gathers "
        "such parameters for reading only (plugins/deepspeed/gathered_reads.py), not for writing",
    ),
    (
        r"^train_dreambooth_lora_sd15_advanced\.py: .*(IndexError: list index out of range|no attribute "
        r"'ds_active_sub_modules')",
        "the script's: its load_model_hook (lines 1406-1411) loads the checkpoint's LoRA again with "
        "load_lora_into_unet, which injects a second adapter the optimizer does not hold (the call diffusers #6514 "
        "removed from train_dreambooth_lora_sdxl.py); without those lines the resume passes (zero2, zero3_t0)",
    ),
    (
        r"^train_custom_diffusion\.py: .*multiple models when using DeepSpeed",
        "accelerate's: one model per Accelerator under DeepSpeed (accelerate/accelerator.py Accelerator.prepare); with "
        "--modifier_token the script prepares custom_diffusion_layers and text_encoder together; without it, the "
        "script's final `for token in args.modifier_token` (line 1333) fails on None",
    ),
    (
        r"^train_unconditional\.py: .*CollectiveMisuseError",
        "the script's: after an epoch's wait_for_everyone rank 0 alone samples with DDPMPipeline from the ZeRO-3 model "
        "(lines 677-692, under `if accelerator.is_main_process`) while rank 1 goes on to its next epoch: the parameter "
        "all-gathers never pair, a hang on GPUs too (stock: rank 0 in fetch_sub_module, rank 1 in the DataLoader's RNG "
        "broadcast); accel-npu stops both ranks at the first gather, naming line 692; the error is accel-npu's",
    ),
    (
        r"mat1 and mat2 must have the same dtype, but got Half and BFloat16",
        "the script's: fp16 frozen towers under a bf16 DeepSpeed config (accel-npu casts at the engine: "
        "deepspeed.runtime.engine:DeepSpeedEngine.forward)",
    ),
    (
        r"^train_lcm_distill_(sd|sdxl)_wds\.py: RuntimeError: The size of tensor a \(\d+\) must match the size of "
        r"tensor b \(0\)",
        "the script's, also on GPUs: under ZeRO-3 its EMA update reads the engine's partitioned parameters outside "
        "any gather, shape [0] (update_ema(target_unet.parameters(), unet.parameters()): "
        "train_lcm_distill_sd_wds.py:1371, "
        "train_lcm_distill_sdxl_wds.py:1474; the loop at line 432)",
    ),
    (
        r"^train_lcm_distill_lora_(sd|sdxl)_wds\.py: IndexError: list index out of range",
        "the script's, also on GPUs: its load_model_hook (train_lcm_distill_lora_sd_wds.py:1058-1061, "
        "_sdxl_wds.py:1073-1076) "
        "calls peft's load_adapter after DeepSpeed restored the engine; with bf16 weights peft's cast_adapter_dtype "
        "replaces the LoRA parameters by new fp32 ones (peft/tuners/tuners_utils.py cast_adapter_dtype), which the "
        "ZeRO-2 optimizer does not hold: no gradient hook fires, stage_1_and_2.py reduce_ipg_grads indexes an empty "
        "bucket",
    ),
    (
        r"^train_lcm_distill_lora_(sd|sdxl)_wds\.py: AttributeError: 'Parameter' object has no attribute 'ds_status'",
        "the script's, also on GPUs: its load_model_hook (train_lcm_distill_lora_sd_wds.py:1058-1061, "
        "_sdxl_wds.py:1073-1076) "
        "calls peft's load_adapter after DeepSpeed restored the engine; peft's cast_adapter_dtype replaces the bf16 "
        "LoRA "
        "parameters by new fp32 ones (peft/tuners/tuners_utils.py cast_adapter_dtype), which ZeRO-3 never partitioned: "
        "the next forward's fetch finds no ds_status",
    ),
    (
        r"^train_lcm_distill_lora_sdxl\.py: \d+ of \d+ master tensors not in the loaded artifact",
        "diffusers': the script saves convert_state_dict_to_diffusers(...) (train_lcm_distill_lora_sdxl.py:1445), "
        "attention keys renamed to_k.lora.down, conv / time_emb_proj keys left lora_A; load_lora_adapter converts "
        "only when the first key lacks lora_A (diffusers/loaders/peft.py:212 at v0.40.0; diffusers #14548), so the "
        "attention layers are never injected (only peft's RuntimeWarning about extra target modules says so); "
        "accel-npu's load_lora_adapter patch reads every key (plugins/checkpoints/lora.py): ✘ only with it off",
    ),
    (
        r"expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16",
        "the script's, also on GPUs: fp32 activations into bf16 weights outside what accelerate autocasts under DDP "
        "(accel-npu runs a DeepSpeed engine's forward under autocast when given fp32 activations: "
        "plugins/deepspeed/input_dtype.py)",
    ),
    (
        r"The expanded size of the tensor \(\d+\) must match the existing size \(\d+\) at non-singleton dimension 1\.  "
        r"Target sizes: \[\d+, \d+\]",
        "the script's, also on GPUs: its text attention mask (train_control_cogview4.py:1048, the caption's own "
        "length) is shorter than the prompt embeddings CogView4ControlPipeline.encode_prompt pads to a multiple of 16 "
        "(pipeline_cogview4_control.py:210); transformer_cogview4.py:173 cannot fit one into the other",
    ),
    (
        r"CollectiveMisuseError",
        "the script's: save_state inside `if accelerator.is_main_process:` (diffusers #2606); the error is accel-npu's",
    ),
    (
        r"LoRA\w*Processor\.__init__\(\) got an unexpected keyword argument",
        "upstream (the script's, also on GPUs): diffusers 0.30 made LoRAAttnProcessor / LoRAAttnAddedKVProcessor "
        "argument-less stubs (diffusers #8777, models/attention_processor.py); the Kandinsky 2.2 LoRA scripts still "
        "build them with hidden_size= (diffusers #7606)",
    ),
    (
        r"^train_vqgan\.py: .*You can't use same `Accelerator\(\)` instance with multiple models when using DeepSpeed",
        "accelerate's (also on GPUs): its DeepSpeed path takes one model per prepare (accelerator.py prepare; "
        "accelerate #2974); the script prepares two, each with its optimizer (train_vqgan.py: the VQModel and its "
        "discriminator), which accel-npu gives one engine each",
    ),
]


def _whose(path: str, message: str, script: Path) -> str:
    for pattern, whose in KNOWN_CAUSES:
        if re.search(pattern, f"{script.name}: {message}"):
            return whose
    if "accel-npu" in message or "accel_npu" in path or f"{REPO}/plugins/" in path:
        return "ours (accel-npu)"
    if path and Path(path).resolve() == script.resolve():
        return "the script's"
    m = re.search(r"site-packages/([A-Za-z_]+)/", path)
    return f"{m.group(1)}'s" if m else (path or "unknown")


# -- the witness: the final artifact loaded as a user loads it, against the master weights -------------
def _master(ckpt: Path) -> dict:
    """The checkpoint's trained weights: DeepSpeed's fp32 master weights, or FSDP's sharded model state."""
    if (ckpt / FSDP_MODEL_DIR).is_dir():
        return _fsdp_master(ckpt / FSDP_MODEL_DIR)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


def _fsdp_master(folder: Path) -> dict:
    """accelerate's SHARDED_STATE_DICT model folder (``dcp.save({"model": state_dict})``, one file per rank)
    read back whole, offline, with torch's own converter."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "model.pt"
        dcp_to_torch_save(str(folder), str(target))
        state = torch.load(target, weights_only=False)
    return state["model"]


def _global_steps(ckpt: Path) -> int | None:
    """DeepSpeed's own optimizer-step count saved in a checkpoint (engine.global_steps, restored by a resume)."""
    import torch

    # mp_rank_00_model_states.pt (ZeRO-1/2) or zero_pp_rank_<r>_mp_rank_00_model_states.pt (ZeRO-3)
    files = sorted(ckpt.glob("*/*mp_rank_00_model_states.pt"))
    if not files:
        return None
    return torch.load(files[0], map_location="cpu", weights_only=False).get("global_steps")


def _norm(key: str) -> str:
    key = key.removeprefix("base_model.model.")  # a model the script wrapped with peft's get_peft_model
    return re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", key)


def _torchvision_importable() -> None:
    """Users' environments have torchvision, and some pipelines need it to load (Flux2's PixtralProcessor):
    the launches' paired copy (tests/torchvision_site.py), on this process's path before transformers
    decides whether torchvision is available."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        from tests.torchvision_site import torchvision_site

        sys.path.insert(0, torchvision_site())


class _StandIn:
    """An optional pipeline component the script replaces by a stand-in of its own (``Spec.stand_ins``)."""

    def to(self, *args, **kwargs):
        return self


def _load_artifact(spec: Spec, model: Path, where_dir: Path) -> dict:
    """The artifact in ``where_dir`` loaded as a user loads it: {name: tensor}."""
    import diffusers
    import torch

    kind, cls_name, where, *below = spec.artifact.split(":")  # lora:...:<component>[:<folder under the artifact dir>]
    if kind == "lora":
        stand_ins = {name: _StandIn() for name in spec.stand_ins}
        stand_ins.update(dict.fromkeys(spec.left_out_of_stock_load))  # None: from_pretrained leaves them out
        pipe = getattr(diffusers, cls_name).from_pretrained(str(model), torch_dtype=torch.float32, **stand_ins)
        pipe.load_lora_weights(str(where_dir.joinpath(*below)))
        return {_norm(k): v for k, v in getattr(pipe, where).state_dict().items() if ".lora_" in k}
    if kind == "textual_inversion":  # each encoder's file, as diffusers' textual inversion docs load it
        from safetensors.torch import load_file

        pipe = getattr(diffusers, cls_name).from_pretrained(str(model), torch_dtype=torch.float32)
        loaded = {}
        for component, file in zip(where.split(","), below[0].split(",")):
            encoder, tokenizer = getattr(pipe, component), getattr(pipe, component.replace("text_encoder", "tokenizer"))
            (token,) = load_file(str(where_dir / file))  # {placeholder token: its rows}
            pipe.load_textual_inversion(str(where_dir / file), text_encoder=encoder, tokenizer=tokenizer)
            weight = encoder.get_input_embeddings().weight
            for i in tokenizer.convert_tokens_to_ids([token]):
                loaded[f"{component}.token_embedding.{i}"] = weight[i].detach().clone()
        return loaded
    if kind == "peft":  # peft's save_pretrained (adapter_config.json + adapter_model.safetensors), as peft loads it
        from peft import PeftModel

        base = getattr(diffusers, cls_name).from_pretrained(str(model), subfolder=where, torch_dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, str(where_dir.joinpath(*below)))
        return {_norm(k): v for k, v in loaded.state_dict().items() if ".lora_" in k}
    if kind == "attn_procs":
        # the engine's module is diffusers' AttnProcsLayers: parameter "layers.<i>.<name>" is the i-th entry of
        # the model's attn_processors (diffusers/loaders/utils.py). The file is read into processors by diffusers'
        # own reader (UNet2DConditionModel._process_custom_diffusion): diffusers 0.42's load_attn_procs sets them
        # only when given _pipeline (set_attn_processor sits under `if _pipeline is not None:`), and then wants
        # one per attention layer, where the script's save_attn_procs writes the trained attn2 ones only
        from safetensors.torch import load_file

        component = getattr(getattr(diffusers, cls_name).from_pretrained(str(model), torch_dtype=torch.float32), where)
        names = list(component.attn_processors)
        read = component._process_custom_diffusion(state_dict=load_file(str(where_dir / below[0])))
        return {
            f"layers.{names.index(name)}.{k}": v
            for name, processor in read.items()
            for k, v in processor.state_dict().items()
        }
    if kind == "module":
        import importlib

        from accelerate.utils import load_checkpoint_in_model

        module_name, cls = cls_name.rsplit(".", 1)
        loaded = getattr(importlib.import_module(module_name), cls)(str(model))
        load_checkpoint_in_model(loaded, str(where_dir / where), strict=True)
        return loaded.state_dict()
    loaded = getattr(diffusers, cls_name).from_pretrained(str(where_dir), subfolder=where or None)
    return loaded.state_dict()


def _folder_weights(folder: Path) -> dict:
    """Every tensor of the safetensors files in ``folder`` (one model's weights, sharded or not)."""
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return weights


def _initial(spec: Spec, model: Path) -> dict:
    """The initial values of the tensors the script trains, where the model folder holds them: a full model's
    component folder as the builder wrote it; a textual inversion's new token rows, which the script
    initialises with the initializer token's row. {} otherwise (LoRA B starts at zero: ``trained_check``)."""

    kind, cls_name, where, *below = spec.artifact.split(":")
    if kind == "textual_inversion":
        from transformers import AutoTokenizer

        word = spec.data[spec.data.index("--initializer_token") + 1]
        rows = {}
        for component in where.split(","):
            tokenizer = AutoTokenizer.from_pretrained(str(model / component.replace("text_encoder", "tokenizer")))
            weights = _folder_weights(model / component)
            (table,) = [v for k, v in weights.items() if k.endswith("embeddings.token_embedding.weight")]
            (initializer,) = tokenizer.encode(word, add_special_tokens=False)
            # the script adds the placeholder token at the end of the vocabulary (tokenizer.add_tokens)
            rows[f"{component}.token_embedding.{len(tokenizer)}"] = table[initializer].clone()
        return rows
    if kind == "full" and where and (model / where).is_dir():
        return _folder_weights(model / where)
    return {}


def _loaded_without_accel_npu(request: dict) -> dict:
    """Runs in the fresh interpreter ``load_without_accel_npu`` starts (ACCEL_NPU_DISABLE=1): the artifacts and
    the initial weights it asks for, and whether accel-npu was active after all (it must not be)."""
    given = request["spec"]  # JSON made the tuple fields lists
    spec = Spec(**{**given, **{f.name: tuple(given[f.name]) for f in dataclasses.fields(Spec) if f.default == ()}})
    model = Path(request["model"])
    # no torchvision here: the paired wheel this machine's launches use is a CUDA build, which dies on import
    # without accel-npu's torchvision_compat (pytorch/vision#9085); a box without torchvision loads these too
    if request.get("pretrained"):
        result = {"pretrained": compare_pretrained(spec, model, Path(request["pretrained"]))}
    else:
        result = {
            "loaded": [_load_artifact(spec, model, Path(d)) for d in request["dirs"]],
            "initial": _initial(spec, model),
        }
    import accel_npu

    result["accel_npu_active"] = accel_npu.is_active()
    return result


def load_without_accel_npu(spec: Spec, model: Path, dirs: list[Path] = (), pretrained: Path | None = None) -> dict:
    """``_load_artifact`` of each of ``dirs`` (and ``_initial``), or ``compare_pretrained`` of ``pretrained``,
    run in a new interpreter with ``ACCEL_NPU_DISABLE=1``: the artifact loads as it loads on a user's inference box
    without accel-npu (this process imported diffusers, which activated accel-npu). Raises RuntimeError with the
    end of its output when it fails."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        answer = Path(tmp) / "loaded.pt"
        request = {
            "spec": dataclasses.asdict(spec),
            "model": str(model),
            "dirs": [str(d) for d in dirs],
            "pretrained": str(pretrained) if pretrained else "",
            "answer": str(answer),
        }
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--load-without-accel-npu", json.dumps(request)],
            env=base_env(ACCEL_NPU_DISABLE="1", PYTHONPATH=os.environ.get("PYTHONPATH", "")),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode:
            error, _ = first_error(done.stdout + done.stderr, spec.script)
            raise RuntimeError(f"stock load (ACCEL_NPU_DISABLE=1): {error}")
        result = torch.load(answer, weights_only=False)
    if result.pop("accel_npu_active"):
        raise RuntimeError("accel-npu was active in the ACCEL_NPU_DISABLE=1 process")
    return result


def _master_of(spec: Spec, ckpt: Path, got: dict) -> dict:
    """``ckpt``'s master weights under the artifact's names (``got``: the loaded artifact)."""
    master = _master(ckpt)
    kind, _, where, *_ = spec.artifact.split(":")
    if kind == "attn_procs":
        # AttnProcsLayers' parameters; under one engine with other models prepared together (accel-npu's
        # plugins/deepspeed/models_together.py) each model's names start with its index: "0.layers.<i>..."
        return {re.sub(r"^\d+\.(?=layers\.)", "", k): v for k, v in master.items() if re.match(r"^(\d+\.)?layers\.", k)}
    if kind in ("lora", "peft"):
        return {_norm(k): v for k, v in master.items() if ".lora_" in k}
    if kind == "textual_inversion":
        # each encoder's token embedding; encoders prepared together are named "<index>.text_model..." (transformers
        # 5 dropped CLIPTextModel's text_model level: "<index>.embeddings...")
        tables = sorted(k for k in master if re.search(r"(^|\.)embeddings\.token_embedding\.weight$", k))
        components = where.split(",")
        if len(tables) != len(components):
            raise RuntimeError(f"{len(tables)} token embeddings in {ckpt.name}'s master weights for {components}")
        table = dict(zip(components, (master[k] for k in tables)))
        rows = {}
        for key in got:
            component, _, index = key.rsplit(".", 2)
            rows[key] = table[component][int(index)]
        return rows
    return master


def equal_to_master(master: dict, got: dict) -> tuple[bool, str]:
    """(equal, what): every master tensor in the loaded artifact, equal to it or to its bf16 rounding."""
    import torch

    missing = sorted(set(master) - set(got))
    if not master or missing:
        return False, f"{len(missing)} of {len(master)} master tensors not in the loaded artifact"
    worst = 0.0
    for k, v in master.items():
        g = got[k].float()
        if not (torch.equal(g, v) or torch.equal(g, v.to(torch.bfloat16).float())):
            worst = max(worst, (g - v).abs().max().item())
    if worst and all(torch.equal(got[k].float(), v.half().float()) for k, v in master.items()):
        return False, (
            "the loaded artifact equals the master weights rounded to float16, not bfloat16: the "
            "engine's module ran in fp16 under a bf16 DeepSpeed config"
        )
    if worst:
        return False, f"loaded artifact differs from the master weights: max |Δ| {worst:.3g}"
    return True, f"{len(master)} tensors = master"


def trained_check(spec: Spec, got: dict, initial: dict, earlier: dict, earlier_name: str) -> tuple[bool, str]:
    """(trained, what): every tensor the script trains differs from its initial value. The tensors it trains: a
    LoRA's B matrices (initialised to zero; A starts random, unknown here), a textual inversion's new token rows
    (initialised to the initializer token's row), else every tensor of the artifact bar ``Spec.untrained``. Their
    initial value: ``initial`` (the model folder), else the master weights of the first checkpoint (``earlier``:
    then it shows the optimizer stepped after that checkpoint). A bf16 artifact must differ from the initial
    value's bf16 rounding too."""
    import torch

    kind = spec.artifact.split(":")[0]
    trained = {k: v for k, v in got.items() if not (spec.untrained and re.search(spec.untrained, k))}
    left_out = f"; /{spec.untrained}/ left out (not trained by the script)" if spec.untrained else ""
    if kind in ("lora", "peft"):
        trained = {k: v for k, v in trained.items() if ".lora_B." in k}
        if not trained:
            return False, "no LoRA B matrix in the loaded artifact"
        zero = [k for k, v in trained.items() if not v.float().abs().max().item()]
        if zero:
            return False, (
                f"not trained: {len(zero)} of {len(trained)} LoRA B = 0, their initialisation: {zero[:3]}{left_out}"
            )
        return True, f"trained: {len(trained)} LoRA B ≠ 0, their initialisation{left_out}"
    if not trained:
        return False, "not trained: no tensor to check"
    unchanged, against = [], {"from the model folder": 0, f"from {earlier_name}": 0}
    for k, v in trained.items():
        start, source = initial.get(k), "from the model folder"
        if start is None or start.shape != v.shape:
            start, source = earlier.get(k), f"from {earlier_name}"
        if start is None:
            return False, f"not trained: no initial value for {k} (neither the model folder nor {earlier_name})"
        against[source] += 1
        start = start.float()
        if torch.equal(v.float(), start) or torch.equal(v.float(), start.to(torch.bfloat16).float()):
            unchanged.append(k)
    if kind == "textual_inversion":
        what = f"{len(trained)} new token rows ≠ the initializer token's, their initialisation"
    else:
        what = (
            f"{len(trained)} tensors ≠ their initial value ("
            + ", ".join(f"{n} {s}" for s, n in against.items() if n)
            + ")"
        )
    what += left_out
    if unchanged:
        return False, f"not trained: {len(unchanged)} of {what.replace('≠', 'checked, equal to')}: {unchanged[:3]}"
    return True, f"trained: {what}"


def resume_check(resumed: dict, straight: dict, tolerance: float | None) -> tuple[bool, str]:
    """(equal, what): the resumed run's artifact against a straight same-seed run's, bit for bit unless
    ``tolerance`` (the largest |Δ| accepted) is given."""
    import torch

    if set(resumed) != set(straight):
        return False, f"resumed ≠ straight: {len(set(resumed) ^ set(straight))} tensor names differ"
    differ = [k for k, v in resumed.items() if not torch.equal(v, straight[k])]
    if not differ:
        return True, "resumed = straight bit for bit"
    worst = max((resumed[k].float() - straight[k].float()).abs().max().item() for k in differ)
    if tolerance is not None and worst <= tolerance:
        return True, f"resumed ≈ straight: max |Δ| {worst:.3g} ≤ {tolerance:g} (stated tolerance)"
    bound = f" > {tolerance:g} (stated tolerance)" if tolerance is not None else " (bit for bit expected)"
    return False, f"resumed ≠ straight: {len(differ)} of {len(resumed)} tensors differ, max |Δ| {worst:.3g}{bound}"


def compare_artifact(
    spec: Spec, model: Path, out: Path, ckpt: Path, first: Path | None = None, straight: Path | None = None
) -> tuple[bool, str]:
    """(sound, what) for the final artifact in ``out`` (or the one in ``ckpt``: ``Spec.artifact_in``), loaded
    without accel-npu: equal to ``ckpt``'s fp32 master weights, trained (``trained_check``; ``first``: the first
    checkpoint, whose master weights stand in for initial values the model folder lacks), and equal to the
    artifact of the straight run in ``straight`` (when given). The failed checks come first."""
    in_ckpt = spec.artifact_in == "checkpoint"
    dirs = [ckpt if in_ckpt else out] + ([out] if in_ckpt else []) + ([straight] if straight else [])
    answer = load_without_accel_npu(spec, model, dirs)
    loaded = answer["loaded"]
    got = loaded[0]
    results = []
    if in_ckpt and set(loaded[1]) != set(got):
        n = len(set(loaded[1]) ^ set(got))
        results.append((False, f"the final artifact's tensors are not the checkpoint's: {n} names differ"))
    results.append(equal_to_master(_master_of(spec, ckpt, got), got))
    earlier = {}  # a LoRA's initial values are known (B = 0): no second checkpoint to read
    if first is not None and first != ckpt and spec.artifact.split(":")[0] not in ("lora", "peft"):
        earlier = _master_of(spec, first, got)
    results.append(trained_check(spec, got, answer["initial"], earlier, first.name if first else "no checkpoint"))
    if straight:
        results.append(resume_check(got, loaded[-1], spec.resume_tolerance))
    results.append((True, stock_loaded(spec)))
    ordered = [r for r in results if not r[0]] + [r for r in results if r[0]]
    return all(ok for ok, _ in results), "; ".join(what for _, what in ordered)


def compare_pretrained(spec: Spec, model: Path, out: Path) -> tuple[bool, str]:
    """(sound, what) for a script that saves its model with save_pretrained and no DeepSpeed checkpoint (no
    master weights to compare with): the safetensors files read back hold every tensor of the architecture
    their config describes, at its shape, finite, and each changed from the initial weights."""
    import torch
    import transformers

    _, cls_name, where = spec.artifact.split(":")
    cls = getattr(transformers, cls_name)
    saved = _folder_weights(out / where)
    skeleton = cls.from_config(transformers.AutoConfig.from_pretrained(str(out / where))).state_dict()
    initial = cls.from_pretrained(str(model)).state_dict()
    wrong = [k for k, v in skeleton.items() if k not in saved or saved[k].shape != v.shape]
    if not saved or wrong:
        return False, f"{len(wrong)} of {len(skeleton)} tensors missing or of another shape in {where}/"
    bad = [k for k, v in saved.items() if not torch.isfinite(v.float()).all()]
    unchanged = [
        k
        for k, v in saved.items()
        if k in initial and initial[k].shape == v.shape and torch.equal(v.float(), initial[k].to(v.dtype).float())
    ]
    if bad or unchanged:
        return False, f"{where}/: {len(bad)} tensors not finite, {len(unchanged)} unchanged from the initial weights"
    return True, (
        f"no DeepSpeed checkpoint (save_pretrained): {where}/ read back, {len(skeleton)} tensors of the "
        "architecture's shapes, finite, all trained"
    )


# -- one row ----------------------------------------------------------------------------------------
def fsdp_supported(script: Path) -> bool:
    text = script.read_text()
    return "DistributedType.FSDP" in text or "fsdp_plugin" in text


def run_row(spec: Spec, config: str, root: Path, steps: int, every: int, resume_to: int, timeout: float) -> dict:
    script = spec.script
    work = root / spec.builder
    _build(spec.builder, work)
    cfgs = shipped_zero_configs(root)
    from tests.torchvision_site import with_torchvision

    env = with_torchvision(
        base_env(
            HF_DATASETS_CACHE=str(root / "datasets-cache"), **{k: v.format(work=work) for k, v in spec.env.items()}
        ),
        *spec.site,
    )
    if config == "stock_zero2":
        env.update(STOCK_ENV)
    # accel-npu writes checkpoints in the background by default in launched ranks; the other columns keep the
    # synchronous save_state they were measured with, so each column measures one path
    if config.endswith("_async"):
        env["ACCEL_NPU_ASYNC_CHECKPOINT"] = "1"
        config_file = config.removesuffix("_async")
    else:
        env["ACCEL_NPU_ASYNC_CHECKPOINT"] = "0"
        config_file = "zero2" if config == "stock_zero2" else config
    cfgs["fsdp2"] = root / "fsdp2.yaml"
    cfgs["fsdp2"].write_text(json.dumps(FSDP2_CONFIG))  # JSON is YAML
    if config_file.endswith("_sp2"):
        import yaml

        base_config = config_file.removesuffix("_sp2")
        sp2 = yaml.safe_load(cfgs[base_config].read_text())
        sp2["parallelism_config"] = {"parallelism_config_sp_size": 2}
        cfgs[config_file] = root / f"{config_file}.yaml"
        cfgs[config_file].write_text(yaml.safe_dump(sp2))
    cfg = cfgs[config_file]
    out = root / f"{spec.name}-{config}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    data = [a.format(work=work) for a in spec.data]
    cli = {**OFFICIAL_CLI, **spec.cli}
    per_epoch = spec.epoch_steps or 1
    values = dict(
        work=work,
        model=work / "model",
        out=out,
        steps=steps,
        every=every,
        resume_to=resume_to,
        more=resume_to - steps,
        epochs=steps // per_epoch,
        resume_epochs=resume_to // per_epoch,
    )

    def fill(args: list[str], given: dict = values) -> list[str]:
        return [a.format(**given) for a in args]

    def base_of(given: dict) -> list[str]:
        model_args, common = fill(cli["model"], given), fill(cli["common"], given)
        return ["--config_file", str(cfg), str(script), *model_args, *data, *spec.extra, *common]

    base = base_of(values)
    runs = [launch(base + fill(cli["first"]), env, root, timeout)]
    if runs[0]["code"] == 0 and cli["resume"] is not None:
        runs.append(launch(base + fill(cli["resume"]), env, root, timeout))
    for i, r in enumerate(runs, 1):  # each launch's whole output beside its artifacts, for reading a ✘
        (out / f"launch-{i}.log").write_text(r["output"])
    row = {"seconds": sum(r["seconds"] for r in runs), "peak_rss": max(r["peak_rss"] for r in runs)}
    failed = next((r for r in runs if r["code"] != 0), None)
    if failed is not None:
        which = "first launch" if failed is runs[0] else "resumed launch"
        what = _killed(which, failed["code"], timeout)
        if what is not None:
            whose = _whose("", what, script)
            return {**row, "ok": False, "what": what, "whose": "unknown (a hang)" if whose == "unknown" else whose}
        error, whose = first_error(failed["output"], script)
        return {**row, "ok": False, "what": f"{which}: {error}", "whose": whose}
    if spec.checkpoint is None:
        try:
            ok, what = load_without_accel_npu(spec, work / "model", pretrained=out)["pretrained"]
            what += "; " + stock_loaded(spec)
        except Exception as exc:  # noqa: BLE001 - the row records it
            ok, what = False, f"loading the final artifact: {type(exc).__name__}: {str(exc)[:200]}"
        return {**row, "ok": ok, "what": what, "whose": "" if ok else "unknown"}
    written = sorted(
        (p for p in out.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    if spec.checkpoint == "latest":
        last = written[-1] if written else out / "checkpoint-(none)"
    else:
        last = out / spec.checkpoint.format(**values)
    if cli["resume"] is None:
        resumed, expected = True, ""
    elif spec.resumed_from is None:
        counted = _global_steps(last)
        resumed, expected = counted == resume_to, f"resume (DeepSpeed's global_steps in {last.name}: {counted}) and "
    else:
        resumed = spec.resumed_from.format(**values) in runs[1]["output"]
        expected = f"resume from {spec.resumed_from.format(**values)} and "
    if not resumed or not last.is_dir():
        return {
            **row,
            "ok": False,
            "whose": "unknown",
            "what": f"did not {expected}write {last.name}: {[p.name for p in written]}",
        }
    straight = None
    if cli["resume"] is not None:  # the same seed straight to --resume-to, in a folder of its own
        straight = root / f"{spec.name}-{config}-straight"
        shutil.rmtree(straight, ignore_errors=True)
        straight.mkdir(parents=True)
        given = dict(values, out=straight, steps=resume_to, epochs=resume_to // per_epoch)
        runs.append(launch(base_of(given) + fill(cli.get("straight", cli["first"]), given), env, root, timeout))
        (straight / "launch-straight.log").write_text(runs[-1]["output"])
        row = {"seconds": sum(r["seconds"] for r in runs), "peak_rss": max(r["peak_rss"] for r in runs)}
        what = _killed("straight launch", runs[-1]["code"], timeout)
        if what is not None:
            return {**row, "ok": False, "what": what, "whose": "unknown (a hang)"}
        if runs[-1]["code"] != 0:
            error, whose = first_error(runs[-1]["output"], script)
            return {**row, "ok": False, "what": f"straight launch: {error}", "whose": whose}
    try:
        first_ckpt = written[0] if written else None
        ok, what = compare_artifact(spec, work / "model", out, last, first_ckpt, straight)
    except Exception as exc:  # noqa: BLE001 - the row records it
        ok, what = False, f"loading the final artifact: {type(exc).__name__}: {str(exc)[:200]}"
    whose = "" if ok else _whose("", what.split("; ")[0], script)  # the first failed check's
    if cli["resume"] is None:
        what = f"one launch (the script has no resume option); {last.name}: {what}"
    return {**row, "ok": ok, "what": what, "whose": whose}


# -- the results file ---------------------------------------------------------------------------------
HEADER = [
    "script",
    "family",
    "config",
    "result",
    "checks",
    "first error / check",
    "whose",
    "wall",
    "peak node RSS",
    "commit",
    "date",
]


# what a row's ✔ covers (the "checks" cell): rows run before the trained / straight-run / stock-load checks
# existed cover "master" and a resume seen in the output only
CHECKS = ("master", "trained", "resume = straight", "stock load")
OLD_CHECKS = "master (older runner)"


def stock_loaded(spec: Spec) -> str:
    if not spec.left_out_of_stock_load:
        return "loaded without accel-npu"
    names = ", ".join(spec.left_out_of_stock_load)
    return f"loaded without accel-npu ({names} left out there: stock cannot import this machine's torchvision)"


def row_checks(spec: Spec) -> str:
    cli = {**OFFICIAL_CLI, **spec.cli}
    if spec.checkpoint is None:  # compare_pretrained: no master weights; its own "changed from initial"
        return "trained, stock load"
    return ", ".join(c for c in CHECKS if c != "resume = straight" or cli["resume"] is not None)


def _commit() -> str:
    """HEAD's short id, "+dirty" when files other than results files differ from it (as benchmarks' stamp)."""
    try:
        sha, changed = git_state(REPO)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha[:7] + ("+dirty" if changed else "")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def read_rows(path: Path | None = None) -> dict:
    path = path or RESULT_FILE
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("| `"):
                cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
                if len(cells) == len(HEADER) - 1:  # a row written before the "checks" column
                    cells.insert(HEADER.index("checks"), OLD_CHECKS if cells[3] in ("✔", "✘") else "")
                if len(cells) == len(HEADER):
                    rows[(cells[0], cells[2])] = cells
    return rows


def write_rows(new: dict, argv: list[str], path: Path | None = None) -> Path:
    import filelock

    path = path or RESULT_FILE
    with filelock.FileLock(str(path) + ".lock", timeout=120):  # two runners may merge at once
        return _write_rows(new, argv, path)


def _write_rows(new: dict, argv: list[str], path: Path) -> Path:
    rows = read_rows(path)
    rows.update(new)
    have = {s.name for s in SPECS}  # a script given a Spec since its "not run" row was written
    rows = {k: v for k, v in rows.items() if not (k[1] == "all" and k[0].strip("`") in have)}
    planned = {f"`{s.name}`" for s in SPECS}  # a script given a Spec since: its "not run" row goes
    rows = {k: v for k, v in rows.items() if not (k[1] == "all" and k[0] in planned)}
    order = {s.name: i for i, s in enumerate(SPECS)}
    keys = sorted(
        rows,
        key=lambda k: (
            order.get(k[0].strip("`"), len(order)),
            k[0],
            CONFIGS.index(k[1]) if k[1] in CONFIGS else len(CONFIGS),
        ),
    )
    lines = [
        "# Official diffusers v0.40.0 training scripts × launch configs (2 CPU ranks, tiny models)",
        "",
        f"Reproduce: `{command_line(argv)}` (rows of a partial run replace their own; each row keeps the "
        "commit and date it was run on).",
        "",
        f"- Commit: {git_commit()} (the run that last wrote this file; each row names the commit it ran on, "
        "+dirty where files other than results files differed from it)",
        f"- Libraries (the run that last wrote this file): {versions('peft')}",
        "",
        "Configs: `zero2` = launch_configs/cpu_zero2.yaml (bf16); `zero3_t0` = cpu_zero3.yaml with "
        "`stage3_param_persistence_threshold: 0`; `stock_zero2` = cpu_zero2 with accel-npu's plugins off but "
        "those forming the 2 CPU ranks (tools/compatibility.py STOCK_ENV); `fsdp2` only for scripts "
        "that handle FSDP (tools/compatibility.py FSDP2_CONFIG: fsdp_version 2, TRANSFORMER_BASED_WRAP, "
        "SHARDED_STATE_DICT, bf16); `*_async` with ACCEL_NPU_ASYNC_CHECKPOINT=1 for one script per shape; "
        "`*_sp2` with `parallelism_config_sp_size: 2` (Ulysses sequence parallelism over the 2 ranks) for the "
        "scripts whose transformer it splits. ✔ = every launch exits 0, the resumed launch "
        "resumes from `latest`, and "
        "the checks the row's `checks` cell names hold: `master` = the final artifact, loaded as a user loads it, "
        "equals DeepSpeed's fp32 master weights (zero_to_fp32) of the last checkpoint, or under fsdp2 its model "
        "folder consolidated by torch's dcp_to_torch_save (or their bf16 rounding); `trained` = every tensor the "
        "script trains differs from its initial value (LoRA B from zero, a textual inversion's new token rows "
        "from the initializer token's, a full model's tensors from the model folder, else from the first "
        "checkpoint; the row says which); `resume = straight` = the artifact of the run resumed at step 4 to 6 "
        "equals a straight same-seed run's to 6, bit for bit unless the row names a tolerance; `stock load` = "
        "those loads ran in a fresh process with ACCEL_NPU_DISABLE=1. Rows whose checks cell says "
        f"`{OLD_CHECKS}` were run before the last three checks existed: their ✔ covers `master` and a resume "
        "named in the output only. Peak node RSS: the launch's process tree, RssAnon summed, sampled "
        "every 0.5 s. Wall: all launches of the row on a shared 2-core machine.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" for _ in HEADER) + "|",
    ]
    lines += ["| " + " | ".join(rows[k]) + " |" for k in keys]
    lines += ["", summary(rows)]
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".md.partial")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


def summary(rows: dict) -> str:
    """The headline: official scripts' rows only (a user's own script, tests/scripts/, is counted apart)."""
    users = {f"`{s.name}`" for s in SPECS if not s.official}
    run = [r for k, r in rows.items() if r[3] in ("✔", "✘")]
    official = [r for r in run if r[0] not in users]
    per_config = {}
    for r in official:
        per_config.setdefault(r[2], []).append(r[3] == "✔")
    configs = ", ".join(f"{c} {sum(v)} of {len(v)}" for c, v in sorted(per_config.items()))
    checked = [r for r in official if r[4] not in ("", OLD_CHECKS)]
    theirs = [r for r in run if r[0] in users]
    not_run = sum(1 for r in rows.values() if r[5].startswith("not run:"))
    ok_official, ok_theirs = sum(r[3] == "✔" for r in official), sum(r[3] == "✔" for r in theirs)
    return (
        f"Official scripts: {ok_official} of {len(official)} rows run are ✔ "
        f"({len({r[0] for r in official})} scripts; ✔ per config: {configs}); {len(checked)} of these rows ran the "
        f"trained / straight-run / stock-load checks (the others: `{OLD_CHECKS}`). {not_run} more scripts are "
        f"listed as not run, each with why. Users' own scripts, not counted: {ok_theirs} of {len(theirs)} rows ✔ "
        f"({', '.join(sorted(users))})."
    )


# the official training scripts: train_*.py, and the textual inversion scripts, named otherwise
OFFICIAL_SCRIPTS = ("train_*.py", "textual_inversion*.py")


def not_run_rows(stamp: list[str]) -> dict:
    """A row for every vendored official script without a tiny builder here, saying so."""
    have = {s.name for s in SPECS}
    rows = {}
    for path in sorted(p for pattern in OFFICIAL_SCRIPTS for p in UPSTREAM_EXAMPLES.rglob(pattern)):
        if path.name in have:
            continue
        family = path.parent.name
        if "flax" in path.name:
            why = "not run: a Flax (JAX) script, not torch"
        else:
            why = "not run: no tiny builder for its pipeline in tests/scripts/ yet"
        rows[(f"`{path.name}`", "all")] = [f"`{path.name}`", family, "all", "–", "", why, "", "", "", *stamp]
    return rows


def main(argv: list[str] | None = None) -> int:
    global IDLE_TIMEOUT_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--family", default="", help="comma-separated families (SD, SDXL, SD3, Flux, Sana, Qwen-Image, CogVideoX)"
    )
    parser.add_argument("--only", default="", help="comma-separated substrings of script names")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated of {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpointing-steps", type=int, default=2)
    parser.add_argument("--resume-to", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=IDLE_TIMEOUT_S,
        help="seconds a launch's processes may all sit idle before it counts as a hang and is killed (0: never)",
    )
    parser.add_argument("--work", default="", help="work directory (default: a temporary one, removed)")
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows the results file already holds from this commit (a clean checkout): an interrupted run "
        "goes on where it stopped",
    )
    parser.add_argument(
        "--results",
        default=str(RESULT_FILE),
        help="the results file to merge the rows into (another one, e.g. a copy, to try a change)",
    )
    args = parser.parse_args(argv)
    IDLE_TIMEOUT_S = args.idle_timeout
    results = Path(args.results)
    families = {f.strip().lower() for f in args.family.split(",") if f.strip()}
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)} (choose from {', '.join(CONFIGS)})")
    specs = [
        s
        for s in SPECS
        if (not families or s.family.lower() in families) and (not only or any(o in s.name for o in only))
    ]
    plan = [(s, c) for s in specs for c in configs]
    if args.list:
        for s, c in plan:
            print(f"{s.path:55} {s.family:11} {c}")
        return 0
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="accel-npu-compat-"))
    root.mkdir(parents=True, exist_ok=True)
    new = {}
    done = {}
    if args.resume and not _commit().endswith("+dirty"):
        done = {key: row for key, row in read_rows(results).items() if row[-2] == _commit() and row[3] in ("✔", "✘")}
    try:
        for spec, config in plan:
            stamp = [_commit(), f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"]
            key = (f"`{spec.name}`", config)
            if key in done:
                new[key] = done[key]
                continue
            if config.startswith("fsdp2") and not fsdp_supported(spec.script):
                continue  # scripts that do not handle FSDP get no FSDP2 row
            if config.endswith("_async") and spec.name not in ASYNC_SCRIPTS:
                continue  # the asynchronous column: one script per shape
            if config.endswith("_sp2") and spec.name not in SP_SCRIPTS:
                continue  # the sequence-parallel column: transformers with a plan
            print(f"{spec.name} × {config} ...", flush=True)
            row = run_row(spec, config, root, args.steps, args.checkpointing_steps, args.resume_to, args.timeout)
            new[key] = [
                key[0],
                spec.family,
                config,
                "✔" if row["ok"] else "✘",
                row_checks(spec),
                _cell(row["what"]),
                _cell(row["whose"]),
                f"{row['seconds']:.0f} s",
                f"{row['peak_rss'] / 2**30:.2f} GiB",
                *stamp,
            ]
            print("  " + " | ".join(new[key][3:9]), flush=True)
            write_rows(new, sys.argv if argv is None else [sys.argv[0], *argv], results)
        stamp = [_commit(), f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"]
        new.update(not_run_rows(stamp))
        path = write_rows(new, sys.argv if argv is None else [sys.argv[0], *argv], results)
        print(f"wrote {path}")
    finally:
        if not args.work:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--load-without-accel-npu"]:  # load_without_accel_npu's fresh interpreter
        import torch

        request = json.loads(sys.argv[2])
        torch.save(_loaded_without_accel_npu(request), request["answer"])
        sys.exit(0)
    sys.exit(main())
