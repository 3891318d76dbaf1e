"""The process's sequence-parallel state: its groups, its device mesh, the data-parallel rank its DataLoader
shards by, and the random state its SP group shares.

Ranks are laid out as DeepSpeed's own ``parallel_state_sp.initialize_sequence_parallel`` lays them out
(runtime/sequence_parallel/parallel_state_sp.py): SP groups of ``sp_size`` contiguous ranks, one
sequence-data-parallel group over every rank, which ZeRO reduces gradients and partitions states over. That
module is the ``mpu`` DeepSpeed is handed, as accelerate hands it for a transformers model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("accel_npu")


@dataclass
class SequenceParallel:
    """One process's sequence parallelism, set up at the model's ``prepare``."""

    sp_size: int
    world_size: int
    rank: int
    model: object  # the diffusers model whose sequence is split
    mpu: object  # deepspeed.runtime.sequence_parallel.parallel_state_sp
    mesh: object  # DeviceMesh ("dp", "ring", "ulysses"), what diffusers' ContextParallelConfig takes
    # every backward through the gather sums the output's gradient over the SP group (loss_average.py), not only
    # DeepSpeed's engine backward, which averages the loss first: set under FSDP2, whose reduction averages
    sum_every_gathered_gradient: bool = False

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size


#: set once per process by the model's prepare (plugins/sequence_parallel/prepare.py); read by the
#: DataLoader, mpu and adapter wrappers
ACTIVE: SequenceParallel | None = None


def active() -> SequenceParallel | None:
    return ACTIVE


def build(model, sp_size: int, device_type: str) -> SequenceParallel:
    """DeepSpeed's SP groups (once per process) and a device mesh over the same ranks."""
    global ACTIVE
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        # under FSDP2 accelerate sets up torch.distributed only; parallel_state_sp makes its groups through
        # deepspeed.comm, whose init_distributed wraps the process group already there (comm/comm.py)
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend())
    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sp_size)
    # ("dp", "ring", "ulysses"): the "ulysses" groups are DeepSpeed's SP groups (contiguous ranks); diffusers'
    # ContextParallelConfig.setup takes the "ring" and "ulysses" dimensions (models/_modeling_parallel.py)
    mesh = init_device_mesh(device_type, (world // sp_size, 1, sp_size), mesh_dim_names=("dp", "ring", "ulysses"))
    ACTIVE = SequenceParallel(sp_size, world, rank, model, parallel_state_sp, mesh)
    return ACTIVE


def share_random_state(state: SequenceParallel) -> None:
    """Every rank of an SP group continues from its first rank's random state (torch's CPU and device
    generators, Python's ``random``, NumPy's global one): the script draws noise and timesteps after prepare from
    the global generators (and, e.g. cosmos/train_cosmos_predict25_lora.py, the conditioning frames from
    ``random.choices``), and the ranks of one group must draw the same ones for the same batch."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    group = state.mpu.get_sequence_parallel_group()
    first = (state.rank // state.sp_size) * state.sp_size
    device_module = None
    device_type = state.mesh.device_type
    if device_type != "cpu":
        device_module = getattr(torch, device_type, None)
    payload = [
        (
            torch.get_rng_state(),
            device_module.get_rng_state()
            if device_module is not None and hasattr(device_module, "get_rng_state")
            else None,
            random.getstate(),
            np.random.get_state(),
        )
    ]
    dist.broadcast_object_list(payload, src=first, group=group)
    cpu_state, device_state, python_state, numpy_state = payload[0]
    torch.set_rng_state(cpu_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    if device_state is not None:
        device_module.set_rng_state(device_state)
