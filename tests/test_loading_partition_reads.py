"""A model loaded into ZeRO-3 partitions (plugins/loading/placement/zero3.py) whose parameter the user's
code reads as an attribute before ``prepare`` gets the whole parameter, as stock diffusers' whole model
gives it (kandinsky2_2 train_text_to_image_prior.py: ``clip_mean = prior.clip_mean.clone()``).

The partitions are DeepSpeed's shape: a Parameter marked ``ds_id`` whose data is empty; the rebuild
loads the whole model as ``load_whole`` returns it. No process group, no DeepSpeed engine."""

from __future__ import annotations

import torch

from accel_npu.plugins.loading.placement import zero3


class Prior(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.clip_mean = torch.nn.Parameter(torch.arange(4.0))
        self.proj = torch.nn.Linear(4, 2)


def _partitioned(whole: Prior) -> Prior:
    """``whole``'s structure with every parameter an empty, ds_id-marked placeholder (as zero.Init leaves it)."""
    model = Prior()
    for i, (module, attr) in enumerate([(model, "clip_mean"), (model.proj, "weight"), (model.proj, "bias")]):
        placeholder = torch.nn.Parameter(torch.empty(0))
        placeholder.ds_id = i
        module._parameters[attr] = placeholder
    zero3.attach_rebuild(model, lambda: whole)
    return model


def test_the_users_attribute_read_of_a_partition_gets_the_whole_parameter():
    torch.manual_seed(0)
    whole = Prior()
    expected = {k: v.detach().clone() for k, v in whole.state_dict().items()}
    model = _partitioned(whole)
    assert type(model).__name__ == "Prior" and isinstance(model, Prior)
    optimizer = torch.optim.AdamW(model.parameters())  # the script's optimizer, made before the read

    clip_mean = model.clip_mean.clone()  # the script's read, before prepare

    assert torch.equal(clip_mean, expected["clip_mean"])
    assert torch.equal(model.proj.weight, expected["proj.weight"])  # the whole model, not one tensor
    assert not any(hasattr(p, "ds_id") for p in model.parameters())
    assert type(model) is Prior and type(model.proj) is torch.nn.Linear  # the guard is gone with the rebuild
    # the optimizer still holds the model's parameters, now whole (prepare partitions them as stock's)
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]


def test_library_reads_and_reads_inside_the_engine_leave_the_partitions():
    model = _partitioned(Prior())
    assert torch.nn.Module.get_parameter(model, "clip_mean").numel() == 0  # torch's getattr: a library
    assert hasattr(model.clip_mean, "ds_id") is False  # the user's read made it whole
    engine_held = _partitioned(Prior())
    for module in engine_held.modules():  # DeepSpeed's ZeRO-3 hooks mark every module
        module.ds_id = 0
    assert engine_held.clip_mean.numel() == 0  # inside the engine: DeepSpeed's own parameter
    assert type(engine_held) is Prior and type(engine_held.proj) is torch.nn.Linear
