"""Errors accel-npu raises on purpose: each says what went wrong and what to do."""


class AccelNpuError(RuntimeError):
    """Base class of every error accel-npu raises deliberately."""


class LaunchError(AccelNpuError):
    """A launch that cannot work (e.g. more processes than devices), refused before workers start."""


class ConfigError(AccelNpuError):
    """A configuration that contradicts itself or names something that does not exist."""


class LoadError(AccelNpuError):
    """A checkpoint that cannot be loaded as asked; names the file and key and says what to do."""


class CheckpointError(AccelNpuError):
    """A checkpoint that is incomplete, or a checkpoint operation that cannot work."""


class NoUsableDeviceError(AccelNpuError):
    """A launched rank whose accelerator is installed but unusable, refused instead of training on the CPU."""
