"""``accel-npu config``: write an accelerate config (+ DeepSpeed JSON + launch settings) that the
unchanged ``accelerate launch`` runs the first time. Interactive like ``accelerate config``, or
``--non-interactive`` with a flag per question. See docs/config.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: flag dest -> Settings field (flags given on the command line are not asked again).
_FIELDS = {
    "backend": "backend",
    "num_machines": "num_machines",
    "machine_rank": "machine_rank",
    "main_process_ip": "main_process_ip",
    "main_process_port": "main_process_port",
    "num_processes": "processes_per_machine",
    "strategy": "strategy",
    "offload": "offload",
    "zero3_init": "zero3_init",
    "mixed_precision": "mixed_precision",
    "micro_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "frozen_modules": "frozen_modules",
    "load_slots": "load_slots",
    "truncate": "truncate",
    "async_checkpoint": "async_checkpoint",
    "sp_size": "sp_size",
    "hccl_socket_ifname": "hccl_socket_ifname",
}
_NPU_FLAGS = {
    "task_queue_enable": "TASK_QUEUE_ENABLE",
    "npu_alloc_conf": "PYTORCH_NPU_ALLOC_CONF",
    "cpu_affinity_conf": "CPU_AFFINITY_CONF",
    "hccl_connect_timeout": "HCCL_CONNECT_TIMEOUT",
    "hccl_exec_timeout": "HCCL_EXEC_TIMEOUT",
}


def _base_settings(args, machine):
    from accel_npu.cli.config import settings as wizard

    if args.from_template:
        path = wizard.resolve_template(args.from_template, args.backend or machine.backend)
        base = wizard.settings_from_files(path, machine)
        if args.backend and args.backend != base.backend:
            d = wizard.default_settings(machine, args.backend)
            base.backend, base.npu_env = args.backend, d.npu_env
            base.processes_per_machine = d.processes_per_machine
            if base.mixed_precision not in wizard.precision_choices(args.backend, machine):
                base.mixed_precision = d.mixed_precision
        return base, path
    return wizard.default_settings(machine, args.backend), None


def _apply_flags(args, s) -> set[str]:
    given: set[str] = set()
    for dest, name in _FIELDS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if name in ("frozen_modules", "load_slots", "truncate", "hccl_socket_ifname") and str(value).lower() in (
            "auto",
            "none",
        ):
            value = ""
        setattr(s, name, value)
        given.add(name)
    npu = {env: getattr(args, dest) for dest, env in _NPU_FLAGS.items() if getattr(args, dest, None) is not None}
    if npu:
        s.npu_env.update({k: str(v) for k, v in npu.items()})
        if len(npu) == len(_NPU_FLAGS) or args.non_interactive:
            given.add("npu_env")
    if s.strategy == "ddp" and "offload" not in given:
        s.offload = "none"
    return given


def run(args) -> int:
    from accel_npu.cli.config import settings as wizard
    from accel_npu.cli.config.prompts import Aborted, Prompter, interview
    from accel_npu.errors import ConfigError

    out = sys.stdout
    target = Path(args.config_file).expanduser() if args.config_file else wizard.default_config_file()
    is_default = not args.config_file
    if target.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigError(
            f"--config_file {target}: accel-npu writes an accelerate YAML; use a name ending in "
            f".yaml (the DeepSpeed JSON and the launch settings are written beside it). "
            f"Nothing was written."
        )
    machine = wizard.detect_machine()
    base, template = _base_settings(args, machine)
    given = _apply_flags(args, base)
    interactive = not args.non_interactive
    prompter = Prompter(out)
    if interactive:
        prompter.say(
            "accel-npu config: an accelerate config that `accelerate launch` runs as is, "
            "a DeepSpeed JSON beside it for ZeRO,"
        )
        prompter.say("and the launch settings accel-npu applies to the training processes.")
        if template:
            prompter.say(f"Starting from {template}.")
        try:
            settings = interview(prompter, machine, base, given)
        except Aborted as exc:
            prompter.say(f"\nAborted ({exc}): nothing was written.")
            return 130
    else:
        settings = base
        tuning = wizard.worker_tuning(settings.backend)
        if (
            tuning is not None
            and tuning.interface
            and settings.num_machines > 1
            and not settings.hccl_socket_ifname
            and "hccl_socket_ifname" not in given
        ):
            settings.hccl_socket_ifname = tuning.suggest_interface(settings.main_process_ip)
    wizard.validate(settings, machine)

    files = wizard.render(settings, target, relative_paths=args.relative_paths)
    changed = [p for p, text in files.items() if p.exists() and p.read_text() != text]

    if interactive:
        prompter.say()
    prompter.say(f"Configuration: {wizard.title_of(settings)}.")
    if args.dry_run:
        for path, text in files.items():
            state = " (replaces the existing file; a backup would be kept)" if path in changed else ""
            prompter.say(f"\n--- {path}{state}")
            out.write(text)
        prompter.say("\nDry run: nothing was written.")
        return 0

    if changed and not args.yes:
        listing = "\n".join(f"  {p}" for p in changed)
        if not interactive:
            raise ConfigError(
                f"these files exist and differ from the new config:\n{listing}\n"
                f"Pass --yes to replace them (each is first copied to <file>.bak), or choose another "
                f"--config_file. Nothing was written."
            )
        prompter.say(f"These files exist:\n{listing}")
        try:
            ok = prompter.confirm("Replace them (each is first copied to <file>.bak)?", False)
        except Aborted:
            ok = False
        if not ok:
            prompter.say("Nothing was written.")
            return 1

    for path, backup in wizard.write_files(files):
        prompter.say(f"Wrote {path}" + (f"  (previous version kept as {backup.name})" if backup else ""))
    launch = "accelerate launch train.py" if is_default else f"accelerate launch --config_file {target} train.py"
    if is_default:
        prompter.say("This is accelerate's default config file: a plain `accelerate launch` uses it.")
    prompter.say(f"Launch with: {launch}")
    if settings.num_machines > 1:
        prompter.say(
            f"On the other machines: the same files, with --machine_rank N (N = 1..{settings.num_machines - 1})."
        )
    return 0


def add_parser(subparsers) -> None:
    from accel_npu.cli.config import settings as wizard

    p = subparsers.add_parser(
        "config",
        help="write an accelerate + DeepSpeed config (interactive wizard, or --non-interactive)",
        description="Write an accelerate YAML, a DeepSpeed JSON beside it (ZeRO only) and the launch "
        "settings accel-npu applies to training processes. Without --non-interactive, asks "
        "each question not given as a flag (Enter accepts the default shown).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("where and how")
    g.add_argument(
        "--config_file",
        "--config-file",
        dest="config_file",
        metavar="PATH",
        help="accelerate YAML to write (default: accelerate's default config file, "
        "which a plain `accelerate launch` reads)",
    )
    g.add_argument(
        "--from",
        dest="from_template",
        metavar="NAME",
        help="start from a launch_configs/ template (e.g. zero3, npu_zero2, cpu_zero3, "
        "multinode) or an existing accelerate YAML",
    )
    g.add_argument("--non-interactive", action="store_true", help="ask nothing: flags and defaults only")
    g.add_argument("--yes", "-y", action="store_true", help="replace existing files without asking (backups kept)")
    g.add_argument("--dry-run", action="store_true", help="print what would be written; write nothing")
    g.add_argument(
        "--relative-paths",
        action="store_true",
        help="write deepspeed_config_file relative to the YAML (accel-npu resolves it at launch)",
    )
    q = p.add_argument_group("answers (each replaces one question)")
    q.add_argument("--backend", choices=wizard.BACKENDS, help="device backend (default: detected)")
    q.add_argument("--num-machines", type=int, help="machines training together (default 1)")
    q.add_argument("--machine-rank", type=int, help="rank of this machine (multi-node)")
    q.add_argument("--main-process-ip", help="address of machine rank 0 (multi-node)")
    q.add_argument("--main-process-port", type=int, help="port on machine rank 0 (default 29500)")
    q.add_argument(
        "--num-processes",
        type=int,
        help="processes on EACH machine, one per device (the YAML's num_processes is the total)",
    )
    q.add_argument("--strategy", choices=wizard.STRATEGIES, help="ddp, zero2 (default) or zero3")
    q.add_argument("--offload", choices=wizard.OFFLOADS, help="ZeRO CPU offload: none, optimizer, all (ZeRO-3)")
    q.add_argument(
        "--zero3-init",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ZeRO-3: build models under deepspeed.zero.Init (default on)",
    )
    q.add_argument("--mixed-precision", choices=wizard.PRECISIONS, help="bf16 (default), fp16 or no")
    q.add_argument("--micro-batch-size", help="train_micro_batch_size_per_gpu (default auto)")
    q.add_argument("--gradient-accumulation-steps", help="gradient accumulation steps (default auto)")
    q.add_argument("--task-queue-enable", help="NPU: TASK_QUEUE_ENABLE (default 2)")
    q.add_argument("--npu-alloc-conf", help="NPU: PYTORCH_NPU_ALLOC_CONF (default expandable_segments:True)")
    q.add_argument("--cpu-affinity-conf", help="NPU: CPU_AFFINITY_CONF (default 1)")
    q.add_argument("--hccl-connect-timeout", help="NPU: HCCL_CONNECT_TIMEOUT seconds (default 1200)")
    q.add_argument("--hccl-exec-timeout", help="NPU: HCCL_EXEC_TIMEOUT seconds (default 1800)")
    q.add_argument(
        "--hccl-socket-ifname",
        help="NPU, more than one machine: HCCL_SOCKET_IFNAME, the host interface(s) HCCL reaches the other "
        "machines by: name prefixes (eth,enp), =exact names, ^excluded (default: the letters of this "
        "machine's interface towards the main machine; none: HCCL picks)",
    )
    q.add_argument(
        "--frozen-modules", help="ACCEL_NPU_FROZEN_MODULES: child names kept out of DeepSpeed (default auto)"
    )
    q.add_argument("--load-slots", help="ACCEL_NPU_LOAD_SLOTS: ranks per machine loading at once (default auto)")
    q.add_argument("--truncate", help="ACCEL_NPU_TRUNCATE: Class:layers pairs (default none)")
    q.add_argument(
        "--async-checkpoint",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ZeRO: save_state writes its files in the background (default on; --no-async-checkpoint writes "
        "ACCEL_NPU_ASYNC_CHECKPOINT=0)",
    )
    q.add_argument(
        "--sp-size",
        type=int,
        help="ZeRO-2/3, a video DiT: sequence-parallel size, ranks splitting one sample's tokens (Ulysses); written "
        "as accelerate's parallelism_config_sp_size (default 1: off)",
    )
    p.set_defaults(func=run)
