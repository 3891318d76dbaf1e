"""Every environment variable accel-npu reads, in one place, with its meaning.

``accel-npu env`` prints this table; docs/environment.md is checked against it.
"""

from __future__ import annotations

import os


class EnvVar:
    """One declared variable. A plain class: this module is imported inside ``import torch``, where
    a dataclass's generated methods would cost an ``exec`` each."""

    __slots__ = ("name", "default", "meaning")

    def __init__(self, name: str, default: str, meaning: str) -> None:
        self.name, self.default, self.meaning = name, default, meaning

    def __repr__(self) -> str:
        return f"EnvVar({self.name!r}, {self.default!r})"


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("ACCEL_NPU_DISABLE", "0", "1: accel-npu does nothing at all (as if not installed)."),
    EnvVar(
        "ACCEL_NPU_DISABLED_PLUGINS",
        "",
        "Comma-separated plugin names to block, or '*' for all but the essential ones; the built-ins' old names "
        "(npu, cuda, cpu, launcher, launch_settings, deepspeed_setup) are aliases.",
    ),
    EnvVar(
        "ACCEL_NPU_DISABLED_PATCHES",
        "",
        "Comma-separated patch targets (module:Qual.name, as `accel-npu env` lists them) left unapplied: that "
        "function runs stock.",
    ),
    EnvVar("ACCEL_NPU_TRACE", "0", "1: log every hook call and every patch application to stderr."),
    EnvVar("ACCEL_NPU_BACKEND", "", "Force a device backend (npu, cuda, cpu) instead of detecting one."),
    EnvVar(
        "ACCEL_NPU_TRUNCATE",
        "",
        "Class:layers pairs; from_pretrained of that class builds and reads only the first N blocks.",
    ),
    EnvVar(
        "ACCEL_NPU_LOAD_SLOTS",
        "",
        "How many ranks of one node may materialize weights at once (default: from free memory).",
    ),
    EnvVar(
        "ACCEL_NPU_LOAD_TIMEOUT", "1800", "Seconds a rank waits for a load slot before failing with the holder's name."
    ),
    EnvVar(
        "ACCEL_NPU_LOAD_THREADS",
        "",
        "Threads one rank uses to read and cast weights (default: this node's cores / ranks loading at once, at most "
        "4).",
    ),
    EnvVar(
        "ACCEL_NPU_ZERO3_INIT",
        "1",
        "0: under ZeRO-3 with zero3_init_flag, load diffusers models whole per rank as stock does, instead of "
        "straight into partitions read once by rank 0.",
    ),
    EnvVar(
        "ACCEL_NPU_FROZEN_MODULES",
        "",
        "Comma-separated (dotted) child names kept out of DeepSpeed; 'none': off (default: auto-detect frozen "
        "children that are models, e.g. from_pretrained).",
    ),
    EnvVar(
        "ACCEL_NPU_COLLECTIVE_TIMEOUT",
        "30",
        "Seconds a rank-0-only ZeRO-3 gather waits for the other ranks before a clear error.",
    ),
    EnvVar(
        "ACCEL_NPU_ASYNC_CHECKPOINT",
        "auto",
        "Under DeepSpeed and FSDP2, save_state returns once each rank's state is copied to host memory; the files are "
        "written in the background and the checkpoint is published atomically once every rank's are durable: auto = "
        "launched ranks only, 1 = also plain processes, 0 = nowhere (save_state writes its files before it returns).",
    ),
    EnvVar(
        "ACCEL_NPU_ASYNC_CHECKPOINT_TIMEOUT",
        "3600",
        "Seconds an asynchronous save_state's background write may take on every rank; past it the checkpoint is "
        "not published and the next checkpoint call raises on every rank, naming the ranks that never finished.",
    ),
    EnvVar(
        "ACCEL_NPU_HANG_TIMEOUT",
        "",
        "Seconds a rank may wait in a collective before every rank prints its stacks, the ranks that did not arrive "
        "are named and the job fails; 0: off (default: just under the process-group timeout).",
    ),
    EnvVar(
        "ACCEL_NPU_DEEPSPEED_SHM_OP",
        "0",
        "1: on CPU, let DeepSpeed JIT-build its shared-memory all-reduce op (needs g++; built once per machine, "
        "before step 1); it serves only inference_all_reduce, never ZeRO training.",
    ),
    EnvVar(
        "ACCEL_NPU_CUDA_FACADE",
        "auto",
        'Where "cuda" stands for the active device (the torch.cuda façade, autocast("cuda"), a "cuda" GradScaler, the '
        "xformers/flash-attention flags): auto = launched ranks only, 1 = also plain processes, 0 = nowhere.",
    ),
    EnvVar("ACCEL_NPU_MX_DRIVING", "0", "1: enable mx_driving's patcher when mx_driving is installed (NPU)."),
)

_BY_NAME = {v.name: v for v in VARIABLES}

_YES = frozenset({"1", "true", "yes", "on"})
_NO = frozenset({"0", "false", "no", "off"})


def get(name: str, env=None) -> str:
    """The value of a declared variable (its default when unset); ``env``: another mapping."""
    var = _BY_NAME[name]
    return (os.environ if env is None else env).get(name, var.default)


def truthy(value: str) -> bool:
    """How accel-npu (and accelerate's own env flags) read yes/no values: 1/true/yes/on."""
    return value.strip().lower() in _YES


def falsy(value: str) -> bool:
    """0/false/no/off: an explicit "no" (for switches that are on by default)."""
    return value.strip().lower() in _NO


def flag(name: str) -> bool:
    """A yes/no variable that is off unless set to yes."""
    return truthy(get(name))


def switched_on(name: str) -> bool:
    """A yes/no variable that is on unless set to no."""
    return not falsy(get(name))


def whole_number(name: str) -> int:
    """A set variable that must be a whole number >= 1 (else one ConfigError naming it)."""
    raw = get(name).strip()
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        from accel_npu.errors import ConfigError

        raise ConfigError(f"accel-npu: {name}={raw!r} is not a whole number >= 1")
    return n


def seconds(name: str, env=None, *, at_least: float | None = None, note: str = "") -> float:
    """A variable that must be a number of seconds (``at_least``: and finite, not below it), else
    one ConfigError naming it (``note``: what the variable's special values mean)."""
    raw = get(name, env)
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or (at_least is not None and not at_least <= value < float("inf")):
        from accel_npu.errors import ConfigError

        bound = f" >= {at_least:g}" if at_least is not None else ""
        raise ConfigError(f"accel-npu: {name}={raw!r} is not a number of seconds{bound}{note}") from None
    return value


def disabled() -> bool:
    return flag("ACCEL_NPU_DISABLE")


#: Names the built-in plugins had before their names became their module paths (``devices.npu``):
#: ACCEL_NPU_DISABLED_PLUGINS still accepts them (docs/environment.md lists them).
PLUGIN_ALIASES = {
    "npu": "devices.npu",
    "cuda": "devices.cuda",
    "cpu": "devices.cpu",
    "launcher": "launch.launcher",
    "launch_settings": "launch.settings",
    "deepspeed_setup": "deepspeed",
}


def disabled_plugins() -> set[str]:
    """The plugin names ACCEL_NPU_DISABLED_PLUGINS blocks, or "*". An old built-in name blocks the plugin it now
    names and, as before, any plugin registered under the old name itself (an entry point may use it)."""
    raw = get("ACCEL_NPU_DISABLED_PLUGINS")
    names = {p.strip() for p in raw.split(",") if p.strip()}
    return names | {PLUGIN_ALIASES[name] for name in names if name in PLUGIN_ALIASES}


def disabled_patches() -> set[str]:
    raw = get("ACCEL_NPU_DISABLED_PATCHES")
    return {p.strip() for p in raw.split(",") if p.strip()}


def forced_backend(env=None) -> str | None:
    """The backend ACCEL_NPU_BACKEND forces ("npu", "cuda", "cpu"), or None to detect one."""
    return get("ACCEL_NPU_BACKEND", env).strip().lower() or None


_AUTO_MODES = {"auto": "auto", "": "auto", **{v: "on" for v in _YES}, **{v: "off" for v in _NO}}


def _auto_switch(name: str, env=None) -> str:
    """A variable that is auto (launched ranks only), 1 or 0, as "auto", "on" or "off"; any other value is one
    ConfigError naming it."""
    raw = get(name, env)
    mode = _AUTO_MODES.get(raw.strip().lower())
    if mode is None:
        from accel_npu.errors import ConfigError

        raise ConfigError(f"accel-npu: {name}={raw!r} is not one of auto, 1, 0")
    return mode


def cuda_facade(env=None) -> str:
    """ACCEL_NPU_CUDA_FACADE as "auto", "on" or "off"."""
    return _auto_switch("ACCEL_NPU_CUDA_FACADE", env)


def async_checkpoint(env=None) -> str:
    """ACCEL_NPU_ASYNC_CHECKPOINT as "auto", "on" or "off"."""
    return _auto_switch("ACCEL_NPU_ASYNC_CHECKPOINT", env)


def opt_into_cuda_facade(env: dict) -> None:
    """Set ACCEL_NPU_CUDA_FACADE=1 in ``env`` (a child's environment) unless it says otherwise: for a
    process that stands in for a launched rank without being one."""
    env.setdefault("ACCEL_NPU_CUDA_FACADE", "1")


def hang_timeout(env=None) -> float | None:
    """ACCEL_NPU_HANG_TIMEOUT in seconds: None when unset (derive it from the process-group
    timeout), 0 when off; anything but a number >= 0 is one ConfigError naming it."""
    if not get("ACCEL_NPU_HANG_TIMEOUT", env).strip():
        return None
    return seconds(
        "ACCEL_NPU_HANG_TIMEOUT",
        env,
        at_least=0,
        note=" (0 turns hang diagnosis off; unset: just under the process-group timeout)",
    )
