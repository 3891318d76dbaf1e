"""How FSDP2 reduces gradients over its ranks (torch's ``fully_shard``, gloo): a Linear sharded over every rank, each
rank's loss on its own input; prints ``REDUCED {json}``: for the default reduction and for a divide factor of 1
with sum-only collectives, the reduced gradient over the sum of the ranks' gradients (computed here on one
unsharded copy per input). What plugins/sequence_parallel/fsdp2.py corrects (docs/sequence-parallel.md): the ranks of
one sequence-parallel group hold partial gradients that must be summed, and FSDP2 averages. Never imports accel_npu.
"""

import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
weight = torch.randn(4, 4)
inputs = [torch.randn(3, 4) for _ in range(world)]


def unsharded_gradient(x):
    layer = torch.nn.Linear(4, 4, bias=False)
    layer.weight.data.copy_(weight)
    layer(x).square().sum().backward()
    return layer.weight.grad


summed = sum(unsharded_gradient(x) for x in inputs)
ratios = {}
for mode in ("default", "divide_by_1_sum_only"):
    layer = torch.nn.Linear(4, 4, bias=False)
    layer.weight.data.copy_(weight)
    fully_shard(layer)
    if mode != "default":
        layer.set_gradient_divide_factor(1.0)
        layer.set_force_sum_reduction_for_comms(True)
    layer(inputs[rank]).square().sum().backward()
    ratios[mode] = (layer.weight.grad.full_tensor() / summed).mean().item()
if rank == 0:
    print("REDUCED " + json.dumps({"world": world, **ratios}), flush=True)
# Every rank's gloo work is done before any rank tears its group down: a rank that exits while its peer's last
# collective is still in flight aborted once in CI ("terminate called without an active exception", torch 2.13).
dist.barrier()
dist.destroy_process_group()
