"""torchvision beside a torch build its wheel was not made for.

PyPI's x86-64 torchvision wheels are CUDA builds: beside torch's CPU build (the one torch_npu
runs on, and the one CPU debugging uses) their C++ library cannot load (``libc10_cuda.so``
missing). torchvision means to carry on without it — ``extension._has_ops()`` turns False and
``torchvision.ops`` raise "Couldn't load custom C++ ops" when called — but
``torchvision/_meta_registrations.py`` registers the fake impls of ``torchvision::nms`` and
``qnms`` unguarded, so ``import torchvision`` itself dies with "operator torchvision::nms does
not exist" (pytorch/vision#9085; the guard, pytorch/vision#9086, was closed unmerged). Every
script that only wants ``torchvision.transforms`` is stopped, and so is ``import transformers``'s
model code, which imports torchvision whenever it is installed.

Here, while torchvision's operators are missing, their fake-impl registration is skipped (there
is no operator to attach it to) and one warning names the mismatch and the wheel to install;
calling an operator still raises torchvision's own "Couldn't load custom C++ ops" error. With a
matching torchvision the registrations pass straight through.

This module declares the patch; ``fake_impls.py`` holds the wrapper of ``register_fake``, ``mismatch.py``
the diagnosis (what torchvision was built for, the wheel that pairs).
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

# fake_impls.py is imported when torch.library is (inside `import torch`), and imports mismatch.py on
# torchvision's first register_fake.
FAKE_IMPL_OF_MISSING_OPS = Patch(
    target="torch.library:register_fake",
    supports="torch>=2.5.1,<2.16",
    reason="A torchvision wheel built for another torch dies on import: 'operator torchvision::nms does "
    "not exist' (pytorch/vision#9085); its fake impls are skipped.",
    remove_when="torchvision/_meta_registrations.py guards register_fake with extension._has_ops()",
    wrapper=".fake_impls:skip_fake_impl_of_missing_torchvision_op",
)


@hookimpl
def accel_npu_register_patches():
    return [FAKE_IMPL_OF_MISSING_OPS]
