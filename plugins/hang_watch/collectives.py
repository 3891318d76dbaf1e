"""The collectives the hang watch counts, one wrapper each (watch.py), by name."""

#: The collectives of torch.distributed (p2p send/recv and monitored_barrier, which has its own
#: timeout and report, are left alone).
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)
#: torch 2.13's names for the single-tensor collectives (pytorch PR 186130; absent before): the deprecated
#: all_gather_into_tensor / reduce_scatter_tensor forward to them, and callers migrate to them (FSDP, PR 186124).
SINGLE_TENSOR_COLLECTIVES = ("all_gather_single", "reduce_scatter_single")
