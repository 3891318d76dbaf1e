"""The bottom layer: torch / safetensors / torch.distributed helpers every plugin may import.

Each module imports only the standard library and ``accel_npu.environment`` / ``accel_npu.errors``
at module level (plugins import them inside ``import torch``); torch, safetensors and deepspeed
are imported inside the functions that need them. Nothing here imports a plugin.
"""
