"""A witness for the sequence-parallel tests (tests/test_sequence_parallel.py), independent of accel-npu: put
on a launched rank's PYTHONPATH with ``SP_WITNESS_DIR`` set, it wraps three torch functions and writes what
they saw to ``$SP_WITNESS_DIR/rank<RANK>.json`` when the rank exits:

- ``torch.nn.functional.scaled_dot_product_attention``: the (batch, heads, tokens, head_dim) of each call;
- ``torch.distributed._functional_collectives.all_to_all_single`` (what diffusers' Ulysses attention calls):
  the group's size and the number of elements sent by each call;
- ``torch.optim.AdamW.step`` and ``torch.optim.Adam.step``: the sum of squared gradients of the parameters
  this rank's optimizer steps (under ZeRO-2 its partition of the flat fp32 gradients): summed over the ranks,
  the squared gradient norm; and, before each step, the state it steps from: the sums of squares of the
  parameters, of Adam's ``exp_avg`` and ``exp_avg_sq``, and Adam's step count (after a resume: what was loaded).

The all_to_all records carry the ranks of the group they exchange over.

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

    _seen = {"sdpa": [], "all_to_all": [], "grad_sq": [], "state": [], "a2a_groups": []}
    _sdpa, _a2a = F.scaled_dot_product_attention, funcol.all_to_all_single

    def scaled_dot_product_attention(query, *args, **kwargs):
        _seen["sdpa"].append(list(query.shape))
        return _sdpa(query, *args, **kwargs)

    def all_to_all_single(tensor, output_split_sizes, input_split_sizes, group, *args, **kwargs):
        process_group = dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group
        size = dist.get_world_size(process_group)
        _seen["all_to_all"].append([size, tensor.numel()])
        ranks = sorted(dist.get_process_group_ranks(process_group))
        if ranks not in _seen["a2a_groups"]:
            _seen["a2a_groups"].append(ranks)
        return _a2a(tensor, output_split_sizes, input_split_sizes, group, *args, **kwargs)

    def _recording(original):
        def step(self, *args, **kwargs):
            total = 0.0
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        total += float(p.grad.detach().double().pow(2).sum())
            _seen["grad_sq"].append(total)
            sums = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0, "step": None}
            for group in self.param_groups:
                for p in group["params"]:
                    sums["param"] += float(p.detach().double().pow(2).sum())
                    state = self.state.get(p, {})
                    for key in ("exp_avg", "exp_avg_sq"):
                        if key in state:
                            sums[key] += float(state[key].detach().double().pow(2).sum())
                    if "step" in state:
                        sums["step"] = float(state["step"])
            _seen["state"].append(sums)
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
