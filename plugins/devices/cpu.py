"""The cpu device backend: no accelerator, so distributed launches train over gloo.

Stock accelerate 1.15 on a machine without an accelerator:
- with a DeepSpeed config, every rank believes it is rank 0 of 1 (``_prepare_backend`` finds no
  backend) while DeepSpeed's own gloo group has N: ranks train on the same data and write the
  same files;
- ``accelerate launch --num_processes 2 train.py`` without a config starts *one* process (its
  only multi-CPU path goes through mpirun).
This plugin makes both behave like they do on GPUs, which is what lets a user debug the very
same DeepSpeed config on a laptop. It also closes the gloo group of a script that never calls
``destroy_process_group`` before the interpreter tears down (see ``CLOSE_GLOO_AT_EXIT``).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

from accel_npu import environment
from accel_npu._torch import dist as _dist
from accel_npu.backend import Backend, cpu_fallback_refusal, current_backend, is_distributed_launch
from accel_npu.errors import NoUsableDeviceError
from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch, argument

from . import gloo_workers

log = logging.getLogger("accel_npu")


@hookimpl(trylast=True)
def accel_npu_select_backend(env):
    forced = environment.forced_backend(env)
    if forced and forced != "cpu":
        return None
    return Backend(
        name="cpu", device_type="cpu", dist_backend="gloo", device_count=0, ds_accelerator="cpu", plugin="devices.cpu"
    )


@hookimpl
def accel_npu_launch_env(backend, env):
    if backend.name != "cpu":
        return None
    # DeepSpeed would otherwise probe for CUDA/NPU; say what we know.
    return {"DS_ACCELERATOR": "cpu"}


def _prepare_backend_on_cpu(wrapped, instance, args, kwargs):
    backend, distributed_type = wrapped(*args, **kwargs)
    if backend is None and current_backend().name == "cpu" and is_distributed_launch():
        from accelerate.utils import DistributedType

        refusal = cpu_fallback_refusal()
        if refusal:  # an NPU rank that lost its device (a per-rank ASCEND_RT_VISIBLE_DEVICES): not gloo
            raise NoUsableDeviceError(refusal)

        log.info(
            "accel-npu: no accelerator; rank %s of %s uses gloo (MULTI_CPU)",
            os.environ.get("RANK"),
            os.environ.get("WORLD_SIZE"),
        )
        return "gloo", DistributedType.MULTI_CPU
    return backend, distributed_type


@hookimpl
def accel_npu_launch_args(backend, launch_args, resolved):
    # `accelerate launch --num_processes N` without an accelerator starts 1 process (multi-CPU only via
    # mpirun); `use_cpu: true` with DeepSpeed fails outright (accelerate/commands/launch.py)
    if not resolved or backend.name != "cpu":
        return
    n = launch_args.num_processes or 1
    machines = launch_args.num_machines or 1
    single_process_path = not (
        launch_args.multi_gpu
        or launch_args.use_deepspeed
        or launch_args.use_fsdp
        or launch_args.use_megatron_lm
        or launch_args.tpu
    )
    if n > 1 and getattr(launch_args, "mpirun_hostfile", None) is None:
        if launch_args.use_deepspeed or launch_args.use_fsdp or launch_args.cpu:
            # `use_cpu: true` sends these to the single-process launcher; torchrun works instead.
            launch_args.cpu = False
        if single_process_path:
            launch_args.multi_gpu = True  # accelerate's torchrun path; the workers pick gloo
            log.info("accel-npu: no accelerator; starting %d CPU processes with torchrun (gloo)", n * machines)


def _fsdp_on_cpu(wrapped, instance, args, kwargs):
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    first = not AcceleratorState._shared_state  # later AcceleratorState() calls only re-read it
    wrapped(*args, **kwargs)
    fsdp_plugin = argument(args, kwargs, 4, "fsdp_plugin")
    if (
        first
        and fsdp_plugin is not None
        and instance.distributed_type == DistributedType.MULTI_CPU
        and current_backend().name == "cpu"
    ):
        # What stock does for MULTI_GPU/MULTI_NPU/...: the list it checks leaves MULTI_CPU out.
        instance.distributed_type = DistributedType.FSDP
        if instance._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(instance._mixed_precision)
        instance.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        log.info(
            "accel-npu: no accelerator; FSDP%s over %s gloo ranks", fsdp_plugin.fsdp_version, instance.num_processes
        )


# Long enough for a worker descheduled on a loaded machine; short enough not to hide a stuck peer.
_GLOO_DRAIN_TIMEOUT_S = 10.0


def _close_gloo_group_at_exit() -> None:
    """atexit: close gloo while Python is still alive, so no gloo thread needs it in teardown.

    Destroys the default group a script left open (freeing it joins its worker threads), then
    waits until the workers of groups still referenced (DeepSpeed keeps its own to the end) have
    put down their last work: see ``gloo_workers``. Skipped after an unhandled exception
    (``sys.last_value`` is set): a peer may still be inside a collective with this rank, and
    neither would return until it times out.
    """
    if not CLOSE_GLOO_AT_EXIT.applied or getattr(sys, "last_value", None) is not None:
        return
    try:
        _dist.run_before_group_close()  # e.g. a rank that serves rank 0's save at the end of the script
    except Exception as exc:  # noqa: BLE001 - at exit: say it, never raise
        log.warning("accel-npu: an exit hook failed before the gloo group was closed: %s", exc)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and "gloo" in str(dist.get_backend()):
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 — at exit: say it, never raise
        log.debug("accel-npu: could not close the gloo group at exit: %s", exc)
    busy = gloo_workers.wait_until_idle(timeout_s=_GLOO_DRAIN_TIMEOUT_S)
    if busy:
        log.warning(
            "accel-npu: %d gloo worker thread(s) still busy %.0f s after the script ended (%s); "
            "exiting anyway. A collective started without wait() may still be running.",
            len(busy),
            _GLOO_DRAIN_TIMEOUT_S,
            "; ".join(busy.values()),
        )


def _register_close_at_exit(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if current_backend().name == "cpu":
        # PartialState() runs again for every Accelerator: keep one registration.
        atexit.unregister(_close_gloo_group_at_exit)
        atexit.register(_close_gloo_group_at_exit)
    return result


PREPARE_BACKEND = Patch(
    target="accelerate.state:PartialState._prepare_backend",
    supports="accelerate>=1.10.1,<1.17",
    reason="No accelerator + distributed launch: stock returns no backend, so every rank is "
    "rank 0 of 1 while DeepSpeed's gloo group has N (duplicate data and checkpoints).",
    remove_when="accelerate selects gloo/MULTI_CPU for LOCAL_RANK launches without an accelerator",
    wrapper=".cpu:_prepare_backend_on_cpu",
)


FSDP_ON_CPU = Patch(
    target="accelerate.state:AcceleratorState.__init__",
    supports="accelerate>=1.10.1,<1.17",
    # accelerate/state.py AcceleratorState.__init__ sets DistributedType.FSDP only for
    # MULTI_GPU/NPU/XPU/..., never MULTI_CPU.
    reason="An FSDP launch config on gloo ranks silently trains as plain DDP: accelerate/state.py "
    "turns FSDP on for GPU/NPU/XPU types only, never MULTI_CPU.",
    remove_when="accelerate enables FSDP for DistributedType.MULTI_CPU",
    wrapper=".cpu:_fsdp_on_cpu",
)

CLOSE_GLOO_AT_EXIT = Patch(
    target="accelerate.state:PartialState.__init__",
    supports="accelerate>=1.10.1,<1.17",
    # A gloo worker that drops its last work (its tensors) after Python starts finalizing needs the
    # GIL and aborts ('terminate called without an active exception'); the atexit fix pytorch#179291
    # was abandoned. At exit: destroy the default group, then wait until the groups still
    # referenced (DeepSpeed's) are idle.
    reason="gloo workers still running at interpreter exit abort a finished run with SIGABRT, exit -6 "
    "(pytorch#190489); the groups are closed or quiesced at exit.",
    remove_when="torch.distributed quiesces gloo's worker threads before Python finalizes",
    wrapper=".cpu:_register_close_at_exit",
)


def _shm_op_only_when_asked(wrapped, instance, args, kwargs):
    # DeepSpeed's CPU accelerator JIT-compiles its shared-memory all-reduce op in every process
    # group setup (deepspeed/comm/torch.py TorchBackend.__init__ -> build_shm_op): a g++ build
    # before step 1 of a first run, and "Error building extension
    # 'deepspeed_shm_comm'" where no compiler is installed. The op serves only
    # inference_all_reduce (tensor-parallel inference); ZeRO training reduces through
    # torch.distributed either way. Returning None is DeepSpeed's own path when the op is not
    # available (e.g. not Linux): inference_all_reduce falls back to the process group.
    try:
        from deepspeed.accelerator import get_accelerator

        on_cpu = get_accelerator()._name == "cpu"
    except Exception:  # noqa: BLE001 - not ours to decide then
        on_cpu = False
    if not on_cpu or environment.flag("ACCEL_NPU_DEEPSPEED_SHM_OP"):
        return wrapped(*args, **kwargs)
    log.debug("accel-npu: DeepSpeed's shm all-reduce op not built (ACCEL_NPU_DEEPSPEED_SHM_OP=1 builds it)")
    return None


SHM_OP_ONLY_WHEN_ASKED = Patch(
    target="deepspeed.comm.torch:build_shm_op",
    supports="deepspeed>=0.16.9,<0.20",
    reason="deepspeed/comm/torch.py TorchBackend.__init__ compiles the CPU shm all-reduce op with g++ "
    "(fails without a compiler); only inference_all_reduce uses it.",
    remove_when="DeepSpeed builds the shm op lazily, on the first inference_all_reduce",
    wrapper=".cpu:_shm_op_only_when_asked",
)


@hookimpl
def accel_npu_register_patches():
    return [PREPARE_BACKEND, FSDP_ON_CPU, CLOSE_GLOO_AT_EXIT, SHM_OP_ONLY_WHEN_ASKED]
