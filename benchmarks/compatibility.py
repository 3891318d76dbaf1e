"""The validated-scripts matrix: diffusers v0.40.0's official ``train_*.py`` scripts, unchanged, on 2 CPU
ranks under each launch config, measured and recorded in ``benchmarks/results/compatibility.md``.

For each script with a tiny builder (tests/scripts/tiny_*.py: real classes, random weights, configs of
diffusers' own tests) × config:

- ``zero2``: the shipped launch_configs/cpu_zero2.yaml (bf16);
- ``zero3_t0``: the shipped cpu_zero3.yaml with ``stage3_param_persistence_threshold: 0`` (every
  parameter partitioned, as a real-size model is under the shipped threshold);
- ``stock_zero2``: cpu_zero2 as stock runs it, as far as this machine lets stock form 2 ranks (see STOCK);
- ``fsdp2``: only for scripts that handle ``DistributedType.FSDP``; none of them has a tiny builder yet.

it launches the vendored script (tests/upstream/) for ``--steps`` steps with ``--checkpointing_steps``,
then again with ``--resume_from_checkpoint latest`` to ``--resume-to``, loads the final artifact as a
user does (``load_lora_weights`` into the pipeline / ``from_pretrained``) and compares it with DeepSpeed's
own fp32 master weights of the last checkpoint (``zero_to_fp32``). A row is ✔ when both launches exit 0,
the second resumes from the first's last checkpoint, and every loaded tensor equals its master weight
(or the master weight rounded to bf16); otherwise ✘ with the first error and whose it is (the file of the
traceback's innermost frame). Wall time covers both launches; peak node RSS is the largest sum, over the
launch's process tree, of ``RssAnon`` (/proc/<pid>/status), sampled every 0.5 s.

Rows are merged into the results file: a partial run (``--only``, ``--family``, ``--configs``) replaces
its rows and keeps the others with their own commit and date. Scripts not run get a row saying why.

needs: pip install ".[test,matrix]" (setup.cfg)
usage: python benchmarks/compatibility.py [--family SD,CogVideoX] [--only NAME,...] [--configs zero2,...]
       python benchmarks/compatibility.py --list
"""
from __future__ import annotations

import argparse
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

from benchmarks._results import RESULTS, command_line, git_commit  # noqa: E402
from tests.launch_utils import BIN, UPSTREAM_EXAMPLES, base_env, free_port, shipped_zero_configs  # noqa: E402

RESULT_FILE = RESULTS / "compatibility.md"
CONFIGS = ("zero2", "zero3_t0", "stock_zero2", "fsdp2")
# stock on CPU: ACCEL_NPU_DISABLE=1 makes every rank rank 0 of 1 (stock accelerate starts no gloo group
# without an accelerator), so stock runs with every plugin off but those that form the 2 CPU ranks (cpu,
# launcher and deepspeed_setup, the last two essential) and torchvision_compat (the registry's CUDA
# torchvision fails stock's imports here), and deepspeed_setup's training-time patches off
STOCK_ENV = {
    "ACCEL_NPU_DISABLED_PLUGINS": "npu,cuda,precision,video,ddp,loading,frozen_towers,checkpoints,"
                                  "launch_settings,hang_watch",
    "ACCEL_NPU_DISABLED_PATCHES": "deepspeed.runtime.engine:DeepSpeedEngine.forward,"
                                  "deepspeed.runtime.zero.partitioned_param_coordinator:"
                                  "PartitionedParameterCoordinator.fetch_sub_module,"
                                  "accelerate.accelerator:Accelerator.prepare",
}
PROMPT = "a photo of sks dog"


@dataclass
class Spec:
    """How to run one official script on a tiny pipeline."""
    path: str  # relative to examples/
    family: str
    builder: str  # key of BUILDERS
    data: list[str]  # arguments naming the data, {work} substituted
    # "lora:<PipelineClass>:<component>[:<folder in output_dir>]", "full:<ModelClass>:<subfolder>" or
    # "attn_procs:<PipelineClass>:<component>:<weight file>" (save_attn_procs at output_dir)
    artifact: str
    extra: list[str] = field(default_factory=list)
    model_flag: str | None = "--pretrained_model_name_or_path"  # None: the script builds its model from a config
    seed_flag: str | None = "--seed"
    epoch_steps: int = 0  # > 0: the script counts --num_epochs, not --max_train_steps; optimizer steps an epoch
    causes: list[tuple[str, str]] = field(default_factory=list)  # this script's known causes, as KNOWN_CAUSES

    @property
    def name(self) -> str:
        return Path(self.path).name


DREAMBOOTH = ["--instance_data_dir", "{work}/images", "--instance_prompt", PROMPT]
LORA_T = ["--rank", "4", "--resolution", "16", "--train_batch_size", "1", "--learning_rate", "1e-2",
          "--dataloader_num_workers", "0"]
SD = ["--resolution", "32", "--train_batch_size", "2", "--learning_rate", "1e-3", "--dataloader_num_workers", "0"]
# the LCM scripts' webdataset loader divides by its worker count: at least one worker
LCM = ["--resolution", "32", "--train_batch_size", "2", "--learning_rate", "1e-3", "--dataloader_num_workers", "1"]
LCM_CAUSES = [(r"given no DataLoader", "the config's \"auto\" micro batch size: the script prepares no DataLoader "
                "(its webdataset WebLoader stays outside accelerator.prepare), so nothing gives it; stock accelerate "
                "stops the same (accelerate/accelerator.py Accelerator._prepare_deepspeed); the error is accel-npu's")]
COG = ["--instance_data_root", "{work}/videos", "--caption_column", "prompts.txt", "--video_column", "videos.txt",
       "--max_num_frames", "9", "--train_batch_size", "1", "--rank", "4", "--lora_alpha", "8", "--learning_rate", "1e-2"]

SPECS = [
    Spec("text_to_image/train_text_to_image.py", "SD", "sd",
         ["--train_data_dir", "{work}/data", "--caption_column", "text"],
         "full:UNet2DConditionModel:unet", ["--resolution", "16", "--train_batch_size", "2", "--learning_rate", "1e-3",
                                            "--dataloader_num_workers", "0"]),
    Spec("dreambooth/train_dreambooth.py", "SD", "sd_family", DREAMBOOTH, "full:UNet2DConditionModel:unet", SD),
    Spec("dreambooth/train_dreambooth_lora.py", "SD", "sd_family", DREAMBOOTH, "lora:StableDiffusionPipeline:unet", SD),
    Spec("controlnet/train_controlnet.py", "SD", "sd_family", ["--train_data_dir", "{work}/controlnet_data"],
         "full:ControlNetModel:", SD),
    Spec("dreambooth/train_dreambooth_lora_sdxl.py", "SDXL", "sdxl", DREAMBOOTH,
         "lora:StableDiffusionXLPipeline:unet", LORA_T),
    Spec("dreambooth/train_dreambooth_lora_sd3.py", "SD3", "sd3", DREAMBOOTH,
         "lora:StableDiffusion3Pipeline:transformer", LORA_T + ["--max_sequence_length", "16"]),
    Spec("dreambooth/train_dreambooth_lora_flux.py", "Flux", "flux", DREAMBOOTH, "lora:FluxPipeline:transformer",
         LORA_T + ["--max_sequence_length", "16"]),
    Spec("dreambooth/train_dreambooth_lora_sana.py", "Sana", "sana", DREAMBOOTH, "lora:SanaPipeline:transformer",
         LORA_T + ["--max_sequence_length", "16"]),
    Spec("dreambooth/train_dreambooth_lora_qwen_image.py", "Qwen-Image", "qwen", DREAMBOOTH,
         "lora:QwenImagePipeline:transformer", LORA_T + ["--lora_alpha", "8", "--max_sequence_length", "16",
                                                         "--skip_final_inference"]),
    Spec("cogvideo/train_cogvideox_lora.py", "CogVideoX", "cog_t2v", COG, "lora:CogVideoXPipeline:transformer",
         ["--height", "16", "--width", "16"]),
    Spec("cogvideo/train_cogvideox_image_to_video_lora.py", "CogVideoX", "cog_i2v", COG,
         "lora:CogVideoXImageToVideoPipeline:transformer", ["--height", "32", "--width", "32"]),
    # -- SD / SDXL UNet scripts --
    # SD 1.x UNet
    Spec("text_to_image/train_text_to_image_lora.py", "SD", "sd",
         ["--train_data_dir", "{work}/data", "--caption_column", "text"], "lora:StableDiffusionPipeline:unet",
         ["--resolution", "16", "--train_batch_size", "2", "--learning_rate", "1e-3", "--dataloader_num_workers", "0",
          "--rank", "4"]),
    Spec("advanced_diffusion_training/train_dreambooth_lora_sd15_advanced.py", "SD", "sd_family", DREAMBOOTH,
         "lora:StableDiffusionPipeline:unet", SD + ["--rank", "4"],
         causes=[(r"^IndexError: list index out of range|no attribute 'ds_active_sub_modules'",
                  "the script's: its load_model_hook (lines 1406-1411) loads the checkpoint's LoRA again with "
                  "load_lora_into_unet, which injects a second adapter the optimizer does not hold (the call "
                  "diffusers #6514 removed from train_dreambooth_lora_sdxl.py); without those lines the resume "
                  "passes (zero2, zero3_t0)")]),
    # with upstream README's --modifier_token
    Spec("custom_diffusion/train_custom_diffusion.py", "SD", "sd_family",
         ["--instance_data_dir", "{work}/images", "--instance_prompt", "a photo of <new1> dog"],
         "attn_procs:StableDiffusionPipeline:unet:pytorch_custom_diffusion_weights.safetensors",
         SD + ["--modifier_token", "<new1>", "--initializer_token", "dog"],
         causes=[(r"multiple models when using DeepSpeed", "accelerate's: one model per Accelerator under DeepSpeed "
                  "(accelerate/accelerator.py Accelerator.prepare), and with --modifier_token the script prepares "
                  "custom_diffusion_layers and text_encoder together; without it, the script's final `for token in "
                  "args.modifier_token` (line 1333) fails on None")]),
    Spec("instruct_pix2pix/train_instruct_pix2pix.py", "SD", "sd15_data", ["--dataset_name", "{work}/pix2pix_data"],
         "full:UNet2DConditionModel:unet", SD,
         causes=[(r"must match the size of tensor b \(0\)", "ours (accel-npu): under zero3_init_flag the UNet is loaded "
                  "into ZeRO-3 partitions (plugins/loading/placement/zero3.py) and the script copies "
                  "unet.conv_in.weight, an empty partition, into its 8-channel conv_in before prepare (line 520); "
                  "stock loads it whole, as with ACCEL_NPU_ZERO3_INIT=0")]),
    Spec("consistency_distillation/train_lcm_distill_sd_wds.py", "SD", "sd15_lcm",
         ["--train_shards_path_or_url", "{work}/shards/shard-{{000000..000001}}.tar", "--max_train_samples", "8"],
         "full:UNet2DConditionModel:unet", LCM, model_flag="--pretrained_teacher_model", causes=LCM_CAUSES),
    Spec("consistency_distillation/train_lcm_distill_lora_sd_wds.py", "SD", "sd15_lcm",
         ["--train_shards_path_or_url", "{work}/shards/shard-{{000000..000001}}.tar", "--max_train_samples", "8"],
         "lora:StableDiffusionPipeline:unet:unet_lora", LCM + ["--lora_rank", "4"],
         model_flag="--pretrained_teacher_model", causes=LCM_CAUSES),
    # builds its UNet2DModel from a config and counts epochs (4 images, batch 1 on 2 ranks: 2 steps an epoch)
    Spec("unconditional_image_generation/train_unconditional.py", "unconditional", "sd15_data",
         ["--train_data_dir", "{work}/unconditional/images", "--model_config_name_or_path",
          "{work}/unconditional/unet"], "full:UNet2DModel:unet",
         ["--resolution", "16", "--train_batch_size", "1", "--learning_rate", "1e-3", "--dataloader_num_workers", "0",
          "--eval_batch_size", "1", "--ddpm_num_inference_steps", "2", "--save_images_epochs", "100",
          "--save_model_epochs", "100"], model_flag=None, seed_flag=None, epoch_steps=2,
         causes=[(r"no exit within", "the script's: at an epoch's end rank 0 alone samples with DDPMPipeline from the "
                  "ZeRO-3 model (lines 677-692, under `if accelerator.is_main_process`) while rank 1 goes on to the next "
                  "epoch: the parameter all-gathers never pair (py-spy: rank 0 in fetch_sub_module, rank 1 in the "
                  "DataLoader's RNG broadcast); a hang on GPUs too")]),
]


# kind -> code run in tests/scripts/ that writes the tiny pipeline to {w}/model and its data beside it
BUILDERS = {
    "sd": "import tiny_sd as t; t.build('{w}/model'); t.write_dataset('{w}/data')",
    "sd_family": "import tiny_sd_family as t; t.build('{w}/model'); t.write_instance_images('{w}/images'); "
                 "t.write_controlnet_dataset('{w}/controlnet_data')",
    "sdxl": "import tiny_sana_sdxl as t, tiny_models as m; t.sdxl_pipeline('{w}/model'); m.dreambooth_images('{w}/images')",
    "sana": "import tiny_sana_sdxl as t, tiny_models as m; t.sana_pipeline('{w}/model'); m.dreambooth_images('{w}/images')",
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
    # -- Flux, Flux2, SD3 DiT scripts --
    # -- other image DiTs, video, discrete --
    # -- Kandinsky, VQGAN, aMUSEd, unconditional --
}


def _build(kind: str, work: Path) -> None:
    """The tiny pipeline at ``work/model`` and its data beside it (once per work directory)."""
    marker = work / ".built"
    if marker.exists():
        return
    work.mkdir(parents=True, exist_ok=True)
    code = BUILDERS[kind].format(w=work)
    env = dict(base_env(), PYTHONPATH=str(REPO / "tests" / "scripts"))
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=600, env=env,
                   cwd=str(REPO / "tests" / "scripts"))
    marker.write_text("ok")


# -- measuring a launch -------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc/<pid>/stat."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sorted(tree)


def _rss_anon(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def launch(args: list[str], env: dict, cwd: Path, timeout: float) -> dict:
    """One ``accelerate launch``: exit code, output, seconds, peak node RSS (bytes)."""
    started = time.monotonic()
    proc = subprocess.Popen([str(BIN / "accelerate"), "launch", "--main_process_port", str(free_port()), *args],
                            env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], sum(_rss_anon(p) for p in _children(proc.pid)))
            done.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        # torch's elastic agent starts the ranks in sessions of their own: kill the whole tree
        for pid in reversed(_children(proc.pid)):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        out, _ = proc.communicate()
        code = "timeout"
    done.set()
    sampler.join()
    return {"code": code, "output": out.decode(errors="replace"), "seconds": time.monotonic() - started,
            "peak_rss": peak[0]}


_ERROR = re.compile(r"^(?:\[rank\d+\]: )?((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt)\b:?.*)$")
_FRAME = re.compile(r'^(?:\[rank\d+\]: )?\s*File "([^"]+)", line (\d+)')


def first_error(text: str, script: Path, causes=()) -> tuple[str, str]:
    """(the first error line, whose it is) from a failed launch's output."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _ERROR.match(line.strip())
        if not m or line.lstrip().startswith(("File ", "warnings.warn")) or "Warning" in m.group(1).split(":")[0]:
            continue
        frames = [f.group(1) for f in (_FRAME.match(x) for x in lines[max(0, i - 80):i]) if f]
        # torch raises for whatever called it wrongly: the innermost frame outside torch says whose call it was
        outside = [f for f in frames if "site-packages/torch/" not in f] or frames
        return m.group(1)[:300], _whose(outside[-1] if outside else "", m.group(1), script, causes)
    return (lines[-1][:300] if lines else "no output"), "unknown"


# failures whose cause is known beyond the frame that raised them: (message pattern, whose)
KNOWN_CAUSES = [
    (r"mat1 and mat2 must have the same dtype, but got Half and BFloat16",
     "the script's: fp16 frozen towers under a bf16 DeepSpeed config (accel-npu casts at the engine: "
     "deepspeed.runtime.engine:DeepSpeedEngine.forward)"),
    (r"CollectiveMisuseError", "the script's: save_state inside `if accelerator.is_main_process:` (diffusers "
                               "#2606); the error is accel-npu's"),
]


def _whose(path: str, message: str, script: Path, causes=()) -> str:
    for pattern, whose in [*causes, *KNOWN_CAUSES]:
        if re.search(pattern, message):
            return whose
    if "accel-npu" in message or "accel_npu" in path or f"{REPO}/plugins/" in path:
        return "ours (accel-npu)"
    if path and Path(path).resolve() == script.resolve():
        return "the script's"
    m = re.search(r"site-packages/([A-Za-z_]+)/", path)
    return f"{m.group(1)}'s" if m else (path or "unknown")


# -- the witness: the final artifact loaded as a user loads it, against the master weights -------------
def _master(ckpt: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


def _norm(key: str) -> str:
    key = key.removeprefix("base_model.model.")  # a model the script wrapped with peft's get_peft_model
    return re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", key)


def compare_artifact(spec: Spec, model: Path, out: Path, ckpt: Path) -> tuple[bool, str]:
    """(equal, what) for the final artifact in ``out`` against ``ckpt``'s fp32 master weights."""
    import diffusers
    import torch

    kind, cls_name, where, *inside = spec.artifact.split(":")
    master = _master(ckpt)
    if kind == "lora":
        pipe = getattr(diffusers, cls_name).from_pretrained(str(model), torch_dtype=torch.float32)
        pipe.load_lora_weights(str(out.joinpath(*inside)))
        got = {_norm(k): v for k, v in getattr(pipe, where).state_dict().items() if ".lora_" in k}
        master = {_norm(k): v for k, v in master.items() if ".lora_" in k}
    elif kind == "attn_procs":
        # the engine's module is diffusers' AttnProcsLayers: parameter "layers.<i>.<name>" is the i-th
        # entry of the model's attn_processors (diffusers/loaders/utils.py)
        pipe = getattr(diffusers, cls_name).from_pretrained(str(model), torch_dtype=torch.float32)
        component = getattr(pipe, where)
        component.load_attn_procs(str(out), weight_name=inside[0])
        names = list(component.attn_processors)
        got = {f"layers.{i}.{k}": v for i, name in enumerate(names)
               for k, v in component.attn_processors[name].state_dict().items()}
        master = {k: v for k, v in master.items() if k.startswith("layers.")}
    else:
        loaded = getattr(diffusers, cls_name).from_pretrained(str(out), subfolder=where or None)
        got = loaded.state_dict()
    missing = sorted(set(master) - set(got))
    if not master or missing:
        return False, f"{len(missing)} of {len(master)} master tensors not in the loaded artifact"
    worst = 0.0
    for k, v in master.items():
        g = got[k].float()
        if not (torch.equal(g, v) or torch.equal(g, v.to(torch.bfloat16).float())):
            worst = max(worst, (g - v).abs().max().item())
    if worst and all(torch.equal(got[k].float(), v.half().float()) for k, v in master.items()):
        return False, ("the loaded artifact equals the master weights rounded to float16, not bfloat16: the "
                       "engine's module ran in fp16 under a bf16 DeepSpeed config")
    if worst:
        return False, f"loaded artifact differs from the master weights: max |Δ| {worst:.3g}"
    return True, f"{len(master)} tensors = master"


# -- one row ----------------------------------------------------------------------------------------
def fsdp_supported(script: Path) -> bool:
    text = script.read_text()
    return "DistributedType.FSDP" in text or "fsdp_plugin" in text


def launch_args(spec: Spec, cfg: Path, work: Path, out: Path, every: int, until: int, resume: bool = False) -> list:
    """``accelerate launch`` arguments: the script trained to step ``until``, checkpointing every ``every``."""
    model = [spec.model_flag, str(work / "model")] if spec.model_flag else []
    seed = [spec.seed_flag, "0"] if spec.seed_flag else []
    steps = (["--num_epochs", str(until // spec.epoch_steps)] if spec.epoch_steps
             else ["--max_train_steps", str(until)])
    data = [a.format(work=work) for a in spec.data]
    return ["--config_file", str(cfg), str(UPSTREAM_EXAMPLES / spec.path), *model, *data, *spec.extra, *seed,
            "--output_dir", str(out), "--checkpointing_steps", str(every), *steps,
            *(["--resume_from_checkpoint", "latest"] if resume else [])]


def run_row(spec: Spec, config: str, root: Path, steps: int, every: int, resume_to: int, timeout: float) -> dict:
    script = UPSTREAM_EXAMPLES / spec.path
    work = root / spec.builder
    _build(spec.builder, work)
    cfgs = shipped_zero_configs(root)
    from tests.torchvision_site import with_torchvision

    env = with_torchvision(base_env(HF_DATASETS_CACHE=str(root / "datasets-cache")))
    if config == "stock_zero2":
        env.update(STOCK_ENV)
    cfg = cfgs["zero2" if config == "stock_zero2" else config]
    out = root / f"{spec.name}-{config}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    runs = [launch(launch_args(spec, cfg, work, out, every, steps), env, root, timeout)]
    if runs[0]["code"] == 0:
        runs.append(launch(launch_args(spec, cfg, work, out, every, resume_to, resume=True), env, root, timeout))
    row = {"seconds": sum(r["seconds"] for r in runs), "peak_rss": max(r["peak_rss"] for r in runs)}
    failed = next((r for r in runs if r["code"] != 0), None)
    if failed is not None:
        which = "first launch" if failed is runs[0] else "resumed launch"
        if failed["code"] == "timeout":
            what = f"{which}: no exit within {timeout:.0f} s (killed)"
            whose = next((w for pattern, w in spec.causes if re.search(pattern, what)), "unknown (a hang)")
            return {**row, "ok": False, "what": what, "whose": whose}
        error, whose = first_error(failed["output"], script, spec.causes)
        return {**row, "ok": False, "what": f"{which}: {error}", "whose": whose}
    last = out / f"checkpoint-{resume_to}"
    if f"checkpoint-{steps}" not in runs[1]["output"] or not last.is_dir():
        return {**row, "ok": False, "whose": "unknown",
                "what": f"did not resume from checkpoint-{steps} and write checkpoint-{resume_to}: "
                        f"{sorted(p.name for p in out.glob('checkpoint-*'))}"}
    try:
        ok, what = compare_artifact(spec, work / "model", out, last)
    except Exception as exc:  # noqa: BLE001 - the row records it
        ok, what = False, f"loading the final artifact: {type(exc).__name__}: {str(exc)[:200]}"
    return {**row, "ok": ok, "what": what, "whose": "" if ok else "unknown"}


# -- the results file ---------------------------------------------------------------------------------
HEADER = ["script", "family", "config", "result", "first error / check", "whose", "wall", "peak node RSS",
          "commit", "date"]


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def read_rows(path: Path | None = None) -> dict:
    path = path or RESULT_FILE
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("| `"):
                cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
                if len(cells) == len(HEADER):
                    rows[(cells[0], cells[2])] = cells
    return rows


def write_rows(new: dict, argv: list[str]) -> Path:
    import filelock

    with filelock.FileLock(str(RESULT_FILE) + ".lock", timeout=120):  # two runners may merge at once
        return _write_rows(new, argv)


def _write_rows(new: dict, argv: list[str]) -> Path:
    rows = read_rows()
    rows.update(new)
    planned = {f"`{s.name}`" for s in SPECS}  # a script given a Spec since: its "not run" row goes
    rows = {k: v for k, v in rows.items() if not (k[1] == "all" and k[0] in planned)}
    order = {s.name: i for i, s in enumerate(SPECS)}
    keys = sorted(rows, key=lambda k: (order.get(k[0].strip("`"), len(order)), k[0], CONFIGS.index(k[1])
                                       if k[1] in CONFIGS else len(CONFIGS)))
    lines = [
        "# Official diffusers v0.40.0 training scripts × launch configs (2 CPU ranks, tiny models)",
        "",
        f"Reproduce: `{command_line(argv)}` (rows of a partial run replace their own; each row keeps the "
        "commit and date it was run on).",
        "",
        f"- Commit: {git_commit()} (the run that last wrote this file; each row names the commit it ran on)",
        "",
        "Configs: `zero2` = launch_configs/cpu_zero2.yaml (bf16); `zero3_t0` = cpu_zero3.yaml with "
        "`stage3_param_persistence_threshold: 0`; `stock_zero2` = cpu_zero2 with accel-npu's plugins off but "
        "those forming the 2 CPU ranks (benchmarks/compatibility.py STOCK_ENV); `fsdp2` only for scripts "
        "that handle FSDP. ✔ = trains, checkpoints, resumes from `latest`, and the final artifact, loaded "
        "as a user loads it, equals DeepSpeed's fp32 master weights (zero_to_fp32) of the last checkpoint "
        "(or their bf16 rounding). Peak node RSS: the launch's process tree, RssAnon summed, sampled "
        "every 0.5 s. Wall: both launches on a shared 2-core machine.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" for _ in HEADER) + "|",
    ]
    lines += ["| " + " | ".join(rows[k]) + " |" for k in keys]
    RESULT_FILE.parent.mkdir(exist_ok=True)
    tmp = RESULT_FILE.with_suffix(".md.partial")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(RESULT_FILE)
    return RESULT_FILE


def not_run_rows(stamp: list[str]) -> dict:
    """A row for every vendored train_*.py without a tiny builder here, saying so."""
    have = {s.name for s in SPECS}
    rows = {}
    for path in sorted(UPSTREAM_EXAMPLES.rglob("train_*.py")):
        if path.name in have:
            continue
        family = path.parent.name
        if "flax" in path.name:
            why = "not run: a Flax (JAX) script, not torch"
        else:
            why = "not run: no tiny builder for its pipeline in tests/scripts/ yet"
        rows[(f"`{path.name}`", "all")] = [f"`{path.name}`", family, "all", "–", why, "", "", "", *stamp]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="", help="comma-separated families (SD, SDXL, SD3, Flux, Sana, "
                                                       "Qwen-Image, CogVideoX)")
    parser.add_argument("--only", default="", help="comma-separated substrings of script names")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated of {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpointing-steps", type=int, default=2)
    parser.add_argument("--resume-to", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--work", default="", help="work directory (default: a temporary one, removed)")
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    families = {f.strip().lower() for f in args.family.split(",") if f.strip()}
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)} (choose from {', '.join(CONFIGS)})")
    specs = [s for s in SPECS if (not families or s.family.lower() in families)
             and (not only or any(o in s.name for o in only))]
    plan = [(s, c) for s in specs for c in configs]
    if args.list:
        for s, c in plan:
            print(f"{s.path:55} {s.family:11} {c}")
        return 0
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="accel-npu-compat-"))
    root.mkdir(parents=True, exist_ok=True)
    new = {}
    try:
        for spec, config in plan:
            stamp = [_commit(), f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"]
            key = (f"`{spec.name}`", config)
            if config == "fsdp2":
                if fsdp_supported(UPSTREAM_EXAMPLES / spec.path):
                    new[key] = [key[0], spec.family, config, "–", "not run: no FSDP2 config in the runner yet",
                                "", "", "", *stamp]
                continue  # scripts that do not handle FSDP get no FSDP2 row
            print(f"{spec.name} × {config} ...", flush=True)
            row = run_row(spec, config, root, args.steps, args.checkpointing_steps, args.resume_to, args.timeout)
            new[key] = [key[0], spec.family, config, "✔" if row["ok"] else "✘", _cell(row["what"]),
                        _cell(row["whose"]), f"{row['seconds']:.0f} s", f"{row['peak_rss'] / 2 ** 30:.2f} GiB",
                        *stamp]
            print("  " + " | ".join(new[key][3:8]), flush=True)
            write_rows(new, sys.argv if argv is None else [sys.argv[0], *argv])
        stamp = [_commit(), f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"]
        new.update(not_run_rows(stamp))
        path = write_rows(new, sys.argv if argv is None else [sys.argv[0], *argv])
        print(f"wrote {path}")
    finally:
        if not args.work:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
