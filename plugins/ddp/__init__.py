"""DDP on models with structurally unused parameters, and CUDA device ids on the cpu backend.

A DiT whose last block still has a text stream (``QwenImageTransformer2DModel``: the last
block's ``txt_mod``/``txt_mlp``/... feed an encoder stream nothing reads) leaves those parameters
without a gradient in every step. Stock DDP (``find_unused_parameters=False``, its default and
accelerate's) then waits for them forever and step 2 dies with "Expected to have finished
reduction in the prior iteration before starting a new one"; ``find_unused_parameters=True``
trains but searches the autograd graph in every step.

Here, before a DDP module's first training forward, a meta-device probe (``unused.py``) asks
which trainable parameters the forward leaves out of the graph. Only when some are — on any
rank — DDP is told its graph is static (``_set_static_graph``, what ``static_graph=True`` calls):
it records the unused parameters in the first iteration and marks them ready itself from then
on, with no per-step search, and their gradients stay None as on one process. One line says
which and why. A DDP built with ``find_unused_parameters`` or ``static_graph`` given explicitly
is left as the script asked; so is a probe that cannot run on meta.

This module declares the patch; ``construction.py`` holds the wrapper of DDP's ``__init__``.
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

# construction.py is imported when torch.nn.parallel.distributed is, and imports the probe (unused.py) on the
# first training forward.
DDP_UNUSED_PARAMETERS = Patch(
    target="torch.nn.parallel.distributed:DistributedDataParallel.__init__",
    supports="torch>=2.5.1,<2.16",
    # Also: DDP(model, device_ids=[rank]) of a CPU module on the cpu backend raises; the ids are dropped.
    reason="DDP with parameters no forward uses dies at step 2 ('Expected to have finished reduction'); "
    "a meta-device probe finds them and sets static_graph.",
    remove_when="DDP detects parameters that never get a gradient itself, or accelerate sets static_graph",
    wrapper=".construction:ddp_init",
)


@hookimpl
def accel_npu_register_patches():
    return [DDP_UNUSED_PARAMETERS]
