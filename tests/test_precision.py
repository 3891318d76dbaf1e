"""In-process: autocast("cuda") remap, fused AdamW fallback, bf16 .numpy().

Each test shows stock behaviour beside ours: `stock()` unpatches the ledger (every original object
is back, identical) for the duration of the block, then re-arms it.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch

import accel_npu
from accel_npu._torch.device import cuda_available
from accel_npu.plugins.precision import autocast, bf16_numpy, fused_adamw
from tests.inprocess import stock, without


@pytest.fixture(autouse=True)
def active():
    accel_npu.patch()
    for module in (autocast, bf16_numpy, fused_adamw):
        module._once.clear()
    yield
    accel_npu.patch()


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3), torch.randn(2, 4)


SPELLINGS = {
    "torch.autocast('cuda')": lambda dt: torch.autocast("cuda", dtype=dt),
    "torch.amp.autocast(device_type='cuda')": lambda dt: torch.amp.autocast(device_type="cuda", dtype=dt),
    "torch.cuda.amp.autocast()": lambda dt: torch.cuda.amp.autocast(dtype=dt),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_autocast_cuda_runs_on_active_device_with_requested_dtype(spelling):
    assert not cuda_available()  # no real CUDA here (torch.cuda answers for the cpu backend under accel-npu)
    lin, x = _linear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.autocast is deprecated
        with SPELLINGS[spelling](torch.bfloat16):
            ours = lin(x)
        with stock(), pytest.warns(UserWarning, match="Disabling autocast"):
            with SPELLINGS[spelling](torch.bfloat16):
                theirs = lin(x)
    assert ours.dtype == torch.bfloat16  # autocast really ran, on cpu
    assert theirs.dtype == torch.float32  # stock: silently fp32


def test_autocast_as_decorator_and_default_dtype():
    lin, x = _linear()

    @torch.autocast("cuda", dtype=torch.bfloat16)
    def forward(t):
        return lin(t)

    assert forward(x).dtype == torch.bfloat16
    with torch.autocast("cuda"):  # no dtype: CUDA's default autocast dtype, as on a GPU
        assert lin(x).dtype == torch.get_autocast_dtype("cuda") == torch.float16


def test_autocast_remap_is_logged_once(caplog):
    lin, x = _linear()
    with caplog.at_level(logging.WARNING, logger="accel_npu"):
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lin(x)
    lines = [r.getMessage() for r in caplog.records if "torch.autocast('cuda'" in r.getMessage()]
    assert lines == [
        "accel-npu: torch.autocast('cuda', dtype=bfloat16) runs as torch.autocast('cpu', "
        "dtype=bfloat16) (no CUDA here; stock torch would disable autocast and run fp32)"
    ]


def test_autocast_passes_through_where_cuda_is_available(monkeypatch):
    # On a CUDA machine the wrapper must hand "cuda" to torch untouched.
    seen = {}
    monkeypatch.setattr(autocast, "cuda_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = torch.autocast("cuda", dtype=torch.bfloat16)
    seen["device"] = ctx.device
    assert seen == {"device": "cuda"}


def test_other_autocast_devices_untouched():
    lin, x = _linear()
    with torch.autocast("cpu", dtype=torch.bfloat16) as ctx:
        assert lin(x).dtype == torch.bfloat16
    assert ctx.device == "cpu"


# -- norms under autocast("cuda") on cpu with a half model -------------------------------------------
def _half_block():
    """A bf16 residual block: its linear runs in fp16 under autocast("cuda") (CUDA's default dtype), so
    bf16 + fp16 promotes the residual to fp32 before the bf16 norms, as in a bf16 CLIP text encoder."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
    layer_norm = torch.nn.LayerNorm(8).to(torch.bfloat16)
    group_norm = torch.nn.GroupNorm(2, 8).to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    return lin, {"layer_norm": layer_norm, "group_norm": group_norm}, x


@pytest.mark.parametrize("norm", ["layer_norm", "group_norm"])
def test_half_norms_under_remapped_autocast_run_in_fp32_as_on_cuda(norm):
    from accel_npu.plugins import precision

    lin, norms, x = _half_block()
    module = norms[norm]
    with torch.autocast("cuda"):
        residual = x + lin(x)
        assert residual.dtype == torch.float32
        ours = module(residual)
    # CUDA's autocast policy for these ops: every floating input in fp32, output fp32
    with torch.autocast("cpu", enabled=False):
        fp32 = {k: v.float() for k, v in module.state_dict().items()}
        expected = torch.func.functional_call(module.float(), fp32, (residual,))
        module.to(torch.bfloat16)
    assert ours.dtype == torch.float32 and torch.equal(ours, expected)
    # without the norm patches (the remap on): CPU's kernels refuse the half weights
    with without(precision.LAYER_NORM_FP32, precision.GROUP_NORM_FP32), torch.autocast("cuda"):
        with pytest.raises(RuntimeError, match="mixed dtype"):
            module(x + lin(x))


def test_norms_whose_dtypes_agree_run_as_stock():
    lin, norms, x = _half_block()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 activations, bf16 weights: CPU's own bf16 norm
        for module in norms.values():
            ours = module(x)
            with stock():
                theirs = module(x)
            assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs)
    fp32 = torch.nn.LayerNorm(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # half activations, fp32 weights: CPU's mixed kernel
        ours = fp32(x)
        with stock():
            theirs = fp32(x)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("op", ["cat", "stack"])
def test_cat_and_stack_of_another_half_dtype_under_remapped_autocast_promote_as_on_cuda(op):
    from accel_npu.plugins import precision

    bf16 = torch.randn(2, 4, dtype=torch.bfloat16)
    fp16 = torch.randn(2, 4, dtype=torch.float16)
    expected = getattr(torch, op)([bf16.float(), fp16.float()])  # CUDA: no autocast policy, type promotion
    with torch.autocast("cuda"):  # fp16 (CUDA's default), on cpu
        ours = getattr(torch, op)([bf16, fp16])
        same = getattr(torch, op)((bf16, bf16))
    assert ours.dtype == torch.float32 and torch.equal(ours, expected)
    assert same.dtype == torch.bfloat16 and torch.equal(same, getattr(torch, op)([bf16, bf16]))
    with without(precision.CAT_AS_ON_CUDA, precision.STACK_AS_ON_CUDA), torch.autocast("cuda"):
        with pytest.raises(RuntimeError, match="Unexpected floating ScalarType in at::autocast::prioritize"):
            getattr(torch, op)([bf16, fp16])


def test_cat_under_cpu_autocast_of_its_own_dtype_runs_as_stock():
    fp16 = torch.randn(2, 4, dtype=torch.float16)
    fp32 = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        ours = torch.cat([fp16, fp32])
        with stock():
            theirs = torch.cat([fp16, fp32])
    assert ours.dtype == theirs.dtype == torch.float32 and torch.equal(ours, theirs)


# -- bf16 .numpy() -----------------------------------------------------------------------------------
def test_bf16_numpy_returns_float32_with_one_warning():
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="bfloat16") as record:
        a = t.numpy()
        b = t.cpu().numpy()
        c = np.asarray(t)
    assert len([w for w in record if "bfloat16" in str(w.message)]) == 1
    for arr in (a, b, c):
        assert arr.dtype == np.float32
        assert arr.tolist() == [1.5, -2.25, 3.0]
    with stock(), pytest.raises(TypeError, match="Got unsupported ScalarType BFloat16"):
        t.numpy()


def test_numpy_other_dtypes_untouched_and_zero_copy():
    for dtype in (torch.float32, torch.float16, torch.int64):
        t = torch.zeros(3, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            arr = t.numpy()
        arr[0] = 7  # shares memory, as before
        assert t[0].item() == 7
        assert arr.dtype == torch.empty(0, dtype=dtype).numpy().dtype
    with pytest.raises(RuntimeError, match="requires grad"), warnings.catch_warnings():  # semantics kept
        warnings.simplefilter("ignore")
        torch.zeros(2, dtype=torch.bfloat16, requires_grad=True).numpy()


# -- fused AdamW(fused=True) where torch rejects it --------------------------------------------------
def _complex_param():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.complex64))
    p.grad = torch.randn(5, dtype=torch.complex64)
    return p


def test_fused_adamw_falls_back_to_foreach_where_torch_rejects_it():
    ref = _complex_param()
    torch.optim.AdamW([ref], lr=0.1, foreach=True).step()

    p = _complex_param()
    with pytest.warns(UserWarning, match=r"AdamW\(fused=True\) is not supported here.*foreach") as record:
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        opt.step()
        opt.step()
    assert len(record) == 1
    assert opt.param_groups[0]["fused"] is False and opt.param_groups[0]["foreach"] is True
    assert opt._step_supports_amp_scaling is False  # a GradScaler unscales itself
    q = _complex_param()
    opt_ref = torch.optim.AdamW([q], lr=0.1, foreach=True)
    opt_ref.step()
    opt_ref.step()
    assert torch.equal(p.detach(), q.detach())

    s = _complex_param()
    with stock():
        opt = torch.optim.AdamW([s], lr=0.1, fused=True)
        with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point"):
            opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adamw_on_cpu_left_alone(dtype):
    p = torch.nn.Parameter(torch.randn(4, dtype=dtype))
    p.grad = torch.randn(4, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = torch.optim.AdamW([p], fused=True)
        opt.step()
    assert opt.param_groups[0]["fused"] is True
    assert opt._step_supports_amp_scaling is True
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4))])
    assert plain.param_groups[0]["fused"] is None  # no default change off npu
