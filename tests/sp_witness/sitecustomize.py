"""A witness for the sequence-parallel tests (tests/test_sequence_parallel.py), independent of accel-npu: put
on a launched rank's PYTHONPATH with ``SP_WITNESS_DIR`` set, it wraps three torch functions and writes what
they saw to ``$SP_WITNESS_DIR/rank<RANK>.json`` when the rank exits:

- ``torch.nn.functional.scaled_dot_product_attention``: the (batch, heads, tokens, head_dim) of each call;
- ``torch.distributed._functional_collectives.all_to_all_single`` (what diffusers' Ulysses attention calls):
  the group's size and the number of elements sent by each call;
- ``torch.optim.AdamW.step`` and ``torch.optim.Adam.step``: the sum of squared gradients of the parameters
  this rank's optimizer steps (under ZeRO-2 its partition of the flat fp32 gradients): summed over the ranks,
  the squared gradient norm.

Only in processes with RANK set (the launched ranks, not the launcher). Never imports accel_npu.
"""

import atexit
import json
import os

if os.environ.get("SP_WITNESS_DIR") and "RANK" in os.environ:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    _seen = {"sdpa": [], "all_to_all": [], "grad_sq": []}
    _sdpa, _a2a = F.scaled_dot_product_attention, funcol.all_to_all_single

    def scaled_dot_product_attention(query, *args, **kwargs):
        _seen["sdpa"].append(list(query.shape))
        return _sdpa(query, *args, **kwargs)

    def all_to_all_single(tensor, output_split_sizes, input_split_sizes, group, *args, **kwargs):
        size = dist.get_world_size(group) if not isinstance(group, str) else -1
        _seen["all_to_all"].append([size, tensor.numel()])
        return _a2a(tensor, output_split_sizes, input_split_sizes, group, *args, **kwargs)

    def _recording(original):
        def step(self, *args, **kwargs):
            total = 0.0
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        total += float(p.grad.detach().double().pow(2).sum())
            _seen["grad_sq"].append(total)
            return original(self, *args, **kwargs)

        return step

    F.scaled_dot_product_attention = scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention
    funcol.all_to_all_single = all_to_all_single
    torch.optim.AdamW.step = _recording(torch.optim.AdamW.step)
    torch.optim.Adam.step = _recording(torch.optim.Adam.step)

    def _write():
        path = os.path.join(os.environ["SP_WITNESS_DIR"], f"rank{os.environ['RANK']}.json")
        with open(path, "w") as f:
            json.dump(_seen, f)

    atexit.register(_write)
