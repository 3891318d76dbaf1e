"""Sequence parallelism for a diffusers model under DeepSpeed ZeRO-3: the gradients of one SP group summed.

The ranks of one SP group hold partial gradients of the same samples (each from its share of the tokens), which
must be summed, and the data-parallel groups averaged. ZeRO-3 partitions over every rank (the
sequence-data-parallel group DeepSpeed takes from ``parallel_state_sp``) and reduces a bucket of gradients in one
of two ways (deepspeed 0.19.8 runtime/zero/stage3.py ``__reduce_and_partition_ipg_grads``):
``__avg_scatter_contiguous_grads`` divides by processes / sp_size, as stage 1/2's ``average_tensor`` does, but runs
only with ``reduce_scatter: false``; ``__avg_scatter_grads``, the default, calls ``reduce_scatter_coalesced``
(runtime/comm/coalesced_collectives.py), which divides by every rank: sp=2 trains with half the gradient of sp=1.
Its result is multiplied by sp_size here, the factor the contiguous path applies.

Only for accel-npu's split of a diffusers model: accelerate's DeepSpeed Ulysses for transformers models (ALST)
averages each rank's loss over the SP group with a differentiable all_gather whose backward sums over it, and
DeepSpeed's own test (tests/unit/ulysses_alst/test_ulysses_sp_hf.py) checks that recipe under ZeRO-3 unscaled.
"""

from __future__ import annotations

from accel_npu.plugins.sequence_parallel import groups


def scatter_gradients_summed_within_sp_groups(wrapped, instance, args, kwargs):
    partitions = wrapped(*args, **kwargs)
    sp = instance.sequence_parallel_size
    if sp > 1 and groups.active() is not None:
        for partition in partitions:
            partition.mul_(sp)
    return partitions
