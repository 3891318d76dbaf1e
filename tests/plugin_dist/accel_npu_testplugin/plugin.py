"""A third-party plugin: one patch through the public API, one env report section."""

from accel_npu import hookimpl
from accel_npu.patching import Patch


def _clip(wrapped, instance, args, kwargs):
    mask_len, action_horizon = args
    return min(wrapped(mask_len, action_horizon), action_horizon)


HORIZON = Patch(
    target="accel_npu_testplugin.greeting:horizon",
    supports="accel-npu-testplugin>=0.3,<1",
    reason="test plugin: clip the mask length to the action horizon",
    remove_when="never (test fixture)",
    wrapper=_clip,
)


@hookimpl
def accel_npu_register_patches():
    return [HORIZON]


@hookimpl
def accel_npu_env_report(backend):
    return ("Test plugin", {"hello": "from accel-npu-testplugin"})
