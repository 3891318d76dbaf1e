"""The ``accel-npu`` command. Built-in subcommands are modules listed in BUILTIN_COMMANDS;
plugins add more through the ``accel_npu_add_commands`` hook (``consolidate`` comes from the
checkpoints plugin)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

#: Modules with ``add_parser(subparsers)``; each parser sets ``func(args) -> int``.
BUILTIN_COMMANDS = (
    "accel_npu.cli.env",
    "accel_npu.cli.config",
)


def build_parser() -> argparse.ArgumentParser:
    from accel_npu._version import __version__
    from accel_npu.manager import get_plugin_manager

    parser = argparse.ArgumentParser(prog="accel-npu", description="Unchanged CUDA training on Ascend NPU and CPU.")
    parser.add_argument("--version", action="version", version=f"accel-npu {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in BUILTIN_COMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    get_plugin_manager().hook.accel_npu_add_commands(subparsers=subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from accel_npu import activation

    # Before any command imports torch: torch's backend autoload calls the torch.backends entry
    # points in the order the files happen to be found, and torch_npu's may run (and fail) before
    # ours. Active first, accel-npu's import diagnosis is what a failing torch_npu raises.
    activation.activate(strict=False)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from accel_npu.errors import AccelNpuError

    try:
        return int(args.func(args) or 0)
    except AccelNpuError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        # torch's _import_device_backends wraps an entry point's failure in "Failed to load the backend
        # extension"; when accel-npu explained the cause (CANN not sourced, a torch/torch_npu mismatch), say that
        if isinstance(exc.__cause__, AccelNpuError):
            print(f"error: {exc.__cause__}\n({exc})", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
