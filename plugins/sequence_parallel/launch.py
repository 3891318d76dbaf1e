"""``accelerate launch --use_parallelism_config`` beside a DeepSpeed config.

accelerate 1.16's ``_validate_launch_command`` (commands/launch.py) refuses ``--use_parallelism_config``
unless ``--use_fsdp --fsdp_version 2`` are on the command line ("You cannot use `--use_parallelism_config`
without `--use_fsdp` and `--fsdp_version=2`"), before it reads the config file, while a config file's own
``parallelism_config:`` section passes under DeepSpeed (the same function sets ``use_parallelism_config`` from
it after the check), and its DeepSpeed path does run sequence parallelism (``sp_backend="deepspeed"``). Here the
check runs on the launch as resolved with its config file: DeepSpeed or FSDP2 pass (a diffusers model's sequence
is split under both: prepare.py, fsdp2.py), anything else keeps accelerate's refusal; a sequence-parallel size that
does not divide the processes is refused before any worker starts.
"""

from __future__ import annotations

STOCK_REFUSAL = "You cannot use `--use_parallelism_config` without `--use_fsdp` and `--fsdp_version=2`. "


def launch_problem(launch_args) -> str | None:
    """What makes this resolved launch's parallelism config impossible, with the fix; None when fine."""
    if not getattr(launch_args, "use_parallelism_config", False):
        return None
    sp = int(getattr(launch_args, "parallelism_config_sp_size", 1) or 1)
    fsdp2 = bool(getattr(launch_args, "use_fsdp", False)) and str(getattr(launch_args, "fsdp_version", "1")) == "2"
    if not (getattr(launch_args, "use_deepspeed", False) or fsdp2):
        return STOCK_REFUSAL + "(accel-npu: or a DeepSpeed config, for sequence parallelism.)"
    processes = getattr(launch_args, "num_processes", None)
    if sp > 1 and processes and int(processes) % sp:
        return (
            f"accel-npu: parallelism_config_sp_size {sp} does not divide the {processes} processes: every "
            f"sequence-parallel group needs {sp} ranks. Launch a multiple of {sp} processes (--num_processes) or "
            f"choose an sp_size that divides {processes}."
        )
    return None


#: on the parsed arguments: the command line asked for the parallelism config, held back from accelerate's check
_ASKED = "_accel_npu_use_parallelism_config"


def launch_args(launch_args, resolved: bool) -> None:
    """accelerate's own check sees the flag before the config file; ours sees the launch it resolves to."""
    if not resolved:
        if getattr(launch_args, "use_parallelism_config", False):
            setattr(launch_args, _ASKED, True)
            launch_args.use_parallelism_config = False
        return
    if getattr(launch_args, _ASKED, False):
        launch_args.use_parallelism_config = True
    problem = launch_problem(launch_args)
    if problem:
        raise SystemExit(f"ValueError: {problem}")
