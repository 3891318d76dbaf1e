"""Scripts and traces one function per sample (JSON: name -> function body using tensors ``a``, ``b``),
runs each compiled function, and prints one RESULT line: per sample whether torch.jit.script and
torch.jit.trace compiled it (or the exception type), the compiled code and the result.

Usage: torchscript_probe.py SAMPLES_JSON WORKDIR [--break-torchscript-sync]
The last flag is the negative test's mutant: the ledger no longer gives wrappers their original's
TorchScript entry (accel_npu/patching/torchscript.py), so scripted calls of wrapped functions fail.
"""

import importlib
import json
import re
import sys
import warnings

samples_path, workdir = sys.argv[1], sys.argv[2]
if "--break-torchscript-sync" in sys.argv:
    from accel_npu.patching import torchscript  # the standard library only: nothing activates here

    torchscript.wrapper_installed = lambda original, installed: None

import torch  # noqa: E402  (a launched rank activates accel-npu here)
import torch.distributed  # noqa: E402 - after the probe replaced the hook it watches
import torch.distributed.launcher.api  # noqa: E402 - after the probe replaced the hook it watches
import torch.nn.parallel  # noqa: E402 - after the probe replaced the hook it watches

warnings.simplefilter("ignore")
samples = json.load(open(samples_path))
names = sorted(samples)
source = ["import torch", "import torch.nn.functional as F", ""]
for i, name in enumerate(names):
    source += [
        f"def f{i}(a: torch.Tensor, b: torch.Tensor):",
        *("    " + line for line in samples[name].splitlines()),
        "",
    ]
sys.path.insert(0, workdir)
with open(f"{workdir}/probe_functions.py", "w") as f:
    f.write("\n".join(source))
module = importlib.import_module("probe_functions")


def outcome(compile_fn, traced=None):
    torch.manual_seed(0)
    a, b = torch.randn(3), torch.randn(3)
    try:
        compiled = compile_fn(a, b)
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return {"compiled": type(exc).__name__}
    # scripted: the code TorchScript compiled; traced: the recorded ops (value names follow Python's frames)
    out = {
        "compiled": "ok",
        "code": compiled.code if traced is None else None,
        "ops": [node.kind() for node in compiled.graph.nodes()] if traced else None,
    }
    torch.manual_seed(1)
    try:
        value = compiled(a, b)
        # a repr without its address: torch 2.9.1 compiles a scripted torch.cuda.Event(...) and returns a
        # ScriptObject even without CUDA (2.13 refuses to compile it), whose repr says where it lies in memory
        out["result"] = (
            value.tolist() if isinstance(value, torch.Tensor) else re.sub(r" at 0x[0-9a-f]+", "", repr(value))
        )
    except Exception as exc:  # noqa: BLE001 - the outcome is the exception's name
        out["result"] = type(exc).__name__
    return out


report = {"wrapped": type(torch.stack).__name__}
for i, name in enumerate(names):
    fn = getattr(module, f"f{i}")
    report[name] = {
        "script": outcome(lambda a, b: torch.jit.script(fn)),  # noqa: B023 - called within this iteration
        "trace": outcome(lambda a, b: torch.jit.trace(fn, (a, b), check_trace=False), traced=True),  # noqa: B023 - called within this iteration
    }
print("RESULT " + json.dumps(report))
