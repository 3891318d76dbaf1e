"""diffusers' ``BucketBatchSampler`` classes, their source read unchanged from the vendored v0.40.0 scripts.

Flux Kontext's reorders its ``batches`` list in place with the global ``random`` at every epoch; Flux2's shuffles
copies with a private ``random.Random(seed)`` (examples/dreambooth/train_dreambooth_lora_flux_kontext.py and
train_dreambooth_lora_flux2.py, ``class BucketBatchSampler``). The scripts cannot be imported (they parse
arguments and train at import), so the class definition is taken from the file's syntax tree.
"""

import ast
import random
from pathlib import Path

import torch

DREAMBOOTH = Path(__file__).resolve().parents[2] / "third_party" / "diffusers-v0.40.0" / "examples" / "dreambooth"
KONTEXT = "train_dreambooth_lora_flux_kontext.py"
FLUX2 = "train_dreambooth_lora_flux2.py"


def bucket_batch_sampler(script: str):
    """The script's BucketBatchSampler class, as upstream wrote it."""
    path = DREAMBOOTH / script
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BucketBatchSampler"]
    namespace = {"BatchSampler": torch.utils.data.BatchSampler, "random": random, "DreamBoothDataset": object}
    exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["BucketBatchSampler"]


class OneBucket(torch.utils.data.Dataset):
    """What BucketBatchSampler reads of DreamBoothDataset: its buckets and (pixels, bucket) pairs; an item is its
    index."""

    buckets = [(32, 32)]

    def __init__(self, size: int = 8):
        self.pixel_values = [(None, 0)] * size

    def __len__(self):
        return len(self.pixel_values)

    def __getitem__(self, index):
        return index


def kontext_sampler(size: int = 8):
    return bucket_batch_sampler(KONTEXT)(OneBucket(size), batch_size=1, drop_last=True)


def flux2_sampler(size: int = 8, seed: int = 0):
    return bucket_batch_sampler(FLUX2)(OneBucket(size), batch_size=1, drop_last=True, seed=seed)
