"""Loaded at startup of every worker a launcher starts (the launcher puts this directory on PYTHONPATH).

Why: a script that imports torch_npu before torch runs with TORCH_DEVICE_BACKEND_AUTOLOAD=0
(torch_npu sets it while importing itself), so torch's entry points — ours included — never
run there. This file registers a post-import hook on ``torch`` instead, which works whatever
the autoload setting. It imports nothing heavy, then chains to any other sitecustomize.
"""

import os
import sys


def _chain_to_next_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    this = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001 - someone else's sitecustomize; report, don't die
        sys.stderr.write(f"accel-npu: chained sitecustomize failed: {exc!r}\n")
    finally:
        sys.path[:] = saved
        if this is not None:
            sys.modules["sitecustomize"] = this


def _arm():
    # The one allowed copy of accel_npu.environment.disabled(): importing accel_npu here would run
    # in every worker before anything else, for nothing when accel-npu is switched off.
    if os.environ.get("ACCEL_NPU_DISABLE", "0").strip().lower() in {"1", "true", "yes", "on"}:
        return
    try:
        import wrapt

        def _on_torch(_module):
            from accel_npu.activation.autoload import activate_from_torch

            activate_from_torch()

        wrapt.register_post_import_hook(_on_torch, "torch")
    except Exception as exc:  # noqa: BLE001 - a bootstrap must never stop the interpreter starting
        sys.stderr.write(f"accel-npu: bootstrap skipped: {exc!r}\n")


_chain_to_next_sitecustomize()
_arm()
