"""What torchvision was built for, against the torch it sits beside, and the wheel that pairs.

Read only once torchvision's C++ library has failed to load (``torchvision.extension._has_ops()``
is False), i.e. on the path that used to end in "operator torchvision::nms does not exist".
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import sys
import threading

log = logging.getLogger("accel_npu")

# PyTorch's own index of CPU-only wheels: the torchvision built against torch's CPU build
# (the one torch_npu runs on). PyPI's x86-64 torchvision wheels link CUDA (libc10_cuda.so).
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

_lock = threading.Lock()
_warned = False


def ops_missing() -> bool:
    """True when torchvision is importing (or imported) and its C++ operator library did not load."""
    extension = sys.modules.get("torchvision.extension")
    has_ops = getattr(extension, "_has_ops", None)
    if not callable(has_ops):
        return False
    try:
        return not has_ops()
    except Exception:  # noqa: BLE001 - not a state we know
        return False


def _torch_it_was_built_for() -> str | None:
    """The torch release torchvision's wheel pins (its METADATA ``Requires-Dist: torch==X``)."""
    try:
        requires = importlib.metadata.requires("torchvision") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        match = re.match(r"\s*torch\s*\(?\s*==\s*([0-9][0-9A-Za-z.+]*)", line)
        if match and "extra" not in line:
            return match.group(1)
    return None


def _torchvision_version() -> str:
    # torchvision.version.__version__ carries the build label ("0.28.0+cu130"); the dist metadata does not.
    try:
        from torchvision.version import __version__

        return str(__version__)
    except Exception:  # noqa: BLE001 - a broken torchvision: the next way to read its version
        try:
            return importlib.metadata.version("torchvision")
        except importlib.metadata.PackageNotFoundError:
            return "?"


def _load_error() -> str:
    """Why torchvision/_C did not load (torchvision swallows the OSError; the loader says it again)."""
    try:
        import ctypes

        from torchvision._internally_replaced_utils import _get_extension_path

        ctypes.CDLL(_get_extension_path("_C"))
    except OSError as exc:
        return str(exc).strip().splitlines()[0]
    except Exception as exc:  # noqa: BLE001 - any failure to load the extension is the diagnosis
        return f"{type(exc).__name__}: {exc}"
    return "the library loads on its own, but torch.ops.load_library refused it"


def paired_torchvision(torch_version: str) -> str:
    """torchvision's release for a torch release: 0.(minor+15) since torch 2.0 / torchvision 0.15."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", torch_version)
    if not match or match.group(1) != "2":
        return "the torchvision release listed for it in torchvision's compatibility table"
    return f"0.{int(match.group(2)) + 15}.{match.group(3)}"


def describe() -> str:
    """One line: what is mismatched, what still works, and the wheel to install."""
    import torch

    tv = _torchvision_version()
    torch_version = str(torch.__version__)
    built_for = _torch_it_was_built_for()
    public = torch_version.split("+")[0]
    build = tv.partition("+")[2]
    if built_for is not None and built_for.split("+")[0] != public:
        what = f"torchvision {tv} is made for torch {built_for}, not this torch {torch_version}"
    elif build.startswith("cu") and torch.version.cuda is None:
        what = f"torchvision {tv} is a CUDA build ({build}) and this torch {torch_version} has no CUDA"
    else:
        what = f"torchvision {tv} is a build for another torch than this {torch_version}"
    wanted = paired_torchvision(public)
    if torch.version.cuda is None:
        install = f"pip install --no-deps torchvision=={wanted} --index-url {CPU_INDEX}"
    else:
        install = f"pip install --no-deps torchvision=={wanted} (the build for CUDA {torch.version.cuda})"
    return (
        f"{what}: its C++ operators did not load ({_load_error()}). torchvision.transforms, "
        f"datasets and models work; torchvision.ops (nms, roi_align, ...) and torchvision.io's "
        f"image codecs raise. Install the wheel made for this torch: {install}"
    )


def warn_once() -> None:
    global _warned
    with _lock:
        if _warned:
            return
        _warned = True
    try:
        line = describe()
    except Exception as exc:  # noqa: BLE001 - a diagnosis must not break the import it rescues
        line = f"torchvision's C++ operators did not load beside this torch ({exc!r})"
    log.warning("accel-npu: %s", line)
