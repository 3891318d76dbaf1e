"""torchvision beside a torch build its wheel was not made for.

The registry's torchvision 0.28.0 (paired with torch 2.13.0) is a CUDA build; beside this CPU
torch its C++ library cannot load. Stock ``import torchvision`` then dies registering a fake impl
for ``torchvision::nms``; with accel-npu the pure-Python parts work, one warning names the
mismatch and the wheel, and the operators raise torchvision's own error when called.
"""

import subprocess
import sys

import pytest

from tests.launch_utils import base_env
from tests.torchvision_site import paired_version, with_torchvision

# A 2x2 RGB image, row by row; the witness below is worked out from these numbers alone.
PIXELS = [[(0, 128, 255), (255, 0, 64)], [(10, 20, 30), (200, 100, 50)]]

SCRIPT = r"""
import json, sys
from PIL import Image
from torchvision import transforms
import torch

pixels = json.loads(sys.argv[1])
image = Image.new("RGB", (2, 2))
for y, row in enumerate(pixels):
    for x, rgb in enumerate(row):
        image.putpixel((x, y), tuple(rgb))
pipeline = transforms.Compose([transforms.RandomHorizontalFlip(p=1.0), transforms.ToTensor(),
                               transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])])
print("TENSOR " + json.dumps(pipeline(image).tolist()))
import transformers.modeling_utils  # imports torchvision too, whenever it is installed
import torchvision
try:
    torchvision.ops.nms(torch.tensor([[0.0, 0.0, 1.0, 1.0]]), torch.tensor([1.0]), 0.5)
    print("NMS ran")
except Exception as exc:
    print("NMS " + type(exc).__name__ + ": " + str(exc).splitlines()[0])
"""


def _run(**extra):
    import json

    return subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(PIXELS)],
        env=with_torchvision(base_env(**extra)),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_import_torchvision_beside_a_torch_it_was_not_built_for():
    import json

    import torch

    stock = _run(ACCEL_NPU_DISABLE="1")
    assert stock.returncode != 0 and "TENSOR" not in stock.stdout
    assert "operator torchvision::nms does not exist" in stock.stderr, stock.stderr[-3000:]

    ours = _run()
    assert ours.returncode == 0, ours.stderr[-3000:]
    line = next(l for l in ours.stdout.splitlines() if l.startswith("TENSOR "))
    got = json.loads(line[len("TENSOR ") :])
    # flipped left-right, channels first, (p/255 - 0.5)/0.5
    expected = [[[2 * PIXELS[y][1 - x][c] / 255 - 1 for x in range(2)] for y in range(2)] for c in range(3)]
    assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=1e-6), (got, expected)
    assert got[0][0] == [1.0, -1.0]  # red of (255,0,64) and (0,128,255), in that order

    nms = next(l for l in ours.stdout.splitlines() if l.startswith("NMS "))
    assert nms.startswith("NMS RuntimeError: Couldn't load custom C++ ops"), nms

    warnings = [l for l in ours.stderr.splitlines() if "torchvision" in l]
    assert len(warnings) == 1, ours.stderr[-3000:]
    warning = warnings[0]
    version = paired_version()
    assert f"torchvision {version}+cu" in warning and str(torch.__version__) in warning, warning
    assert "libc10_cuda.so" in warning, warning  # the loader's own reason
    assert (
        f"pip install --no-deps torchvision=={version} --index-url https://download.pytorch.org/whl/cpu" in warning
    ), warning
