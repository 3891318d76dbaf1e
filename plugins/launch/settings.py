"""Launch settings written by `accel-npu config`, applied by `accelerate launch`.

Two things happen in the ``accelerate launch`` process, before any worker starts:

1. **Sidecar environment**: the accelerate config being launched may have a sidecar
   ``<stem>.accel-npu.yaml`` beside it (``env:`` mapping). Its variables are set for the training
   processes, except those already set in the launching shell (the user's values win). This is
   what replaces the exports of a shell launcher such as ``train_8p.sh`` (TASK_QUEUE_ENABLE, ...).
2. **deepspeed_config_file relative to the YAML**: stock accelerate hands a relative
   ``deepspeed_config_file`` to the workers as is, so they resolve it against their working
   directory: a config pair in ``launch_configs/`` (or in an installed package) works from one
   directory only. We resolve it against the YAML's directory when that file exists there
   (a path given with ``--deepspeed_config_file`` on the command line is left alone).
"""

from __future__ import annotations

import importlib.util
import logging
import os

from accel_npu import environment
from accel_npu.config_files import SIDECAR_SUFFIX, sidecar_for
from accel_npu.errors import ConfigError, LaunchError
from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch, argument

log = logging.getLogger("accel_npu")

__all__ = ["SIDECAR_SUFFIX", "sidecar_for", "read_sidecar", "apply_sidecar"]


def read_sidecar(path: str) -> dict:
    """The sidecar as a dict ({} when there is none). Raises ConfigError naming the file when broken."""
    if not os.path.isfile(path):
        return {}
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"accel-npu: cannot read the launch settings {path}: {exc}. Fix or delete the file "
            f"(re-run `accel-npu config` to write it again)."
        ) from exc
    env = data.get("env") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(env or {}, dict):
        raise ConfigError(
            f"accel-npu: {path} must be a mapping with an 'env:' mapping of VARIABLE: value; "
            f"got {type(data).__name__}. Re-run `accel-npu config` to write it again."
        )
    bad = [k for k in (env or {}) if not isinstance(k, str) or not k or "=" in k]
    if bad:
        raise ConfigError(f"accel-npu: {path}: {bad[0]!r} is not an environment variable name.")
    return data


def apply_sidecar(config_file: str, environ=None) -> tuple[dict[str, str], dict[str, str]]:
    """Set the sidecar's variables that ``environ`` lacks. Returns (applied, kept_from_user)."""
    environ = os.environ if environ is None else environ
    path = sidecar_for(config_file)
    data = read_sidecar(path)
    applied: dict[str, str] = {}
    kept: dict[str, str] = {}
    for key, value in (data.get("env") or {}).items():
        value = "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        if key in environ:
            kept[key] = environ[key]
        else:
            environ[key] = value
            applied[key] = value
    written_for = data.get("backend")
    if written_for:
        try:
            from accel_npu.backend import current_backend

            here = current_backend().name
        except Exception:  # noqa: BLE001 - a warning only
            here = written_for
        if (
            written_for == "npu"
            and here != "npu"
            and environment.forced_backend() != "cpu"
            and importlib.util.find_spec("torch_npu") is None
        ):
            # an npu config on a machine without torch_npu would train on the CPU without a word
            raise LaunchError(
                f"accel-npu: {config_file} was written for the npu backend, but torch_npu is not "
                "installed here: install the torch_npu release matching your torch (`accel-npu env` "
                "checks the pair), or set ACCEL_NPU_BACKEND=cpu to run this config on the CPU."
            )
        if here != written_for:
            log.warning(
                "accel-npu: %s was written for the %s backend; this machine uses %s.",
                os.path.basename(config_file),
                written_for,
                here,
            )
    if applied or kept:
        msg = f"accel-npu: launch settings from {path}"
        if applied:
            msg += ": " + ", ".join(f"{k}={v}" for k, v in applied.items())
        if kept:
            msg += "; kept from your environment: " + ", ".join(f"{k}={v}" for k, v in kept.items())
        # the launching terminal should show what reached the workers (logging is not set up there)
        import sys

        sys.stderr.write(msg + "\n")
    return applied, kept


def launched_config_file(launch_args) -> str | None:
    """The accelerate config ``accelerate launch`` reads for these arguments (as stock decides)."""
    if getattr(launch_args, "config_file", None) is not None:
        return launch_args.config_file
    import sys

    launch_module = sys.modules.get("accelerate.commands.launch")
    default = getattr(launch_module, "default_config_file", None)
    if default and os.path.isfile(default) and not getattr(launch_args, "cpu", False):
        return default
    return None


def resolve_deepspeed_config_file(config_file: str, launch_args) -> str | None:
    """Point ``launch_args`` at the YAML-relative DeepSpeed JSON when stock would look in the cwd."""
    if "deepspeed_config_file" in (getattr(launch_args, "nondefault", None) or ()):
        return None  # given on the command line: relative to the cwd, as the user typed it
    if not config_file.endswith((".yaml", ".yml", ".json")) or not os.path.isfile(config_file):
        return None
    import json

    import yaml

    try:
        with open(config_file, encoding="utf-8") as f:
            cfg = json.load(f) if config_file.endswith(".json") else yaml.safe_load(f)
    except Exception:  # noqa: BLE001 - accelerate reports a broken config itself
        return None
    ds = (cfg or {}).get("deepspeed_config") if isinstance(cfg, dict) else None
    value = ds.get("deepspeed_config_file") if isinstance(ds, dict) else None
    if not isinstance(value, str) or not value or os.path.isabs(value):
        return None
    candidate = os.path.join(os.path.dirname(os.path.abspath(config_file)), value)
    if not os.path.isfile(candidate):
        return None  # leave stock behaviour (cwd-relative) alone
    launch_args.deepspeed_config_file = candidate
    nondefault = getattr(launch_args, "nondefault", None)
    if isinstance(nondefault, set):
        nondefault.add("deepspeed_config_file")  # so the config's relative value does not replace it
    if os.path.abspath(value) != candidate:
        log.info(
            "accel-npu: deepspeed_config_file %s resolved next to %s: %s",
            value,
            os.path.basename(config_file),
            candidate,
        )
    return candidate


def _launch_command(wrapped, instance, args, kwargs):
    launch_args = argument(args, kwargs, 0, "args")
    config_file = launched_config_file(launch_args) if launch_args is not None else None
    if config_file:
        try:
            apply_sidecar(config_file)
        except LaunchError as exc:  # one clear error, not a traceback through accelerate's CLI
            raise SystemExit(f"{type(exc).__name__}: {exc}") from None
        resolve_deepspeed_config_file(config_file, launch_args)
    return wrapped(*args, **kwargs)


LAUNCH_COMMAND = Patch(
    target="accelerate.commands.launch:launch_command",
    supports="accelerate>=1.10.1,<1.17",
    # accelerate configs also cannot carry the workers' environment (TASK_QUEUE_ENABLE, ...):
    # `accel-npu config`'s sidecar is applied here.
    reason="A relative deepspeed_config_file resolves against each worker's cwd, so a shipped config "
    "works from one directory only; also applies the sidecar.",
    remove_when="accelerate resolves config-relative paths (the sidecar part stays: accel-npu's own)",
    wrapper=".settings:_launch_command",
)


@hookimpl
def accel_npu_register_patches():
    return [LAUNCH_COMMAND]
