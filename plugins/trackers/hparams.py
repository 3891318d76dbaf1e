"""TensorBoard's hparams given values it cannot record (the wrapper of accelerate's
``TensorBoardTracker.store_init_configuration``).

accelerate passes ``values`` to ``writer.add_hparams`` and then dumps the same dict to hparams.yml. For the
duration of the call the tracker's writer gets an ``add_hparams`` of its own (an instance attribute, removed
after) that hands torch the values it refuses as their ``str()``; the dict itself is not changed, so
hparams.yml keeps the real values. A call whose values torch takes as they are runs untouched.
"""

from __future__ import annotations

import logging

from accel_npu.patching.arguments import argument

log = logging.getLogger("accel_npu")


def _recordable(value) -> bool:
    """What torch/utils/tensorboard/summary.py ``hparams`` accepts (None is skipped there)."""
    import torch

    return value is None or isinstance(value, (bool, int, float, str, torch.Tensor))


def store_init_configuration(wrapped, instance, args, kwargs):
    values = argument(args, kwargs, 0, "values")
    writer = getattr(instance, "writer", None)  # set by start(), on the main process only
    if writer is None or not isinstance(values, dict):
        return wrapped(*args, **kwargs)
    odd = [k for k, v in values.items() if not _recordable(v)]
    if not odd:
        return wrapped(*args, **kwargs)
    log.warning(
        "accel-npu: TensorBoard's hparams take int, float, str, bool or tensors (torch/utils/tensorboard/"
        "summary.py hparams raises ValueError for others); init_trackers' config has %s: recorded there as "
        "str(); accelerate's hparams.yml keeps the values.",
        ", ".join(f"{k} ({type(values[k]).__name__})" for k in odd),
    )
    refused = set(odd)
    original = writer.add_hparams

    def add_hparams(hparam_dict, *rest, **more):
        if hparam_dict is values:
            hparam_dict = {k: (str(v) if k in refused else v) for k, v in values.items()}
        return original(hparam_dict, *rest, **more)

    writer.add_hparams = add_hparams
    try:
        return wrapped(*args, **kwargs)
    finally:
        if writer.__dict__.get("add_hparams") is add_hparams:
            del writer.add_hparams
