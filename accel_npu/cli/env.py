"""``accel-npu env``: everything a bug report needs, as text or --json."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import os
import platform
import sys


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect(import_targets: bool = True) -> dict:
    from accel_npu import activation, environment
    from accel_npu._version import __version__
    from accel_npu.activation import triggers
    from accel_npu.backend import current_backend
    from accel_npu.manager import get_plugin_manager
    from accel_npu.patching import get_ledger

    # In training processes (launched ranks, an Ascend machine) the entry point activates inside
    # `import torch`; elsewhere it waits for a trigger import. Say which, before activating here.
    at_import_torch = triggers.activate_now()
    import torch  # noqa: F401  (activates through the entry point unless disabled)

    disabled = environment.disabled()
    if not disabled:
        activation.activate(strict=False)
    pm = get_plugin_manager()
    ledger = get_ledger()
    if import_targets and not disabled:
        for patch in ledger.patches:
            try:
                importlib.import_module(patch.module)
            except Exception as exc:  # noqa: BLE001 - the report records it instead
                patch.status = f"failed: cannot import {patch.module}: {type(exc).__name__}: {exc}"
    backend = current_backend()
    report: dict = {
        "versions": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "accel-npu": __version__,
            **{
                d: _version(d)
                for d in (
                    "torch",
                    "torch_npu",
                    "accelerate",
                    "deepspeed",
                    "diffusers",
                    "transformers",
                    "pluggy",
                    "wrapt",
                    "safetensors",
                )
            },
        },
        "activation": {
            "disabled (ACCEL_NPU_DISABLE)": disabled,
            "active in this process": activation.is_active(),
            "`python script.py` here activates": "inside `import torch`"
            if at_import_torch
            else "at its first import of "
            + ", ".join(sorted(triggers.TRIGGER_MODULES))
            + " (launched ranks: inside `import torch`; docs/activation.md)",
            "TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "<unset> (on)"),
            "CUDA façade here": _cuda_facade_here(),
        },
        "backend": {
            "name": backend.name,
            "selected by": backend.plugin,
            "device type": backend.device_type,
            "dist backend": backend.dist_backend,
            "devices": backend.device_count,
        },
        "installation": _installation(),
        "plugins": [
            {
                "name": r.name,
                "source": r.source,
                "module": r.module,
                "version": r.version,
                "status": r.status
                if r.name not in activation.registration_errors
                else f"failed: {activation.registration_errors[r.name]}",
                "imported from": _unexpected_origin(r),
            }
            for r in pm.records
        ],
        "patches": ledger.report(),
        "environment": {
            v.name: os.environ.get(v.name, f"<unset> ({v.default or 'empty'})") for v in environment.VARIABLES
        },
        "sections": {},
    }
    for section in pm.hook.accel_npu_env_report(backend=backend):
        if section:
            title, values = section
            report["sections"][title] = values
    return report


def _cuda_facade_here() -> str:
    """Whether the CUDA façade family applies in this process, and where it does (accel_npu/scopes.py)."""
    from accel_npu.scopes import cuda_facade_off

    try:
        off = cuda_facade_off()
    except Exception as exc:  # noqa: BLE001 - an unreadable ACCEL_NPU_CUDA_FACADE: say so, as activation did
        return f"off: {exc}"
    return ("on" if off is None else f"off ({off})") + "; launched ranks: on unless ACCEL_NPU_CUDA_FACADE=0"


def _installation() -> dict:
    from accel_npu import install

    return {
        "imported from": install.imported_package_dir(),
        "installed distribution": install.installed_package_dir() or "none (not installed)",
        "shadowed": install.shadowing_note() or "no",
        "startup hook": install.startup_hook_state(),
    }


def _unexpected_origin(record) -> str | None:
    """A built-in plugin's file when it is not from the installed distribution, else None."""
    from accel_npu import install

    if not record.source.startswith("builtin") or not record.origin:
        return None
    installed = install.installed_package_dir()
    expected = install.builtin_plugins_dir(installed) if installed else None
    origin = os.path.realpath(record.origin)
    if expected and origin.startswith(os.path.realpath(expected) + os.sep):
        return None
    return record.origin


def render(report: dict) -> str:
    lines = ["accel-npu environment (paste this into bug reports)", ""]

    def block(title, mapping):
        lines.append(f"## {title}")
        width = max((len(str(k)) for k in mapping), default=0)
        for key, value in mapping.items():
            lines.append(f"  {str(key).ljust(width)}  {value}")
        lines.append("")

    block("Versions", report["versions"])
    block("Activation", report["activation"])
    block("Backend", report["backend"])
    block("Installation", report["installation"])
    lines.append("## Plugins")
    for p in report["plugins"]:
        lines.append(f"  {p['name']:<14} {p['status']:<10} {p['source']} {p['module']} {p['version']}")
        if p.get("imported from"):
            lines.append(f"      imported from {p['imported from']} (not the installed distribution)")
    lines.append("")
    lines.append("## Patches")
    for p in report["patches"]:
        stock = f"; stock correct: {p['stock_correct']}" if p.get("stock_correct") else ""
        lines.append(f"  [{p['status']}] {p['target']}  (plugin {p['plugin']}; supports {p['supports']}{stock})")
        lines.append(f"      why: {p['reason']}")
        lines.append(f"      remove when: {p['remove_when']}")
    lines.append("")
    for title, values in report["sections"].items():
        block(title, values)
    block("Environment variables read by accel-npu", report["environment"])
    return "\n".join(lines)


PATCH_TABLE_INTRO = """# Patches

Every patch the built-in plugins declare, as the ledger holds them: the function wrapped (in its
defining module), the plugin, the library versions it supports (outside them it is skipped with the
reason, never applied blind; "stock correct" names the versions that do not have the defect, where
it is "not needed"), why it exists and when it can go. `accel-npu env` shows the same list
with each patch's status on the machine at hand (applied, skipped and why, disabled).

Generated by `accel-npu env --patch-table > docs/patches.md`; tests/test_docs_layout.py fails when it
is out of date.
"""


def patch_table() -> str:
    """docs/patches.md: the declared patches of the built-in plugins, as a markdown table."""
    from accel_npu.manager import get_plugin_manager

    pm = get_plugin_manager()
    order = {r.name: i for i, r in enumerate(pm.records) if r.source.startswith("builtin")}

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    rows = ["| target | plugin | supports | why | remove when |", "|---|---|---|---|---|"]
    impls = [i for i in pm.hook.accel_npu_register_patches.get_hookimpls() if i.plugin_name in order]
    for impl in sorted(impls, key=lambda i: order[i.plugin_name]):
        for patch in impl.function() or ():
            supports = f"`{patch.supports}`" + (
                f" (stock correct: `{patch.stock_correct}`)" if patch.stock_correct else ""
            )
            rows.append(
                f"| `{patch.target}` | {impl.plugin_name} | {supports} | {cell(patch.reason)} | "
                f"{cell(patch.remove_when)} |"
            )
    return PATCH_TABLE_INTRO + "\n" + "\n".join(rows) + "\n"


def run(args) -> int:
    if args.patch_table:
        sys.stdout.write(patch_table())
        return 0
    if args.selftest:
        from accel_npu.cli.selftest import run_selftest

        return run_selftest(timeout=args.timeout)
    # Libraries print to stdout while importing (DeepSpeed's accelerator banner); keep
    # stdout for the report alone so --json output parses.
    with contextlib.redirect_stdout(sys.stderr):
        report = collect(import_targets=not args.no_import)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report))
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("env", help="print versions, backend, plugins, patches (for bug reports)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--no-import",
        action="store_true",
        help="do not import patch targets (patches of unimported modules show 'not imported')",
    )
    p.add_argument(
        "--selftest",
        action="store_true",
        help="run the first-run checks on this machine (device, precision, a 2-rank launch, "
        "ZeRO-2), one line each; exit status 1 if any fails",
    )
    p.add_argument(
        "--patch-table",
        action="store_true",
        help="print every declared patch as a markdown table (docs/patches.md), without applying any",
    )
    p.add_argument("--timeout", type=float, default=110.0, help="--selftest: seconds the checks may take (default 110)")
    p.set_defaults(func=run)
