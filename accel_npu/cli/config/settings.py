"""What `accel-npu config` writes: settings -> an accelerate YAML, a DeepSpeed JSON and a sidecar.

The three files live side by side (``<stem>.yaml``, ``<stem>.deepspeed.json``,
``<stem>.accel-npu.yaml``):

- the accelerate YAML is a plain accelerate config (``accelerate launch`` reads it as is);
- the DeepSpeed JSON exists only for ZeRO; precision is declared in exactly one of the two files
  (``mixed_precision`` beside ``deepspeed_config_file`` makes accelerate refuse to start:
  ``DeepSpeedPlugin._deepspeed_config_checks`` in accelerate/utils/dataclasses.py);
- the sidecar holds what accelerate has no key for: the environment of the training processes
  (Ascend tuning, accel-npu's loading switches). accel-npu applies it at ``accelerate launch``
  (plugins/launch/settings.py); variables already set in the shell win.

This module is the single source of the tuned DeepSpeed values: launch_configs/ is generated from it
(tests/test_config_launch_configs.py checks that the shipped files are up to date). The workers'
runtime tuning (which variables, their values and checks) comes from the backend's plugin through the
``accel_npu_worker_tuning`` and ``accel_npu_launch_env`` hooks, so the CLI imports no plugin.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from accel_npu import environment
from accel_npu.config_files import DEEPSPEED_SUFFIX, SIDECAR_SUFFIX, WorkerTuning
from accel_npu.errors import ConfigError

BACKENDS = ("npu", "cuda", "cpu")
STRATEGIES = ("ddp", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "all")
PRECISIONS = ("bf16", "fp16", "no")
#: the wizard's strategies Ulysses sequence parallelism of a diffusers model runs under (plugins/sequence_parallel:
#: DeepSpeed ZeRO-0 to 3; DDP is refused there; FSDP2 runs it too, a strategy the wizard does not write)
SEQUENCE_PARALLEL_STRATEGIES = ("zero2", "zero3")

#: accel-npu's own switches the wizard offers (see accel_npu/environment.py).
ACCEL_NPU_SETTINGS = (
    ("ACCEL_NPU_FROZEN_MODULES", "child modules kept out of DeepSpeed (unset: frozen children auto-detected)"),
    ("ACCEL_NPU_LOAD_SLOTS", "ranks of one machine that may materialize weights at once (unset: from free memory)"),
    ("ACCEL_NPU_TRUNCATE", "Class:layers pairs: from_pretrained of that class builds and reads only N blocks"),
    ("ACCEL_NPU_ASYNC_CHECKPOINT", "0: save_state writes its files before it returns (default: in the background)"),
)

#: comments of the sidecar's variables that are not a backend's tuning
_ENV_COMMENTS = dict(ACCEL_NPU_SETTINGS)
_ENV_COMMENTS["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = "overrides Accelerator(gradient_accumulation_steps=...)"


def worker_tuning(backend: str) -> WorkerTuning | None:
    """What the wizard offers to tune in ``backend``'s workers (its plugin's ``accel_npu_worker_tuning``
    hook); None for a backend without tuning."""
    from accel_npu.manager import get_plugin_manager

    return get_plugin_manager().hook.accel_npu_worker_tuning(backend_name=backend)


def env_comments(backend: str) -> dict[str, str]:
    """{variable: what it does} for the sidecar written for ``backend``."""
    tuning = worker_tuning(backend)
    if tuning is None:
        return dict(_ENV_COMMENTS)
    comments = dict(tuning.variables + ACCEL_NPU_SETTINGS)
    if tuning.interface:
        comments[tuning.interface[0]] = tuning.interface[1]
    comments.update(_ENV_COMMENTS)
    return comments


def tuning_defaults(backend: str, num_machines: int = 1, num_processes: int = 1) -> dict[str, str]:
    """The worker defaults ``backend`` gives (its ``accel_npu_launch_env`` hook) for the variables the
    wizard offers, for a job of ``num_processes`` over ``num_machines``; {} for a backend without
    tuning. Asked through hooks, so the CLI imports no plugin."""
    from accel_npu._torch.nodes import Nodes
    from accel_npu.manager import get_plugin_manager

    tuning = worker_tuning(backend)
    if tuning is None:
        return {}
    nodes = Nodes(count=num_machines, world_size=num_processes)
    defaults: dict[str, str] = {}
    hook = get_plugin_manager().hook.accel_npu_launch_env
    for result in hook(backend=tuning.backend, env={}, nodes=nodes, launching=False):
        for key, value in (result or {}).items():
            defaults.setdefault(key, str(value))
    return {name: defaults[name] for name, _ in tuning.variables if name in defaults}


# -- tuned DeepSpeed bases -------------------------------------------------------------------------
# 500M-element buckets suit 910B's HCCS links; ZeRO-3 keeps tensors
# under 1M elements (norms, biases) unpartitioned and gathers a bf16 copy for saving.
_ACCEL_BUCKET = 500_000_000
#: CPU debugging: same structure, buckets small enough for a laptop (ZeRO-2 allocates a bucket).
_CPU_BUCKET = 50_000_000


def tuned_zero(stage: int, backend: str) -> dict[str, Any]:
    bucket = _CPU_BUCKET if backend == "cpu" else _ACCEL_BUCKET
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": bucket,
                "stage3_param_persistence_threshold": 1_000_000,
                "stage3_max_live_parameters": 1_000_000_000,
                "stage3_max_reuse_distance": 1_000_000_000,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    return zero


_FP16 = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


@dataclass
class Settings:
    """Every answer of the wizard (each has a command-line flag)."""

    backend: str = "cpu"
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int = 29500
    processes_per_machine: int = 2
    strategy: str = "zero2"
    offload: str = "none"
    zero3_init: bool = True
    mixed_precision: str = "bf16"
    micro_batch_size: str = "auto"
    gradient_accumulation_steps: str = "auto"
    npu_env: dict[str, str] = field(default_factory=dict)
    #: HCCL_SOCKET_IFNAME for an npu job across machines ("": HCCL picks an interface itself)
    hccl_socket_ifname: str = ""
    frozen_modules: str = ""
    load_slots: str = ""
    truncate: str = ""
    #: save_state under ZeRO writes its files in the background (accel-npu's default); False: the sidecar says
    #: ACCEL_NPU_ASYNC_CHECKPOINT=0
    async_checkpoint: bool = True
    #: accelerate's ``parallelism_config_sp_size``: ranks splitting one sample's tokens (Ulysses); 1 = off
    sp_size: int = 1
    #: Keys of a template's DeepSpeed JSON that the wizard does not ask about (kept as they are).
    ds_base: dict[str, Any] | None = None

    @property
    def num_processes(self) -> int:
        """accelerate's ``num_processes``: the total over all machines."""
        return self.processes_per_machine * self.num_machines

    @property
    def uses_deepspeed(self) -> bool:
        return self.strategy in ("zero2", "zero3")

    @property
    def zero_stage(self) -> int:
        return {"zero2": 2, "zero3": 3}.get(self.strategy, 0)


# -- what this machine has --------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    backend: str
    device_count: int
    bf16_supported: bool = True
    visible_devices_note: str = ""


def detect_machine() -> Machine:
    """The backend accel-npu selects here, and its visible devices."""
    from accel_npu.backend import current_backend

    backend = current_backend()
    bf16 = True
    if backend.name == "cuda":
        try:
            import torch

            bf16 = bool(torch.cuda.is_bf16_supported())
        except Exception:  # noqa: BLE001 - detection only
            bf16 = True
    note = ""
    if backend.name == "npu":
        note = f"ASCEND_RT_VISIBLE_DEVICES={os.environ.get('ASCEND_RT_VISIBLE_DEVICES', '<unset>')}"
    elif backend.name == "cuda":
        note = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
    return Machine(
        backend=backend.name, device_count=backend.device_count, bf16_supported=bf16, visible_devices_note=note
    )


def device_word(backend: str) -> str:
    return {"npu": "NPU", "cuda": "GPU", "cpu": "CPU"}[backend]


def device_limit(backend: str, machine: Machine) -> int | None:
    """How many processes one machine may start for ``backend`` here (None: no limit known)."""
    if backend == "cpu" or backend != machine.backend or machine.device_count <= 0:
        return None
    return machine.device_count


def default_processes(backend: str, machine: Machine) -> int:
    limit = device_limit(backend, machine)
    if limit:
        return limit
    return 2 if backend == "cpu" else 8


def precision_choices(backend: str, machine: Machine) -> tuple[str, ...]:
    if backend == "cpu":
        return ("bf16", "no")
    if backend == "cuda" and backend == machine.backend and not machine.bf16_supported:
        return ("fp16", "no")
    return PRECISIONS


def default_settings(machine: Machine, backend: str | None = None) -> Settings:
    backend = backend or machine.backend
    s = Settings(backend=backend, processes_per_machine=default_processes(backend, machine))
    s.mixed_precision = precision_choices(backend, machine)[0]
    s.npu_env = tuning_defaults(backend)
    return s


# -- validation --------------------------------------------------------------------------------------
_TRUNCATE_RE = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_.]*\s*:\s*[1-9][0-9]*\s*$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def check_auto_int(value: str, what: str) -> str | None:
    if str(value).strip().lower() == "auto":
        return None
    try:
        if int(str(value)) >= 1:
            return None
    except ValueError:
        pass
    return f"{what} must be 'auto' or a whole number >= 1 (got {value!r})"


def check_truncate(value: str) -> str | None:
    if not value:
        return None
    bad = [p for p in value.split(",") if not _TRUNCATE_RE.match(p)]
    if bad:
        return (
            f"truncation {value!r} is not a comma-separated list of Class:layers pairs "
            f"(e.g. QwenImageTransformer2DModel:2); bad part: {bad[0]!r}"
        )
    return None


def check_frozen(value: str) -> str | None:
    if not value:
        return None
    bad = [p.strip() for p in value.split(",") if not _NAME_RE.match(p.strip())]
    if bad:
        return f"frozen modules {value!r}: {bad[0]!r} is not a child-module name (e.g. vae,text_encoder)"
    return None


def problems(s: Settings, machine: Machine) -> list[str]:
    """Everything wrong with ``s`` on ``machine`` (empty when it can be written)."""
    out: list[str] = []
    if s.backend not in BACKENDS:
        out.append(f"backend {s.backend!r} is not one of {', '.join(BACKENDS)}")
        return out
    if s.strategy not in STRATEGIES:
        out.append(f"strategy {s.strategy!r} is not one of {', '.join(STRATEGIES)}")
    if s.offload not in OFFLOADS:
        out.append(f"offload {s.offload!r} is not one of {', '.join(OFFLOADS)}")
    if s.mixed_precision not in PRECISIONS:
        out.append(f"mixed precision {s.mixed_precision!r} is not one of {', '.join(PRECISIONS)}")
    elif s.mixed_precision not in precision_choices(s.backend, machine):
        why = (
            "the cpu backend has no fp16 training (torch's and DeepSpeed's CPU paths); use --mixed-precision bf16 or no"
            if s.backend == "cpu"
            else "this GPU has no bf16 support; use --mixed-precision fp16 or no"
        )
        out.append(f"--mixed-precision {s.mixed_precision} on {s.backend}: {why}")
    if s.num_machines < 1:
        out.append(f"--num-machines must be >= 1 (got {s.num_machines})")
    if s.processes_per_machine < 1:
        out.append(f"--num-processes must be >= 1 (got {s.processes_per_machine})")
    limit = device_limit(s.backend, machine)
    if limit is not None and s.processes_per_machine > limit:
        out.append(
            f"--num-processes {s.processes_per_machine} but only {limit} {device_word(s.backend)}(s) are visible "
            f"on this machine ({machine.visible_devices_note}): use one process per device, "
            f"--num-processes {limit} or fewer (extra ranks would share a device; HCCL fails later "
            f"with 'rank N assigned to same device')"
        )
    if s.uses_deepspeed and s.num_processes < 2:
        out.append(
            f"--strategy {s.strategy} needs at least 2 processes in total (got {s.num_processes}): "
            f"ZeRO shards across processes; use --strategy ddp for a single process"
        )
    if s.offload != "none":
        if not s.uses_deepspeed:
            out.append(f"--offload {s.offload} needs --strategy zero2 or zero3 (DDP has nothing to offload)")
        elif s.backend == "cpu":
            out.append(
                f"--offload {s.offload} on the cpu backend: everything is in host memory already; use --offload none"
            )
        elif s.offload == "all" and s.strategy != "zero3":
            out.append(
                "--offload all (optimizer and parameters) needs --strategy zero3; "
                "ZeRO-2 can offload the optimizer only (--offload optimizer)"
            )
    if s.num_machines > 1:
        if not s.main_process_ip:
            out.append("--main-process-ip is required with more than one machine (the address of machine rank 0)")
        if not 0 <= s.machine_rank < s.num_machines:
            out.append(f"--machine-rank {s.machine_rank} must be between 0 and {s.num_machines - 1}")
        if not 1 <= s.main_process_port <= 65535:
            out.append(f"--main-process-port {s.main_process_port} is not a TCP port")
    for value, what in (
        (s.micro_batch_size, "--micro-batch-size"),
        (s.gradient_accumulation_steps, "--gradient-accumulation-steps"),
    ):
        msg = check_auto_int(value, what)
        if msg:
            out.append(msg)
    if s.load_slots and check_auto_int(s.load_slots, "--load-slots"):
        out.append(check_auto_int(s.load_slots, "--load-slots"))
    for msg in (check_truncate(s.truncate), check_frozen(s.frozen_modules)):
        if msg:
            out.append(msg)
    tuning = worker_tuning(s.backend)
    if tuning is not None:
        out.extend(m for m in (tuning.problem(k, v) for k, v in s.npu_env.items()) if m)
        if s.num_machines > 1 and tuning.interface_problem(s.hccl_socket_ifname):
            out.append(tuning.interface_problem(s.hccl_socket_ifname))
    if s.frozen_modules and not s.uses_deepspeed:
        out.append("--frozen-modules only applies to ZeRO (DeepSpeed); drop it or use --strategy zero2/zero3")
    out.extend(m for m in [sp_size_problem(s.sp_size, s.num_processes, s.strategy)] if m)
    return out


def sp_size_problem(sp_size: int, num_processes: int, strategy: str) -> str | None:
    """What is wrong with a sequence-parallel size for this job (None: nothing)."""
    if sp_size < 1:
        return f"--sp-size must be >= 1 (got {sp_size})"
    if sp_size == 1:
        return None
    if strategy not in SEQUENCE_PARALLEL_STRATEGIES:
        return (
            f"--sp-size {sp_size}: sequence parallelism runs under --strategy "
            f"{' or '.join(SEQUENCE_PARALLEL_STRATEGIES)} for now (got {strategy}); choose it or --sp-size 1"
        )
    if num_processes % sp_size:
        return (
            f"--sp-size {sp_size} does not divide the {num_processes} processes in total: every sequence-parallel "
            f"group needs {sp_size} ranks; choose a size that divides {num_processes}"
        )
    return None


def validate(s: Settings, machine: Machine) -> None:
    found = problems(s, machine)
    if len(found) == 1:
        raise ConfigError(f"{found[0]}. Nothing was written.")
    if found:
        raise ConfigError("this configuration cannot work:\n  - " + "\n  - ".join(found) + "\nNothing was written.")


# -- rendering ---------------------------------------------------------------------------------------
def deepspeed_path_for(config_file: Path) -> Path:
    return config_file.with_name(config_file.stem + DEEPSPEED_SUFFIX)


def sidecar_path_for(config_file: Path) -> Path:
    return config_file.with_name(config_file.stem + SIDECAR_SUFFIX)


def _auto_or_int(value: str):
    return "auto" if str(value).strip().lower() == "auto" else int(value)


def deepspeed_dict(s: Settings) -> dict[str, Any]:
    ds = copy.deepcopy(s.ds_base) if s.ds_base else {}
    zero = dict(ds.get("zero_optimization") or {})
    if not zero or zero.get("stage") != s.zero_stage:
        # a different stage than the template: take the tuned base, keep nothing stage-specific
        zero = tuned_zero(s.zero_stage, s.backend)
    zero["stage"] = s.zero_stage
    zero.pop("offload_optimizer", None)
    zero.pop("offload_param", None)
    ds.pop("zero_force_ds_cpu_optimizer", None)
    if s.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if s.offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    ordered: dict[str, Any] = {"zero_optimization": zero}
    ds.pop("zero_optimization", None)
    ds.pop("bf16", None)
    ds.pop("fp16", None)
    if s.mixed_precision == "fp16":
        ordered["fp16"] = dict(_FP16)
    else:
        ordered["bf16"] = {"enabled": s.mixed_precision == "bf16"}
    ordered["train_batch_size"] = "auto"
    ordered["train_micro_batch_size_per_gpu"] = _auto_or_int(s.micro_batch_size)
    ordered["gradient_accumulation_steps"] = _auto_or_int(s.gradient_accumulation_steps)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        ds.pop(key, None)
    if s.offload != "none":
        # Unchanged scripts build torch.optim.AdamW; DeepSpeed refuses it with offload unless told.
        ordered["zero_force_ds_cpu_optimizer"] = False
    ordered.update(ds)  # anything else the template had (gradient_clipping, ...)
    return ordered


def distributed_type(s: Settings) -> str:
    if s.uses_deepspeed:
        return "DEEPSPEED"
    if s.num_processes == 1:
        return "NO"
    return {"npu": "MULTI_NPU", "cuda": "MULTI_GPU", "cpu": "MULTI_CPU"}[s.backend]


def accelerate_dict(s: Settings, deepspeed_file: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "distributed_type": distributed_type(s)}
    if s.uses_deepspeed:
        ds: dict[str, Any] = {"deepspeed_config_file": deepspeed_file}
        ds["zero3_init_flag"] = bool(s.zero3_init) if s.strategy == "zero3" else False
        if s.num_machines > 1:
            ds["deepspeed_multinode_launcher"] = "standard"
        cfg["deepspeed_config"] = ds
    else:
        cfg["mixed_precision"] = s.mixed_precision
    cfg["num_machines"] = s.num_machines
    cfg["num_processes"] = s.num_processes
    cfg["machine_rank"] = s.machine_rank
    if s.num_machines > 1:
        cfg["main_process_ip"] = s.main_process_ip
        cfg["main_process_port"] = s.main_process_port
        cfg["rdzv_backend"] = "static"
        cfg["same_network"] = True
    if s.sp_size > 1:
        # accelerate's own section (commands/config/config_args.py ``parallelism_config``; launch.py copies each
        # key to its --parallelism_config_* argument and sets --use_parallelism_config)
        cfg["parallelism_config"] = {
            "parallelism_config_sp_size": s.sp_size,
            "parallelism_config_sp_backend": "deepspeed",
        }
    if not s.uses_deepspeed and s.backend != "cpu":
        cfg["gpu_ids"] = "all"
    cfg["main_training_function"] = "main"
    # DeepSpeed on CPU: use_cpu would send the launch to accelerate's single-process path;
    # accel-npu's cpu backend starts the gloo ranks instead.
    cfg["use_cpu"] = s.backend == "cpu" and not s.uses_deepspeed
    cfg["debug"] = False
    return cfg


_YAML_COMMENTS = {
    "compute_environment": "a machine you start processes on yourself",
    "distributed_type": None,  # filled per strategy
    "deepspeed_config_file": "ZeRO stage, precision, batch sizes: all in this JSON",
    "zero3_init_flag": "ZeRO-3: build models under deepspeed.zero.Init (each rank holds its shard)",
    "deepspeed_multinode_launcher": "torchrun on every machine (run `accelerate launch` on each)",
    "mixed_precision": "declared here only (no DeepSpeed JSON for DDP)",
    "num_machines": "machines (nodes) training together",
    "num_processes": "processes in TOTAL (all machines): one per device",
    "machine_rank": "0 on the main machine; pass --machine_rank N on the others",
    "main_process_ip": "EDIT: address of machine rank 0, reachable from every machine",
    "main_process_port": "a free TCP port on machine rank 0",
    "rdzv_backend": "static rendezvous: every machine knows its rank",
    "same_network": "machines share one network",
    "gpu_ids": "all visible devices",
    "parallelism_config_sp_size": "sequence parallelism: ranks splitting one sample's tokens (Ulysses)",
    "parallelism_config_sp_backend": "DeepSpeed's sequence-parallel groups (accel-npu splits diffusers models)",
    "main_training_function": "only used by notebook_launcher",
    "use_cpu": "true: train on CPU even where an accelerator exists",
    "debug": "true: extra collective checks (slow)",
}

_DIST_COMMENTS = {
    "DEEPSPEED": "DeepSpeed ZeRO",
    "NO": "one process, no data parallelism",
    "MULTI_NPU": "DDP over HCCL: every process holds the whole model",
    "MULTI_GPU": "DDP over NCCL: every process holds the whole model",
    "MULTI_CPU": "DDP over gloo: every process holds the whole model",
}


def _scalar(value) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    if text.endswith("..."):
        text = text[:-3].strip()
    return text


def _comment_lines(text: str) -> list[str]:
    return [f"# {line}".rstrip() for line in text.splitlines()]


def title_of(s: Settings) -> str:
    what = {
        "ddp": "DDP" if s.num_processes > 1 else "single process",
        "zero2": "DeepSpeed ZeRO-2",
        "zero3": "DeepSpeed ZeRO-3",
    }[s.strategy]
    where = (
        f"{s.num_machines} machines x {s.processes_per_machine}" if s.num_machines > 1 else f"{s.processes_per_machine}"
    )
    off = {"none": "", "optimizer": ", optimizer offloaded to CPU", "all": ", optimizer+parameters offloaded to CPU"}
    sp = f", sequence parallel over {s.sp_size}" if s.sp_size > 1 else ""
    return f"{what}, {s.mixed_precision}, {where} {s.backend} process(es){off[s.offload]}{sp}"


def render_accelerate_yaml(s: Settings, deepspeed_file: str | None, header: str = "") -> str:
    cfg = accelerate_dict(s, deepspeed_file)
    lines = _comment_lines(header) if header else []
    lines += [
        f"# accelerate config: {title_of(s)}.",
        "# Written by `accel-npu config`; `accelerate launch --config_file THIS train.py` runs it.",
    ]
    if s.uses_deepspeed:
        lines.append(
            "# Precision is declared once, in the DeepSpeed JSON (accelerate refuses mixed_precision beside it)."
        )
    lines.append("# Environment of the training processes: the .accel-npu.yaml file beside this one.")
    width = 32
    for key, value in cfg.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            for sub, subval in value.items():
                entry = f"  {sub}: {_scalar(subval)}"
                comment = _YAML_COMMENTS.get(sub)
                lines.append(f"{entry.ljust(width)}  # {comment}" if comment else entry)
            continue
        entry = f"{key}: {_scalar(value)}"
        comment = _DIST_COMMENTS.get(value) if key == "distributed_type" else _YAML_COMMENTS.get(key)
        if key == "use_cpu" and s.backend == "cpu" and s.uses_deepspeed:
            comment = "false with DeepSpeed: accel-npu's cpu backend starts the gloo ranks"
        lines.append(f"{entry.ljust(width)}  # {comment}" if comment else entry)
    return "\n".join(lines) + "\n"


def sidecar_env(s: Settings) -> dict[str, str]:
    variables: dict[str, str] = {}  # written to the sidecar file
    tuning = worker_tuning(s.backend)
    if tuning is not None:
        variables.update({k: str(v) for k, v in s.npu_env.items() if str(v) != ""})
        single = tuning_defaults(s.backend)
        scaled = tuning_defaults(s.backend, s.num_machines, s.num_processes)
        for name, default in single.items():
            if variables.get(name) == default:
                # the backend's default, written for this job's size (a default may grow with the job):
                # a sidecar value wins over the launcher's own default
                variables[name] = scaled[name]
        if tuning.interface and s.num_machines > 1 and s.hccl_socket_ifname.strip():
            variables[tuning.interface[0]] = s.hccl_socket_ifname.strip()
    if not s.uses_deepspeed and str(s.gradient_accumulation_steps).lower() != "auto":
        variables["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(int(s.gradient_accumulation_steps))
    if s.frozen_modules:
        variables["ACCEL_NPU_FROZEN_MODULES"] = ",".join(p.strip() for p in s.frozen_modules.split(","))
    if s.load_slots and str(s.load_slots).lower() != "auto":
        variables["ACCEL_NPU_LOAD_SLOTS"] = str(int(s.load_slots))
    if s.truncate:
        variables["ACCEL_NPU_TRUNCATE"] = ",".join(p.replace(" ", "") for p in s.truncate.split(","))
    if s.uses_deepspeed and not s.async_checkpoint:
        variables["ACCEL_NPU_ASYNC_CHECKPOINT"] = "0"
    return variables


def render_sidecar(s: Settings, config_name: str) -> str:
    env = sidecar_env(s)
    lines = [
        f"# accel-npu launch settings for {config_name}.",
        f"# `accelerate launch --config_file {config_name} ...` gives these variables to every training",
        "# process (accel-npu reads this file next to the config; no launch script needed).",
        "# A variable already set in your shell wins over the value here.",
        f"backend: {s.backend}                      # the backend this config was written for",
    ]
    if not env:
        lines.append("env: {}")
    else:
        lines.append("env:")
        comments = env_comments(s.backend)
        for key, value in env.items():
            entry = f"  {key}: {_scalar(str(value))}"
            comment = comments.get(key)
            lines.append(f"{entry.ljust(48)}  # {comment}" if comment else entry)
    return "\n".join(lines) + "\n"


def render(s: Settings, config_file: Path, *, relative_paths: bool = False, header: str = "") -> dict[Path, str]:
    """The files to write for ``s`` with the accelerate config at ``config_file`` (in write order)."""
    config_file = Path(config_file)
    out: dict[Path, str] = {}
    ds_file = None
    if s.uses_deepspeed:
        ds_path = deepspeed_path_for(config_file)
        out[ds_path] = json.dumps(deepspeed_dict(s), indent=2) + "\n"
        ds_file = ds_path.name if relative_paths else str(ds_path.resolve())
    out[sidecar_path_for(config_file)] = render_sidecar(s, config_file.name)
    out[config_file] = render_accelerate_yaml(s, ds_file, header=header)
    return out


# -- reading a config back (--from) ------------------------------------------------------------------
def templates_dir() -> Path:
    import accel_npu.launch_configs as pkg

    return Path(pkg.__file__).resolve().parent


def template_names() -> list[str]:
    return sorted(p.stem for p in templates_dir().glob("*.yaml") if not p.name.endswith(SIDECAR_SUFFIX))


def resolve_template(name: str, backend: str) -> Path:
    """``--from`` NAME: a template name (``npu_zero3``), a short one (``zero3`` -> by backend), or a path."""
    as_path = Path(name).expanduser()
    if as_path.suffix in (".yaml", ".yml", ".json") and as_path.is_file():
        return as_path
    names = template_names()
    prefix = "cpu" if backend == "cpu" else "npu"
    for candidate in (name, f"{prefix}_{name}", f"{prefix}_{name}_zero3"):
        if candidate in names:
            return templates_dir() / f"{candidate}.yaml"
    raise ConfigError(
        f"--from {name!r}: no such template or file. Templates: {', '.join(names)} "
        f"(or zero2, zero3, multinode for this backend), or a path to an accelerate YAML."
    )


def settings_from_files(config_file: Path, machine: Machine) -> Settings:
    """The settings a written config (ours or a template) stands for, as wizard defaults."""
    import yaml

    config_file = Path(config_file)
    try:
        cfg = yaml.safe_load(config_file.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--from {config_file}: cannot read it as an accelerate YAML: {exc}") from exc
    side: dict = {}
    sidecar = sidecar_path_for(config_file)
    if sidecar.is_file():
        side = yaml.safe_load(sidecar.read_text()) or {}
    dist = cfg.get("distributed_type", "NO")
    backend = (
        side.get("backend")
        or {"MULTI_NPU": "npu", "MULTI_GPU": "cuda", "MULTI_CPU": "cpu"}.get(dist)
        or ("cpu" if cfg.get("use_cpu") else machine.backend)
    )
    s = default_settings(machine, backend)
    s.num_machines = int(cfg.get("num_machines", 1))
    total = int(cfg.get("num_processes", s.processes_per_machine))
    s.processes_per_machine = max(1, total // max(1, s.num_machines))
    s.machine_rank = int(cfg.get("machine_rank", 0))
    s.main_process_ip = cfg.get("main_process_ip")
    s.main_process_port = int(cfg.get("main_process_port") or 29500)
    sidecar_vars = dict(side.get("env") or {})  # the file's values, not this process's environment
    s.npu_env = {name: str(sidecar_vars.get(name, default)) for name, default in tuning_defaults(backend).items()}
    s.hccl_socket_ifname = str(sidecar_vars.get("HCCL_SOCKET_IFNAME", ""))
    s.frozen_modules = str(sidecar_vars.get("ACCEL_NPU_FROZEN_MODULES", ""))
    s.load_slots = str(sidecar_vars.get("ACCEL_NPU_LOAD_SLOTS", ""))
    s.truncate = str(sidecar_vars.get("ACCEL_NPU_TRUNCATE", ""))
    s.async_checkpoint = not environment.falsy(str(sidecar_vars.get("ACCEL_NPU_ASYNC_CHECKPOINT", "auto")))
    s.sp_size = int((cfg.get("parallelism_config") or {}).get("parallelism_config_sp_size", 1))
    if dist == "DEEPSPEED":
        dsc = cfg.get("deepspeed_config") or {}
        ds_name = dsc.get("deepspeed_config_file")
        if not ds_name:
            raise ConfigError(f"--from {config_file}: deepspeed_config has no deepspeed_config_file")
        ds_path = Path(ds_name)
        if not ds_path.is_absolute():
            ds_path = config_file.parent / ds_path
        try:
            ds = json.loads(ds_path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--from {config_file}: cannot read its DeepSpeed JSON {ds_path}: {exc}") from exc
        zero = ds.get("zero_optimization") or {}
        s.strategy = {2: "zero2", 3: "zero3"}.get(int(zero.get("stage", 2)), "zero2")
        s.zero3_init = bool(dsc.get("zero3_init_flag", True))
        s.offload = "all" if "offload_param" in zero else "optimizer" if "offload_optimizer" in zero else "none"
        if (ds.get("fp16") or {}).get("enabled"):
            s.mixed_precision = "fp16"
        elif (ds.get("bf16") or {}).get("enabled"):
            s.mixed_precision = "bf16"
        else:
            s.mixed_precision = "no"
        s.micro_batch_size = str(ds.get("train_micro_batch_size_per_gpu", "auto"))
        s.gradient_accumulation_steps = str(ds.get("gradient_accumulation_steps", "auto"))
        s.ds_base = ds
    else:
        s.strategy = "ddp"
        s.mixed_precision = cfg.get("mixed_precision") or "no"
        s.gradient_accumulation_steps = str(sidecar_vars.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto"))
    return s


# -- writing -----------------------------------------------------------------------------------------
def default_config_file() -> Path:
    """accelerate's own default config file (honours HF_HOME / XDG_CACHE_HOME like accelerate)."""
    from accelerate.commands.config.config_args import default_config_file as path

    return Path(path)


def backup_path(path: Path) -> Path:
    candidate = path.with_name(path.name + ".bak")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.bak.{n}")
        n += 1
    return candidate


def write_files(files: dict[Path, str]) -> list[tuple[Path, Path | None]]:
    """Write each file atomically; an existing one is first copied to a backup. Returns (path, backup)."""
    done: list[tuple[Path, Path | None]] = []
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        backup = None
        if path.exists():
            if path.read_text() == text:
                done.append((path, None))
                continue
            backup = backup_path(path)
            shutil.copy2(path, backup)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
        done.append((path, backup))
    return done


__all__ = [
    "Settings",
    "Machine",
    "detect_machine",
    "default_settings",
    "problems",
    "validate",
    "render",
    "settings_from_files",
    "resolve_template",
    "default_config_file",
    "write_files",
    "template_files",
    "write_templates",
]


# -- launch_configs/ ---------------------------------------------------------------------------------
_DS_NOTES_2 = """\
{json} (JSON has no comments, so they are here):
  overlap_comm, contiguous_gradients: overlap gradient reduction with compute (~10 % per step on 910B)
  reduce_bucket_size, allgather_bucket_size {bucket}: {bucket_why}
  train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps "auto":
    taken from your script (DataLoader batch size, Accelerator(gradient_accumulation_steps=...))
  bf16 enabled: precision is declared there only (accelerate refuses mixed_precision beside it)"""
_DS_NOTES_3 = (
    _DS_NOTES_2
    + """
  stage3_prefetch_bucket_size {bucket}: parameters fetched ahead per step
  stage3_param_persistence_threshold 1e6: tensors under 1M elements (norms, biases) stay whole on
    every rank: far fewer all-gathers
  stage3_max_live_parameters, stage3_max_reuse_distance 1e9: a wide prefetch window, fewer re-gathers
  stage3_gather_16bit_weights_on_model_save true: accelerator.save_model / get_state_dict can
    export a bf16 copy (a collective: call it on every rank)"""
)

_NPU_BUCKET = ("5e8", "large buckets suit 910B's HCCS links (~56 GB/s); lower to 1e8 if HCCL times out")
_CPU_BUCKET_WHY = ("5e7", "smaller than the NPU files' 5e8 so the buckets fit a laptop's memory")

TEMPLATES: dict[str, tuple[Settings, str]] = {
    "npu_zero2": (
        Settings(backend="npu", processes_per_machine=8, strategy="zero2", mixed_precision="bf16"),
        "Ascend NPU: one machine, 8 NPUs, DeepSpeed ZeRO-2, bf16.\n"
        "ZeRO-2 shards optimizer states and gradients; parameters stay whole: the least intrusive ZeRO,\n"
        "fastest per step, for debugging and quick runs.\n" + _DS_NOTES_2,
    ),
    "npu_zero3": (
        Settings(backend="npu", processes_per_machine=8, strategy="zero3", mixed_precision="bf16"),
        "Ascend NPU: one machine, 8 NPUs, DeepSpeed ZeRO-3, bf16.\n"
        "ZeRO-3 shards parameters too: larger models and batches per NPU.\n" + _DS_NOTES_3,
    ),
    "npu_multinode_zero3": (
        Settings(
            backend="npu",
            num_machines=2,
            processes_per_machine=8,
            main_process_ip="10.0.0.1",
            main_process_port=29500,
            strategy="zero3",
            mixed_precision="bf16",
        ),
        "Ascend NPU: TEMPLATE for 2 machines x 8 NPUs, DeepSpeed ZeRO-3, bf16.\n"
        "EDIT main_process_ip (machine rank 0's address) and num_machines / num_processes (total).\n"
        "Run on every machine: accelerate launch --config_file THIS --machine_rank N train.py\n"
        "(N = 0 on the main machine). Same files, same paths on all machines.\n" + _DS_NOTES_3,
    ),
    "cpu_zero2": (
        Settings(backend="cpu", processes_per_machine=2, strategy="zero2", mixed_precision="bf16"),
        "CPU debugging twin of npu_zero2: 2 CPU ranks over gloo, DeepSpeed ZeRO-2, bf16. Runs on any\n"
        "laptop: debug the distributed path of a training script before it reaches the NPUs.\n"
        "  accelerate launch --config_file THIS train.py\n" + _DS_NOTES_2,
    ),
    "cpu_zero3": (
        Settings(backend="cpu", processes_per_machine=2, strategy="zero3", mixed_precision="bf16"),
        "CPU debugging twin of npu_zero3: 2 CPU ranks over gloo, DeepSpeed ZeRO-3, bf16. Runs on any\n"
        "laptop: debug the distributed path of a training script before it reaches the NPUs.\n"
        "  accelerate launch --config_file THIS train.py\n" + _DS_NOTES_3,
    ),
    "cpu_multinode_zero3": (
        Settings(
            backend="cpu",
            num_machines=2,
            processes_per_machine=1,
            main_process_ip="127.0.0.1",
            main_process_port=29500,
            strategy="zero3",
            mixed_precision="bf16",
        ),
        "CPU debugging twin of npu_multinode_zero3: two 'machines' on this one, 1 CPU rank each,\n"
        "DeepSpeed ZeRO-3, bf16. Start both (two terminals):\n"
        "  accelerate launch --config_file THIS --machine_rank 0 train.py\n"
        "  accelerate launch --config_file THIS --machine_rank 1 train.py\n" + _DS_NOTES_3,
    ),
}


def template_files(directory: Path) -> dict[Path, str]:
    """Every file of launch_configs/ as generated from :data:`TEMPLATES`."""
    out: dict[Path, str] = {}
    for name, (settings, header) in TEMPLATES.items():
        s = replace(settings, npu_env=tuning_defaults(settings.backend))
        bucket, why = _CPU_BUCKET_WHY if s.backend == "cpu" else _NPU_BUCKET
        text = header.format(json=name + DEEPSPEED_SUFFIX, bucket=bucket, bucket_why=why)
        out.update(render(s, Path(directory) / f"{name}.yaml", relative_paths=True, header=text))
    return out


def write_templates(directory: str | Path) -> None:
    """Regenerate launch_configs/ (``python -c "from accel_npu.cli.config.settings import write_templates;
    write_templates('launch_configs')"``)."""
    for path, text in template_files(Path(directory)).items():
        path.write_text(text)
