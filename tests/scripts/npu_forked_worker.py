"""The parent uses the NPU, then a DataLoader worker (started with fork, Linux's default) uses it too:
torch_npu refuses in the worker, and the DataLoader re-raises that in the parent."""

import torch
import torch_npu  # noqa: F401 - imported for its effect: registers the npu device
from torch.utils.data import DataLoader, Dataset

torch.npu.synchronize()  # the parent initialises the NPU


class NpuTouchingDataset(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        torch.npu.synchronize()
        return torch.zeros(1)


next(iter(DataLoader(NpuTouchingDataset(), num_workers=1)))
