"""The launch config's DeepSpeed file wins over a script's hard-coded ``DeepSpeedPlugin(hf_ds_config=...)``;
every DeepSpeed config is shown to the ``accel_npu_configure_deepspeed`` hook."""

from __future__ import annotations

import logging
import os

from accel_npu._torch.markers import DS_CONFIG_SOURCE

log = logging.getLogger("accel_npu")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (TypeError, ValueError):
        return a == b


def plugin_post_init(wrapped, instance, args, kwargs):
    given = getattr(instance, "hf_ds_config", None)
    launch_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if launch_file in (None, "", "none"):
        launch_file = None
    if isinstance(given, str) and given != "none" and launch_file and not _same_file(given, launch_file):
        log.warning(
            "accel-npu: the script's DeepSpeedPlugin(hf_ds_config=%r) is replaced by the launch "
            "config's DeepSpeed file %r (deepspeed_config_file wins over a hard-coded path)",
            given,
            launch_file,
        )
        instance.hf_ds_config = launch_file
        given = launch_file
    if isinstance(given, str) and given != "none":
        source = given
    elif given is None and launch_file:
        source = launch_file
    elif isinstance(given, dict):
        source = "<script>"
    else:
        source = "<accelerate defaults>"
    setattr(instance, DS_CONFIG_SOURCE, source)
    result = wrapped(*args, **kwargs)
    try:
        from accel_npu.manager import get_plugin_manager

        get_plugin_manager().hook.accel_npu_configure_deepspeed(ds_config=instance.deepspeed_config, source=source)
    except AttributeError:  # a plugin built without a config (never in accelerate 1.15)
        pass
    return result
