"""Ulysses sequence parallelism for unchanged diffusers scripts, switched on by accelerate's parallelism config
(plugins/sequence_parallel, docs/sequence-parallel.md).

In-process: the launcher accepts ``--use_parallelism_config`` beside a DeepSpeed config (stock refuses it) and
hands PARALLELISM_CONFIG_SP_SIZE to the workers; every refusal names its fix (a ZeRO checkpoint resumed by another
number of processes included); our CogVideoX processor is diffusers' own without a parallel config.

Launched (slow, one shared set of launches): diffusers v0.40.0's train_dreambooth_lora_flux.py, _qwen_image.py,
_sd3.py (``--use_parallelism_config --parallelism_config_sp_size 2`` on the command line) and
cogvideo/train_cogvideox_lora.py (``parallelism_config:`` in the YAML), unchanged, fp32 ZeRO-2: sp=2 on 2 ranks
against the same global batch on 1 rank; Flux at sp=2 x dp=2 on 4 ranks against dp=2 on 2; Flux checkpoints of
sp=2 and sp=1 compared tensor by tensor, and each resumed with the other sp size. Flux under ZeRO-3 (gradient
clipping on), sp=2 on 2 ranks against 1 rank: the same training, clip and checkpoint values. A transformer and an
action head trained on its gathered output (tests/scripts/sp_action_head.py), sp=2 against 1 rank: every parameter
moves as on one rank, and, the loss average over the SP group off, the head's does not. Witnesses that do not
depend on accel-npu (tests/sp_witness/sitecustomize.py wraps torch's SDPA, the functional all_to_all_single diffusers'
Ulysses attention calls, and Adam(W).step): the attention's heads and tokens on each rank, the all_to_all calls,
their sizes and groups, the squared gradient norm summed over the ranks' ZeRO partitions, the optimizer state
each step starts from; TensorBoard's event file for the loss at every step; the saved LoRA files and DeepSpeed's
checkpoint files. Stock fails: the launcher's refusal (ACCEL_NPU_DISABLE=1), and with the plugin off the YAML's
switch reaches prepare and fails on both ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from accel_npu.errors import ConfigError
from tests.launch_utils import (
    OFFICIAL_EXAMPLES,
    REPO,
    SCRIPTS,
    accelerate_launch,
    base_env,
    explain,
)

sys.path.insert(0, str(SCRIPTS))

WITNESS = REPO / "tests" / "sp_witness"


#: plugins/sequence_parallel's loss average over the SP group and the gather's summed backward (loss_average.py)
LOSS_AVERAGE_PATCHES = (
    "deepspeed.runtime.engine:DeepSpeedEngine.backward",
    "diffusers.hooks.context_parallel:AllGatherFunction.backward",
    "diffusers.hooks.context_parallel:AllGatherAnythingFunction.backward",
)

#: the ZeRO-3 launches' gradient clipping: below step 2's gradient norm of the Flux LoRA (0.23) and above the
#: others' (0.11-0.13), so the clip, computed over every rank's gradient partition, acts at step 2 only
ZERO3_CLIP = 0.2


def _launch_config(
    directory: Path, processes: int, distributed_type: str = "DEEPSPEED", sp: int | None = None, stage: int = 2
):
    """An accelerate YAML (fp32 ZeRO-2 DeepSpeed JSON beside it, or ZeRO-3 clipping at ZERO3_CLIP), with
    ``parallelism_config`` when ``sp``."""
    ds = directory / f"ds_fp32_zero{stage}.json"
    ds.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": stage},
                "bf16": {"enabled": False},
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                **({"gradient_clipping": ZERO3_CLIP} if stage == 3 else {}),
            }
        )
    )
    cfg = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type,
        "num_machines": 1,
        "num_processes": processes,
        "machine_rank": 0,
        "main_training_function": "main",
        "use_cpu": distributed_type == "MULTI_CPU",
    }
    if distributed_type == "DEEPSPEED":
        cfg["deepspeed_config"] = {"deepspeed_config_file": str(ds), "zero3_init_flag": False}
    if distributed_type == "FSDP":
        cfg["fsdp_config"] = {"fsdp_version": 2}
    if sp:
        cfg["parallelism_config"] = {"parallelism_config_sp_size": sp}
    path = directory / f"{distributed_type.lower()}_n{processes}{f'_sp{sp}' if sp else ''}_zero{stage}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ------------------------------------------------------------------------------------------------
# the launcher
# ------------------------------------------------------------------------------------------------
def _validated(config: Path, *flags: str):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(config), *flags, "train.py"])
    _validate_launch_command(args)
    return args


def test_use_parallelism_config_beside_a_deepspeed_config_reaches_the_workers_where_stock_refuses_it(tmp_path):
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    from tests.inprocess import stock

    config = _launch_config(tmp_path, 2)
    flags = ("--use_parallelism_config", "--parallelism_config_sp_size", "2")
    with stock(), pytest.raises(ValueError, match="without `--use_fsdp` and `--fsdp_version=2`"):
        _validated(config, *flags)
    args = _validated(config, *flags)
    assert args.use_deepspeed and args.use_parallelism_config
    args.deepspeed_fields_from_accelerate_config = ""
    _cmd, env = prepare_deepspeed_cmd_env(args)
    assert env["PARALLELISM_CONFIG_SP_SIZE"] == "2" and env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    # the YAML's own parallelism_config section, stock and here
    args = _validated(_launch_config(tmp_path, 2, sp=2))
    assert args.use_parallelism_config and args.parallelism_config_sp_size == 2


@pytest.mark.parametrize(
    ("distributed_type", "processes", "sp", "message"),
    [
        ("DEEPSPEED", 3, 2, "parallelism_config_sp_size 2 does not divide the 3 processes"),
        ("MULTI_CPU", 2, 2, "without `--use_fsdp` and `--fsdp_version=2`"),
    ],
)
def test_an_impossible_parallelism_config_is_refused_at_launch_naming_the_fix(
    tmp_path, distributed_type, processes, sp, message
):
    config = _launch_config(tmp_path, processes, distributed_type)
    with pytest.raises(SystemExit, match=message):
        _validated(config, "--use_parallelism_config", "--parallelism_config_sp_size", str(sp))


def test_the_launch_check_passes_a_dividing_sp_size_and_launches_without_parallelism_config(tmp_path):
    from accel_npu.plugins.sequence_parallel.launch import launch_problem

    assert launch_problem(_validated(_launch_config(tmp_path, 4, sp=2))) is None
    assert launch_problem(_validated(_launch_config(tmp_path, 3))) is None  # no parallelism_config at all
    assert launch_problem(_validated(_launch_config(tmp_path, 2, "FSDP", sp=2))) is None  # FSDP2: fsdp2.py


# ------------------------------------------------------------------------------------------------
# refusals at prepare (before step 1)
# ------------------------------------------------------------------------------------------------
def _tiny_flux(heads: int = 2):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=heads,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )


def test_a_model_without_a_plan_is_refused_naming_the_models_that_have_one():
    from diffusers import DiTTransformer2DModel

    from accel_npu.plugins.sequence_parallel.plans import plan_for

    dit = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1, sample_size=4, patch_size=2
    )
    with pytest.raises(ConfigError, match="cannot split DiTTransformer2DModel") as err:
        plan_for(dit)
    for planned in ("FluxTransformer2DModel", "CogVideoXTransformer3DModel", "SD3Transformer2DModel"):
        assert planned in str(err.value)
    plan, source = plan_for(_tiny_flux())
    assert source == "diffusers" and "proj_out" in plan


def test_heads_that_do_not_divide_by_sp_size_are_refused():
    from accel_npu.plugins.sequence_parallel.plans import check_heads

    model = _tiny_flux(heads=2)
    check_heads(model, 2)
    with pytest.raises(ConfigError, match="2 heads, which do not divide by 4"):
        check_heads(model, 4)


def _accelerator(stage: int = 2, dataloaders=()):
    return SimpleNamespace(
        deepspeed_plugin=SimpleNamespace(zero_stage=stage), _dataloaders=list(dataloaders), device=None
    )


@pytest.mark.parametrize(
    ("world", "stage", "dp", "dataloaders", "message"),
    [
        (3, 2, 1, (), "sp_size 2 does not divide the 3 processes"),
        (4, 2, 3, (), "data-parallel size 3 beside sp_size 2 on 4 processes; it must be 2"),
        (2, 2, 1, ("a DataLoader",), "Prepare the DataLoader in the same accelerator.prepare call as the model"),
    ],
)
def test_an_unsupported_setup_is_refused_at_prepare_before_any_group_is_built(
    monkeypatch, world, stage, dp, dataloaders, message
):
    import torch.distributed as dist

    from accel_npu.plugins.sequence_parallel import groups, prepare

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    built = []
    monkeypatch.setattr(groups, "build", lambda *a, **k: built.append(a))
    config = SimpleNamespace(sp_size=2, data_parallel_size=dp)
    with pytest.raises(ConfigError, match=message):
        prepare.enable(_accelerator(stage, dataloaders), _tiny_flux(), config)
    assert built == []


def test_zero3_is_not_refused_and_reaches_the_split(monkeypatch):
    import torch.distributed as dist

    from accel_npu.plugins.sequence_parallel import groups, prepare

    class Built(Exception):
        pass

    def build(*args, **kwargs):
        raise Built

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(groups, "build", build)
    accelerator = _accelerator(stage=3)
    accelerator.device = SimpleNamespace(type="cpu")
    with pytest.raises(Built):
        prepare.enable(accelerator, _tiny_flux(), SimpleNamespace(sp_size=2, data_parallel_size=1))


@pytest.mark.parametrize(("split", "sp", "factor"), [(True, 2, 2.0), (False, 2, 1.0), (True, 1, 1.0)])
def test_zero3s_reduce_scatter_is_multiplied_by_sp_for_a_split_diffusers_model_only(monkeypatch, split, sp, factor):
    """ZeRO-3's default reduce-scatter divides by every rank; the gradients of a split diffusers model's SP group
    must be summed: multiplied by sp. Not for accelerate's own Ulysses (no diffusers split: ALST's loss recipe
    sums over the SP group itself) nor without SP."""
    import torch

    from accel_npu.plugins.sequence_parallel import groups
    from accel_npu.plugins.sequence_parallel.zero3 import scatter_gradients_summed_within_sp_groups

    monkeypatch.setattr(groups, "ACTIVE", SimpleNamespace(sp_size=sp) if split else None)
    averaged = [torch.tensor([1.0, -2.0]), torch.tensor([0.5])]

    def reduce_scatter(params, communication_data_type):
        return [t.clone() for t in averaged]

    optimizer = SimpleNamespace(sequence_parallel_size=sp)
    result = scatter_gradients_summed_within_sp_groups(reduce_scatter, optimizer, (["p1", "p2"], torch.float32), {})
    for got, want in zip(result, averaged, strict=True):
        torch.testing.assert_close(got, want * factor)


@pytest.mark.parametrize("split", [True, False])
def test_the_loss_is_averaged_over_the_sp_group_only_while_a_model_is_split(monkeypatch, split):
    """DeepSpeed's engine.backward back-propagates loss / sp_size while a diffusers model is split, the loss itself
    otherwise, and returns what it did at the script's scale; the gather's backward sums over the group only inside
    such a backward (outside, diffusers' slice: no collective, which this process has no group for), or in every
    backward under FSDP2 (its reduction averages: the sum, the all-reduce stood in for here, then the slice)."""
    import torch
    import torch.distributed as dist

    from accel_npu.plugins.sequence_parallel import groups, loss_average

    state = SimpleNamespace(sp_size=2, sum_every_gathered_gradient=False)
    monkeypatch.setattr(groups, "ACTIVE", state if split else None)
    seen = []

    def backward(loss, **kwargs):
        seen.append((loss, loss_average._AVERAGED))
        return loss

    loss = torch.tensor(3.0)
    returned = loss_average.backward_with_the_loss_averaged(backward, None, (loss,), {})
    ((got, depth),) = seen
    assert (got.item(), depth, returned.item()) == ((1.5, 1, 3.0) if split else (3.0, 0, 3.0))
    assert loss_average._AVERAGED == 0 and loss.item() == 3.0

    def diffusers_backward(ctx, grad_output):
        return grad_output.chunk(ctx.world_size)[ctx.rank], None, None

    ctx = SimpleNamespace(world_size=2, rank=1, group=None)
    (piece, _, _) = loss_average.gathered_gradient_summed(diffusers_backward, None, (ctx, torch.arange(4.0)), {})
    assert piece.tolist() == [2.0, 3.0]

    # FSDP2: summed over the group in any backward (the other rank's gradient the same: twice the slice)
    state.sum_every_gathered_gradient = True
    reduced = []

    def all_reduce(tensor, op, group):
        reduced.append((op, group))
        tensor.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    ctx.group = "the SP group"
    grad_output = torch.arange(4.0)
    (piece, _, _) = loss_average.gathered_gradient_summed(diffusers_backward, None, (ctx, grad_output), {})
    assert piece.tolist() == ([4.0, 6.0] if split else [2.0, 3.0])
    assert reduced == ([(dist.ReduceOp.SUM, "the SP group")] if split else [])
    assert grad_output.tolist() == [0.0, 1.0, 2.0, 3.0]  # autograd's buffer left as it was


def test_sp_outside_deepspeed_and_fsdp2_is_refused_when_the_accelerator_is_built():
    from accelerate.utils import DistributedType

    from accel_npu.plugins.sequence_parallel.prepare import validate_accelerator

    def upstream(*args, **kwargs):
        return None

    ddp = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2, is_fsdp2=False)
    with pytest.raises(ConfigError, match="runs under DeepSpeed or FSDP2 for now; this launch is MULTI_CPU"):
        validate_accelerator(upstream, SimpleNamespace(sp_size=2), (ddp,), {})
    deepspeed = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=2, is_fsdp2=False)
    validate_accelerator(upstream, SimpleNamespace(sp_size=2), (deepspeed,), {})
    validate_accelerator(upstream, SimpleNamespace(sp_size=1), (ddp,), {})  # no SP: nothing to refuse

    # FSDP2: accelerate's own check refuses a config without dp_shard or cp (every sp one): not called there
    def refusing(*args, **kwargs):
        raise ValueError("FSDP is enabled but the parallelism config has no dimension for FSDP to shard across")

    fsdp2 = SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=2, is_fsdp2=True)
    validate_accelerator(refusing, SimpleNamespace(sp_size=2), (fsdp2,), {})
    with pytest.raises(ConfigError, match="sp_size 2 does not divide the 3 processes"):
        validate_accelerator(
            refusing, SimpleNamespace(sp_size=2), (SimpleNamespace(**{**vars(fsdp2), "num_processes": 3}),), {}
        )
    with pytest.raises(ValueError, match="no dimension for FSDP to shard across"):
        validate_accelerator(refusing, SimpleNamespace(sp_size=1), (fsdp2,), {})  # no SP: accelerate's own check


def test_our_cogvideox_processor_is_diffusers_own_without_a_parallel_config():
    """With no parallel config its attention is plain SDPA through diffusers' dispatch: the same output and
    gradients as CogVideoXAttnProcessor2_0 (RoPE on the video tokens included)."""
    import torch
    from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    from accel_npu.plugins.sequence_parallel.plans import cogvideox_processor_class

    torch.manual_seed(0)
    attn = Attention(query_dim=32, heads=2, dim_head=16, qk_norm="layer_norm", bias=True)
    video, text = torch.randn(1, 12, 32), torch.randn(1, 6, 32)
    rope = get_3d_rotary_pos_embed(16, ((0, 0), (2, 2)), (2, 2), 3, use_real=True)
    outs = []
    for processor in (CogVideoXAttnProcessor2_0(), cogvideox_processor_class()()):
        attn.set_processor(processor)
        attn.zero_grad()
        v, t = attn(video, encoder_hidden_states=text, image_rotary_emb=rope)
        (v.square().sum() + t.sum()).backward()
        outs.append((v, t, attn.to_q.weight.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("written", "stage", "processes", "universal", "refused"),
    [
        (2, 2, 1, False, True),  # sp=2 on 2 ranks resumed on 1 rank
        (1, 2, 4, False, True),
        (2, 2, 2, False, False),  # sp=2 on 2 ranks resumed with sp=1 on 2 ranks: the same partitions
        (2, 0, 1, False, False),  # ZeRO-0 partitions nothing
        (2, 2, 1, True, False),  # DeepSpeed's universal checkpoint re-partitions
    ],
)
def test_a_zero_checkpoint_resumed_by_another_number_of_processes_is_refused_naming_the_fix(
    tmp_path, written, stage, processes, universal, refused
):
    from accel_npu.plugins.checkpoints.state import MANIFEST, partition_count_problem

    (tmp_path / MANIFEST).write_text(json.dumps({"files": {}, "world_size": written, "zero_stage": stage}))
    config = {"checkpoint": {"load_universal": True}} if universal else {}
    accelerator = SimpleNamespace(num_processes=processes, deepspeed_config=config)
    problem = partition_count_problem(str(tmp_path), accelerator)
    if not refused:
        assert problem is None
        return
    assert f"written by {written} processes under DeepSpeed ZeRO stage {stage}" in problem
    assert f"Resume with {written} processes (--num_processes {written}); the sequence-parallel size may" in problem
    assert partition_count_problem(str(tmp_path / "no_manifest"), accelerator) is None


# ------------------------------------------------------------------------------------------------
# launched: the official scripts, unchanged, sp=2 on 2 ranks vs 1 rank
# ------------------------------------------------------------------------------------------------
FLUX = OFFICIAL_EXAMPLES / "dreambooth" / "train_dreambooth_lora_flux.py"
COGVIDEOX = OFFICIAL_EXAMPLES / "cogvideo" / "train_cogvideox_lora.py"
QWEN = OFFICIAL_EXAMPLES / "dreambooth" / "train_dreambooth_lora_qwen_image.py"
SD3 = OFFICIAL_EXAMPLES / "dreambooth" / "train_dreambooth_lora_sd3.py"
STEPS = 4


def _flux_args(pipe, images, out, checkpointing=100, steps=STEPS, resume=False):
    return [
        str(FLUX),
        *("--pretrained_model_name_or_path", str(pipe), "--instance_data_dir", str(images)),
        *("--instance_prompt", "a photo of sks dog", "--output_dir", str(out), "--resolution", "16"),
        *("--train_batch_size", "1", "--max_train_steps", str(steps), "--rank", "4", "--max_sequence_length", "16"),
        *("--seed", "0", "--learning_rate", "1e-2", "--dataloader_num_workers", "0", "--report_to", "tensorboard"),
        *("--checkpointing_steps", str(checkpointing)),
        *(("--resume_from_checkpoint", "latest") if resume else ()),
    ]


def _sd3_args(pipe, images, out):
    # 77 CLIP + 17 T5 text tokens (94) beside 16 x 16 latent tokens: both even
    return [
        str(SD3),
        *("--pretrained_model_name_or_path", str(pipe), "--instance_data_dir", str(images)),
        *("--instance_prompt", "a photo of sks dog", "--output_dir", str(out), "--resolution", "16"),
        *("--train_batch_size", "1", "--max_train_steps", str(STEPS), "--rank", "4", "--max_sequence_length", "17"),
        *("--seed", "0", "--learning_rate", "1e-2", "--dataloader_num_workers", "0", "--report_to", "tensorboard"),
        *("--checkpointing_steps", "100"),
    ]


def _qwen_args(pipe, images, out):
    return [
        str(QWEN),
        *("--pretrained_model_name_or_path", str(pipe), "--instance_data_dir", str(images)),
        *("--instance_prompt", "a photo of sks dog", "--output_dir", str(out), "--resolution", "16"),
        *("--train_batch_size", "1", "--max_train_steps", str(STEPS), "--checkpointing_steps", "100"),
        *("--rank", "4", "--lora_alpha", "8", "--max_sequence_length", "16", "--seed", "0"),
        *("--learning_rate", "1e-2", "--skip_final_inference", "--report_to", "tensorboard"),
    ]


def _cogvideox_args(pipe, videos, out):
    return [
        str(COGVIDEOX),
        *("--pretrained_model_name_or_path", str(pipe), "--instance_data_root", str(videos)),
        *("--caption_column", "prompts.txt", "--video_column", "videos.txt", "--height", "32", "--width", "32"),
        *("--max_num_frames", "9", "--output_dir", str(out), "--train_batch_size", "1"),
        *("--max_train_steps", str(STEPS), "--checkpointing_steps", "100", "--rank", "4", "--lora_alpha", "8"),
        *("--seed", "0", "--learning_rate", "1e-2", "--report_to", "tensorboard"),
    ]


def _losses(out: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for event_file in out.glob("logs/**/events.out.tfevents.*"):
        events = EventAccumulator(str(event_file))
        events.Reload()
        if "loss" in events.Tags()["scalars"]:
            return {s.step: s.value for s in events.Scalars("loss")}
    return {}


def _lora(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "pytorch_lora_weights.safetensors"))


def _witness(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank*.json"))]


#: resumed launch: (the launch whose checkpoint-2 it resumes from, its flags); sp=2 -> sp=1 and sp=1 -> sp=2
RESUMES = {"resume_sp2_as_sp1": "flux_sp2", "resume_sp1_as_sp2": "flux_dp2"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (CompletedProcess, output dir, witness records per rank)}: Flux, CogVideoX, Qwen-Image and SD3 at
    sp=2 and on one rank, Flux at sp=2 x dp=2 on 4 ranks and dp=2 on 2, Flux under ZeRO-3 at sp=2 and on one
    rank, two resumes of a Flux checkpoint with the other sp size, and the two stock launches."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    import tiny_cogvideox
    import tiny_models
    import tiny_sd3_flux

    from tests.torchvision_site import with_torchvision

    root = tmp_path_factory.mktemp("sequence_parallel")
    tiny_sd3_flux.flux_pipeline(str(root / "flux"))
    tiny_sd3_flux.sd3_pipeline(str(root / "sd3"))
    tiny_sd3_flux.dreambooth_images(str(root / "images"))
    tiny_cogvideox.pipeline("t2v_rope", str(root / "cogvideox"))
    tiny_cogvideox.videos(str(root / "videos"))
    tiny_models.qwen_image_pipeline(str(root / "qwen"))
    one, two, two_sp = _launch_config(root, 1), _launch_config(root, 2), _launch_config(root, 2, sp=2)
    four_sp = _launch_config(root, 4, sp=2)
    one_zero3, two_zero3 = _launch_config(root, 1, stage=3), _launch_config(root, 2, stage=3)
    cli_sp = ["--use_parallelism_config", "--parallelism_config_sp_size", "2"]
    flux, images = root / "flux", root / "images"
    plans = {
        # the resumes' sources first: they run while the rest still queue
        "flux_sp2": (two, cli_sp, _flux_args(flux, images, root / "flux_sp2", checkpointing=2), {}),
        "flux_dp2": (two, [], _flux_args(flux, images, root / "flux_dp2", checkpointing=2), {}),
        "flux_sp1": (one, [], _flux_args(flux, images, root / "flux_sp1", checkpointing=2), {}),
        "flux_sp2dp2": (four_sp, [], _flux_args(flux, images, root / "flux_sp2dp2", checkpointing=2), {}),
        "flux_z3_sp2": (two_zero3, cli_sp, _flux_args(flux, images, root / "flux_z3_sp2", checkpointing=2), {}),
        "flux_z3_sp1": (one_zero3, [], _flux_args(flux, images, root / "flux_z3_sp1", checkpointing=2), {}),
        "cog_sp2": (two_sp, [], _cogvideox_args(root / "cogvideox", root / "videos", root / "cog_sp2"), {}),
        "cog_sp1": (one, [], _cogvideox_args(root / "cogvideox", root / "videos", root / "cog_sp1"), {}),
        "qwen_sp2": (two, cli_sp, _qwen_args(root / "qwen", images, root / "qwen_sp2"), {}),
        "qwen_sp1": (one, [], _qwen_args(root / "qwen", images, root / "qwen_sp1"), {}),
        "sd3_sp2": (two, cli_sp, _sd3_args(root / "sd3", images, root / "sd3_sp2"), {}),
        "sd3_sp1": (one, [], _sd3_args(root / "sd3", images, root / "sd3_sp1"), {}),
        "stock_cli": (two, cli_sp, _flux_args(flux, images, root / "stock_cli"), {"disable": 1}),
        "plugin_off_yaml": (
            two_sp,
            [],
            _flux_args(flux, images, root / "plugin_off_yaml"),
            {"ACCEL_NPU_DISABLED_PLUGINS": "sequence_parallel"},
        ),
        # a transformer and an action head trained on its gathered output (tests/scripts/sp_action_head.py)
        "head_sp2": (two_sp, [], [str(SCRIPTS / "sp_action_head.py")], {}),
        "head_sp1": (one, [], [str(SCRIPTS / "sp_action_head.py")], {}),
        "head_sliced": (
            two_sp,
            [],
            [str(SCRIPTS / "sp_action_head.py")],
            {"ACCEL_NPU_DISABLED_PATCHES": ",".join(LOSS_AVERAGE_PATCHES)},
        ),
        # one step more from the other sp size's checkpoint-2 (copied into the output dir before the launch)
        "resume_sp2_as_sp1": (two, [], _flux_args(flux, images, root / "resume_sp2_as_sp1", 100, 3, True), {}),
        "resume_sp1_as_sp2": (two, cli_sp, _flux_args(flux, images, root / "resume_sp1_as_sp2", 100, 3, True), {}),
    }

    def launch(name):
        config, flags, script_args, extra = plans[name]
        out, witness = root / name, root / f"{name}_witness"
        out.mkdir(exist_ok=True)
        witness.mkdir()
        env = with_torchvision(base_env(SP_WITNESS_DIR=str(witness)))
        env["PYTHONPATH"] = f"{WITNESS}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(WITNESS)
        if extra.pop("disable", None):
            env["ACCEL_NPU_DISABLE"] = "1"
        env.update(extra)
        proc = accelerate_launch(["--config_file", str(config), *flags, *script_args], env=env, timeout=900, cwd=root)
        return proc, out, _witness(witness)

    # at most 6 launches at a time (up to 14 ranks): the 2 cores are shared, the memory too
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = {name: pool.submit(launch, name) for name in plans if name not in RESUMES}
        for resumed, source in RESUMES.items():
            futures[source].result()
            checkpoint = root / source / "checkpoint-2"
            if checkpoint.is_dir():
                shutil.copytree(checkpoint, root / resumed / "checkpoint-2")
            futures[resumed] = pool.submit(launch, resumed)
        return {name: futures[name].result() for name in plans}


def _attention(record: dict, head_dim: int = 16) -> set[tuple[int, int]]:
    """(heads, tokens) of the SDPA calls with the transformer's head_dim (text encoders and VAEs call it too)."""
    return {(shape[1], shape[2]) for shape in record["sdpa"] if shape[-1] == head_dim}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    ("family", "heads", "head_dim", "tokens", "attentions"),
    # Flux: 16 text + 8x8 latent tokens, 1 double + 1 single block (flux_z3: the same under ZeRO-3); CogVideoX: 16
    # text + 3 frames x 2x2 patches, 1 block; Qwen-Image: 32 text + image tokens, 2 blocks; SD3 (accel-npu's
    # plan): 77 CLIP + 17 T5 text + 16x16 latent tokens, 1 joint block
    [
        ("flux", 2, 16, 80, 2),
        ("flux_z3", 2, 16, 80, 2),
        ("cog", 2, 16, 28, 1),
        ("qwen", 2, 16, 32, 2),
        ("sd3", 4, 8, 350, 1),
    ],
)
def test_sp2_on_two_ranks_trains_as_one_rank_with_the_same_global_batch(
    runs, family, heads, head_dim, tokens, attentions
):
    sp2, sp1 = runs[f"{family}_sp2"], runs[f"{family}_sp1"]
    for proc, _, _ in (sp2, sp1):
        assert proc.returncode == 0, explain(proc)
    # the split: each rank's attention sees every token with half the heads; one rank sees all heads
    (w1,), (r0, r1) = sp1[2], sp2[2]
    assert (heads, tokens) in _attention(w1, head_dim) and (heads // 2, tokens) not in _attention(w1, head_dim)
    assert w1["all_to_all"] == []  # the negative: no exchange at sp=1
    for rank in (r0, r1):
        assert (heads // 2, tokens) in _attention(rank, head_dim) and (heads, tokens) not in _attention(rank, head_dim)
        # q, k, v and the output, forward and backward, per attention per step, over groups of 2; each sends
        # its rank's half of the tokens for all heads: batch 1 x tokens/2 x heads x head_dim
        assert len(rank["all_to_all"]) == 8 * attentions * STEPS
        assert {tuple(a) for a in rank["all_to_all"]} == {(2, tokens // 2 * heads * head_dim)}
    _assert_same_training(sp1, sp2)


def _assert_same_training(reference, split, loss_tolerance=1e-5):
    """The same loss at every step (TensorBoard's event file), the same squared gradient norm summed over the
    ranks' ZeRO partitions, the same LoRA after the last step (max |diff| <= 1e-4), trained, in fp32."""
    import torch

    loss1, loss2 = _losses(reference[1]), _losses(split[1])
    assert sorted(loss1) == sorted(loss2) == list(range(1, STEPS + 1))
    assert abs(loss1[1] - loss2[1]) <= loss_tolerance, (loss1, loss2)
    for step, (g_split, g) in enumerate(zip(_summed(split[2], "grad_sq"), _summed(reference[2], "grad_sq"))):
        assert abs(g_split - g) <= 1e-5 * g, (step, g_split, g)
    assert all(g > 0 for rank in split[2] for g in rank["grad_sq"])  # every rank holds a partition
    assert len(_summed(reference[2], "grad_sq")) == STEPS
    lora1, lora2 = _lora(reference[1]), _lora(split[1])
    assert lora1.keys() == lora2.keys() and len(lora1) > 0
    assert max((lora1[k] - lora2[k]).abs().max().item() for k in lora1) <= 1e-4
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in lora2.items())  # trained
    assert all(v.dtype == torch.float32 for v in lora2.values())


def _summed(records: list[dict], key: str) -> list[float]:
    """A per-step witness value summed over the ranks (their ZeRO partitions)."""
    return [sum(values) for values in zip(*(record[key] for record in records))]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sp2_dp2_on_four_ranks_trains_as_dp2_on_two_ranks(runs):
    four, two = runs["flux_sp2dp2"], runs["flux_dp2"]
    for proc, _, _ in (four, two):
        assert proc.returncode == 0, explain(proc)
    assert len(four[2]) == 4 and len(two[2]) == 2
    # two SP groups of two contiguous ranks, each exchanging within itself; dp=2 alone exchanges nothing
    assert [record["a2a_groups"] for record in four[2]] == [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]]
    for record in four[2]:
        assert (1, 80) in _attention(record) and (2, 80) not in _attention(record)
        assert {tuple(a) for a in record["all_to_all"]} == {(2, 40 * 2 * 16)}
    for record in two[2]:
        assert record["all_to_all"] == [] and (2, 80) in _attention(record)
    _assert_same_training(two, four)


def _zero_checkpoint(checkpoint: Path) -> dict:
    """A DeepSpeed ZeRO-1/2 checkpoint's optimizer state merged over its partitions (DeepSpeed pads the last
    one), its model states and its layout: {"files", "partitions", "fp32", "exp_avg", "exp_avg_sq", "step",
    "module", "lr_scheduler", "dp_world_size"}."""
    import torch

    tag = checkpoint / "pytorch_model"
    files = sorted(tag.glob("*optim_states.pt"), key=lambda f: int(f.name.split("_")[3]))
    parts = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
    states = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    merged = {"files": sorted(str(f.relative_to(checkpoint)) for f in checkpoint.rglob("*") if f.is_file())}
    merged["partitions"] = [
        {
            "fp32": [tuple(t.shape) for t in part["single_partition_of_fp32_groups"]],
            "state": {k: tuple(v.shape) for k, v in part["base_optimizer_state"]["state"][0].items()},
        }
        for part in parts
    ]
    groups = len(parts[0]["single_partition_of_fp32_groups"])
    merged["fp32"] = [torch.cat([p["single_partition_of_fp32_groups"][g] for p in parts]) for g in range(groups)]
    for key in ("exp_avg", "exp_avg_sq"):
        merged[key] = [
            torch.cat([p["base_optimizer_state"]["state"][g][key] for p in parts])[: merged["fp32"][g].numel()]
            for g in range(groups)
        ]
    merged["step"] = [float(p["base_optimizer_state"]["state"][0]["step"]) for p in parts]
    merged["module"] = {k: v for k, v in states["module"].items() if "lora" in k}
    merged["lr_scheduler"] = states["lr_scheduler"]
    merged["dp_world_size"] = states["dp_world_size"]
    return merged


def _max_diff(a: list, b: list) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_checkpoint_written_with_sp2_has_the_sp1_layout_and_values(runs):
    """checkpoint-2 of sp=2 on 2 ranks against sp=1 on 1 rank (the same global batch: the same values once
    the ZeRO partitions are merged) and against sp=1 on 2 ranks (dp=2: the same files, partitions and shapes);
    sp=2 x dp=2 on 4 ranks against dp=2 on 2 ranks (the same values)."""
    import torch

    for name in ("flux_sp2", "flux_sp1", "flux_dp2", "flux_sp2dp2"):
        assert runs[name][0].returncode == 0, explain(runs[name][0])
    sp2, sp1, dp2, sp2dp2 = (
        _zero_checkpoint(runs[n][1] / "checkpoint-2") for n in ("flux_sp2", "flux_sp1", "flux_dp2", "flux_sp2dp2")
    )
    # DeepSpeed records the partition count (its sequence-data-parallel world size, every rank), not dp
    assert (sp2["dp_world_size"], sp1["dp_world_size"], dp2["dp_world_size"], sp2dp2["dp_world_size"]) == (2, 1, 2, 4)
    assert sp2["files"] == dp2["files"] and sp2["partitions"] == dp2["partitions"]
    assert len(sp2["partitions"]) == 2 and len(sp1["partitions"]) == 1
    # the negative: the comparison tells another global batch's state (dp=2 read two samples a step) apart
    assert _max_diff(sp2["fp32"], dp2["fp32"]) > 1e-3 and _max_diff(sp2["exp_avg"], dp2["exp_avg"]) > 1e-5
    for split, reference in ((sp2, sp1), (sp2dp2, dp2)):
        assert split["step"] == [2.0] * len(split["step"]) and reference["step"][0] == 2.0
        assert split["lr_scheduler"] == reference["lr_scheduler"]
        assert split["module"].keys() == reference["module"].keys() and split["module"]
        assert _max_diff(list(split["module"].values()), list(reference["module"].values())) <= 1e-4
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert [t.shape for t in split[key]] == [t.shape for t in reference[key]]
            assert _max_diff(split[key], reference[key]) <= 1e-4, key
    # the LoRA the save hook writes beside it
    lora_split = _lora_file(runs["flux_sp2"][1] / "checkpoint-2")
    lora_one = _lora_file(runs["flux_sp1"][1] / "checkpoint-2")
    assert lora_split.keys() == lora_one.keys()
    assert max((lora_split[k] - lora_one[k]).abs().max().item() for k in lora_one) <= 1e-4
    assert all(v.dtype == torch.float32 for v in lora_split.values())


def _lora_file(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "pytorch_lora_weights.safetensors"))


def _zero3_checkpoint(checkpoint: Path, interleaved: bool = True) -> dict:
    """A DeepSpeed ZeRO-3 checkpoint's fp32 weights, exp_avg and exp_avg_sq, every parameter reassembled from the
    ranks' flat partitions: rank r holds elements [r*c, (r+1)*c) of each parameter (c = ceil(numel / ranks), the
    last padded), in the order of the model states' ``param_shapes``. ``interleaved=False`` concatenates the
    partitions instead (the negative). {"fp32", "exp_avg", "exp_avg_sq", "partitions", "step"}."""
    import math

    import torch

    tag = checkpoint / "pytorch_model"
    files = sorted(tag.glob("zero_pp_rank_*_optim_states.pt"), key=lambda f: int(f.name.split("_")[3]))
    parts = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
    states = torch.load(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert all(len(part["fp32_flat_groups"]) == 1 for part in parts)  # one sub-group: the LoRA's few parameters
    shapes = [shape for group in states["param_shapes"] for shape in group.values()]
    flats = {"fp32": [part["fp32_flat_groups"][0] for part in parts]}
    for key in ("exp_avg", "exp_avg_sq"):
        flats[key] = [part["optimizer_state_dict"]["state"][0][key] for part in parts]
    merged = {"partitions": [part["partition_count"] for part in parts]}
    merged["step"] = [float(part["optimizer_state_dict"]["state"][0]["step"]) for part in parts]
    for key, flat in flats.items():
        if not interleaved:
            merged[key] = torch.cat(flat)
            continue
        offset, tensors = 0, []
        for shape in shapes:
            numel = math.prod(shape)
            chunk = math.ceil(numel / len(flat))
            tensors.append(torch.cat([partition[offset : offset + chunk] for partition in flat])[:numel])
            offset += chunk
        assert offset == flat[0].numel()
        merged[key] = torch.cat(tensors)
    return merged


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_zero3_at_sp2_clips_by_the_norm_over_every_rank_and_checkpoints_the_sp1_values(runs):
    """ZeRO-3 beside its training check above: the clip (gradient_clipping ZERO3_CLIP) acts at the same step with
    the same norm as on one rank; the comparison fails on the halved gradient stock ZeRO-3 trains with (its default
    reduce-scatter averages over every rank without the sp factor; measured: a quarter of the squared norm);
    checkpoint-2, merged over the ranks' partitions, holds sp=1's fp32 weights and Adam state."""
    import torch

    sp2, sp1 = runs["flux_z3_sp2"], runs["flux_z3_sp1"]
    for proc, _, _ in (sp2, sp1):
        assert proc.returncode == 0, explain(proc)
    for run in (sp2, sp1):
        squared = _summed(run[2], "grad_sq")
        # clipped to the norm: DeepSpeed scales by clip / (norm + 1e-6) (stage3.py unscale_and_clip_grads), 9e-6
        # relative below clip^2 here
        assert abs(squared[1] - ZERO3_CLIP**2) <= 1e-4 * ZERO3_CLIP**2, squared
        assert all(g < ZERO3_CLIP**2 for i, g in enumerate(squared) if i != 1), squared  # not clipped
    # the negative: the checker fed sp=2's gradients halved (squared norms / 4) fails at step 1's norm
    halved = [{**record, "grad_sq": [g / 4 for g in record["grad_sq"]]} for record in sp2[2]]
    with pytest.raises(AssertionError, match=r"^\(0, "):
        _assert_same_training(sp1, (sp2[0], sp2[1], halved))

    split, reference = (_zero3_checkpoint(run[1] / "checkpoint-2") for run in (sp2, sp1))
    assert split["partitions"] == [2, 2] and reference["partitions"] == [1]
    assert split["step"] == [2.0, 2.0] and reference["step"] == [2.0]
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert split[key].shape == reference[key].shape
        assert (split[key] - reference[key]).abs().max().item() <= 1e-4, key
    # the negative: the partitions concatenated, not reassembled per parameter, do not match
    concatenated = _zero3_checkpoint(sp2[1] / "checkpoint-2", interleaved=False)
    assert (concatenated["fp32"] - reference["fp32"]).abs().max().item() > 1e-2
    lora_split, lora_one = (_lora_file(run[1] / "checkpoint-2") for run in (sp2, sp1))
    assert lora_split.keys() == lora_one.keys() and lora_split
    assert max((lora_split[k] - lora_one[k]).abs().max().item() for k in lora_one) <= 1e-4
    assert all(v.dtype == torch.float32 and v.numel() > 0 for v in lora_split.values())


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("resumed", sorted(RESUMES))
def test_a_checkpoint_resumes_with_the_other_sp_size(runs, resumed):
    """The resumed run's optimizer steps from the state the source run stepped from at step 3 (Adam's own
    state before its step, summed over the ranks' partitions): parameters, exp_avg, exp_avg_sq, step count."""
    source = RESUMES[resumed]
    proc, out, records = runs[resumed]
    assert proc.returncode == 0, explain(proc)
    assert "Resuming from checkpoint checkpoint-2" in proc.stdout + proc.stderr
    (before_step_3,) = [
        {key: sum(record["state"][0][key] for record in records) for key in ("param", "exp_avg", "exp_avg_sq")}
    ]
    original = {key: sum(record["state"][2][key] for record in runs[source][2]) for key in before_step_3}
    for key, value in original.items():
        assert value > 0 and abs(before_step_3[key] - value) <= 1e-9 * value, (key, before_step_3, original)
    assert {record["state"][0]["step"] for record in records} == {2.0}
    assert all(len(record["state"]) == 1 for record in records)  # one step: 3
    assert sorted(_losses(out)) == [3]
    # the other sp size indeed: exchanges at sp=2 only
    exchanged = [bool(record["all_to_all"]) for record in records]
    assert exchanged == ([True, True] if resumed == "resume_sp1_as_sp2" else [False, False])
    assert [bool(record["all_to_all"]) for record in runs[source][2]] == [not e for e in exchanged]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_module_trained_on_the_gathered_output_gets_the_gradient_of_one_rank(runs):
    """tests/scripts/sp_action_head.py: a Flux transformer and an action head reading its output, prepared together
    with one AdamW (its eps far above every gradient: each parameter's change is its gradient, scaled), one step
    at fp32 ZeRO-2 with accelerate's gradient clipping at 1.0; sp=2 on 2 ranks against 1 rank. Every parameter,
    the head's and the transformer's, changes as on one rank. The negative, diffusers' gather backward and the
    loss as the script computes it: the head gets twice its gradient on each rank (the clip, over the whole norm,
    then moves every parameter: here the head 1.27x, the transformer 0.64x)."""
    from tests.launch_utils import results

    for name in ("head_sp1", "head_sp2", "head_sliced"):
        assert runs[name][0].returncode == 0, explain(runs[name][0])
    one, sliced = head_step_as_on_one_rank(
        *(results(runs[name][0]) for name in ("head_sp1", "head_sp2", "head_sliced"))
    )
    # the negative: the head's change differs from one rank's by the clip of a doubled gradient
    for rank in sliced:
        assert rank["head"] > 1.1 * one["head"] and rank["transformer"] < 0.9 * one["transformer"], (rank, one)


def head_step_as_on_one_rank(one_rank: list[dict], split: list[dict], sliced: list[dict]) -> tuple[dict, list[dict]]:
    """tests/scripts/sp_action_head.py's records (1 rank; sp=2; sp=2 with the gather as upstream has it): the head's
    and the transformer's parameters both moved, each sp=2 rank with the 1-rank loss and every parameter's change
    within 1e-5 of one rank's, the negative's ranks with the same loss. Gives (the 1-rank record, the negative's)
    for the negative's own check."""
    (one,) = one_rank
    assert [r["rank"] for r in split] == [r["rank"] for r in sliced] == [0, 1]
    reference = one["changes"]
    moved = [k for k, v in reference.items() if v > 0]  # some norms' weights get no gradient in one step
    assert {k.split(".")[0] for k in moved} == {"head", "transformer"} and len(moved) > 0.8 * len(reference)
    for rank in split:
        assert rank["loss"] == one["loss"]
        assert rank["changes"].keys() == reference.keys()
        for key, value in reference.items():
            assert abs(rank["changes"][key] - value) <= 1e-5 * value, (key, rank["changes"][key], value)
    for rank in sliced:
        assert rank["loss"] == one["loss"]
    return one, sliced


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_stock_refuses_the_switch_and_without_the_plugin_prepare_fails_on_every_rank(runs):
    stock_cli = runs["stock_cli"][0]
    assert stock_cli.returncode != 0
    assert "You cannot use `--use_parallelism_config` without `--use_fsdp`" in stock_cli.stderr + stock_cli.stdout
    off = runs["plugin_off_yaml"][0]
    text = off.stdout + off.stderr
    assert off.returncode != 0
    for rank in (0, 1):
        assert f"[rank{rank}]: AttributeError: 'FrozenDict' object has no attribute 'get_text_config'" in text, text
