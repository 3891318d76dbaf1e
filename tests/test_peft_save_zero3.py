"""peft's ``PeftModel.save_pretrained`` of a ZeRO-3 partitioned LoRA model (diffusers v0.40.0's
consistency_distillation/train_lcm_distill_lora_sd_wds.py saves its checkpoints' adapter this way, on rank 0).

peft passes ``state_dict=None`` by keyword to get_peft_model_state_dict and then clones the entries that share
a storage ("Safetensors does not allow tensor aliasing", peft/peft_model.py): every partition is an empty
tensor, so the clones were written shape-[0] (exit 0; the first entry alone whole) and the resume's
``load_adapter`` refused them (the compatibility matrix's zero3_t0 row of that script). In-process, one rank;
witness: the safetensors file opened here against the engine's gathered parameters. No stock half in-process:
peft binds safetensors' save_file at import (``safe_save_file``), so ``accel_npu.unpatch()`` cannot take the
gathered writer away from it.
"""

from __future__ import annotations

import pytest

import accel_npu


@pytest.fixture()
def zero3_lora_engine(monkeypatch):
    from tests.launch_utils import one_rank_deepspeed_group

    accel_npu.patch()
    with one_rank_deepspeed_group(monkeypatch):
        import deepspeed
        import torch
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(
            torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
            LoraConfig(r=2, target_modules=["0", "2"], init_lora_weights=False),
        )
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        }
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
        yield engine
    accel_npu.patch()


def _saved(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def test_peft_save_pretrained_of_a_partitioned_adapter_writes_it_whole(zero3_lora_engine, tmp_path):
    import deepspeed
    import torch

    peft_model = zero3_lora_engine.module
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert lora and all(p.numel() == 0 for p in lora.values())  # partitioned: nothing held whole here
    with deepspeed.zero.GatheredParameters(list(lora.values())):
        want = {n.replace(".default", ""): p.detach().clone() for n, p in lora.items()}

    peft_model.save_pretrained(str(tmp_path / "ours"))
    got = _saved(tmp_path / "ours")
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
