"""Wrappers that let the DeepSpeed file decide mixed precision (named by path in this package's patches).

accelerate 1.15 rejects ``mixed_precision`` set beside ``deepspeed_config_file`` ("the following accelerate
config variables will be ignored") and raises on a value that disagrees with the DeepSpeed JSON; here the
launcher and each worker resolve the two with ``precision_config.resolve_precision``.
"""

from __future__ import annotations

import json
import logging
import os

from accel_npu._torch.markers import DS_CONFIG_SOURCE
from accel_npu.patching import argument
from accel_npu.plugins.deepspeed.precision_config import resolve_precision

log = logging.getLogger("accel_npu")


# -- launcher side -----------------------------------------------------------------------------------
def _accelerate_config_path(args) -> str:
    if getattr(args, "config_file", None):
        return str(args.config_file)
    try:
        from accelerate.commands.config.config_args import default_config_file

        return str(default_config_file)
    except Exception:  # noqa: BLE001 - only names the file in a message
        return "the accelerate config"


def deepspeed_launcher(wrapped, instance, args, kwargs):
    launch_args = argument(args, kwargs, 0, "args")
    ds_file = getattr(launch_args, "deepspeed_config_file", None)
    if launch_args is None or not ds_file or not os.path.isfile(ds_file):
        return wrapped(*args, **kwargs)
    try:
        with open(ds_file) as f:
            ds_config = json.load(f)
    except (OSError, ValueError):
        return wrapped(*args, **kwargs)  # accelerate/DeepSpeed report unreadable files themselves
    fields = [f for f in str(getattr(launch_args, "deepspeed_fields_from_accelerate_config", "") or "").split(",") if f]
    from_config = "mixed_precision" in fields
    mp = getattr(launch_args, "mixed_precision", None) or "no"
    if from_config:
        source = f"mixed_precision in accelerate config {_accelerate_config_path(launch_args)}"
    elif mp != "no":
        source = "--mixed_precision"
    else:
        source = "accelerate (unset)"
    effective, line = resolve_precision(mp, source, ds_config, ds_file)
    if line:
        (log.warning if (from_config or mp != "no") else log.info)(line)
        launch_args.mixed_precision = effective
        launch_args.deepspeed_fields_from_accelerate_config = ",".join(f for f in fields if f != "mixed_precision")
    return wrapped(*args, **kwargs)


# -- worker side ---------------------------------------------------------------------------------
def config_checks(wrapped, instance, args, kwargs):
    raw = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS")
    fields = (raw or "").split(",")
    if "mixed_precision" not in fields:
        return wrapped(*args, **kwargs)
    # mixed_precision is reconciled in set_mixed_precision below; the other fields keep stock checks
    os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(f for f in fields if f != "mixed_precision")
    try:
        return wrapped(*args, **kwargs)
    finally:
        os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = raw


def set_mixed_precision(wrapped, instance, args, kwargs):
    mixed_precision = argument(args, kwargs, 0, "mixed_precision")
    ds_source = str(getattr(instance, DS_CONFIG_SOURCE, None) or "<DeepSpeedPlugin config>")
    env_mp = os.environ.get("ACCELERATE_MIXED_PRECISION")
    source = (
        "ACCELERATE_MIXED_PRECISION (accelerate launch)"
        if env_mp and env_mp.lower() == str(mixed_precision).lower()
        else "Accelerator(mixed_precision=...)"
    )
    effective, line = resolve_precision(mixed_precision, source, instance.deepspeed_config, ds_source)
    if line and effective != (mixed_precision or "no"):
        log.warning(line)
    return wrapped(effective)
