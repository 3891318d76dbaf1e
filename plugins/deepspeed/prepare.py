"""The wrapper of ``Accelerator.prepare`` under DeepSpeed: one patch, two completions of what the script asked.

- several models with one optimizer over them: one engine (models_together.py);
- an "auto" micro batch size accelerate cannot read: resolved (auto_batch_size.py), on the call as accelerate
  sees it (the models already put under one container).
"""

from __future__ import annotations

from accel_npu.plugins.deepspeed.auto_batch_size import prepare_with_auto_micro_batch_size
from accel_npu.plugins.deepspeed.models_together import prepare_models_together


def before_engine(accelerator, objects) -> None:
    """Every plugin's accel_npu_prepare_deepspeed, before accelerate prepares the DataLoaders or builds the engine."""
    from accel_npu.manager import get_plugin_manager

    get_plugin_manager().hook.accel_npu_prepare_deepspeed(accelerator=accelerator, objects=objects)


def prepare(wrapped, instance, args, kwargs):
    from accelerate.utils import DistributedType

    if instance.distributed_type != DistributedType.DEEPSPEED:
        return wrapped(*args, **kwargs)
    before_engine(instance, args)

    def with_auto_micro_batch_size(*call_args, **call_kwargs):
        return prepare_with_auto_micro_batch_size(wrapped, instance, call_args, call_kwargs)

    return prepare_models_together(with_auto_micro_batch_size, instance, args, kwargs)
