"""diffusers' NPU attention backend ops where torch_npu is not installed (this process): accel-npu's forward/backward
ops (plugins/attention/npu_fusion.py) leave them exactly as stock. With torch_npu (the stand-in), the contract test
tests/contract/test_attention_npu.py checks their gradients against SDPA's autograd."""

from __future__ import annotations

import importlib.util
import inspect

import torch

from tests.inprocess import stock


class Ctx:
    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _outcome(call):
    try:
        return "returned", call()
    except Exception as exc:  # noqa: BLE001 - the outcome compared with stock's is the exception itself
        return type(exc).__name__, str(exc)


def test_without_torch_npu_the_npu_attention_ops_are_stock():
    from diffusers.models import attention_dispatch as dispatch

    from accel_npu.patching import APPLIED, get_ledger

    assert importlib.util.find_spec("torch_npu") is None and dispatch.npu_fusion_attention is None
    ledger = get_ledger()
    names = ("_npu_attention_forward_op", "_npu_attention_backward_op")
    assert [ledger.find(f"diffusers.models.attention_dispatch:{n}").status for n in names] == [APPLIED] * 2
    q = k = v = torch.randn(1, 4, 2, 8)

    def calls():
        return (
            _outcome(lambda: dispatch._npu_attention_forward_op(Ctx(), q, k, v)),
            _outcome(lambda: dispatch._npu_attention_backward_op(Ctx(), q)),
        )

    ours = calls()
    with stock():
        assert getattr(dispatch._npu_attention_backward_op, "__wrapped__", None) is None  # stock's own function
        theirs = calls()
    assert ours == theirs
    assert theirs[1] == ("NotImplementedError", "Backward pass is not implemented for Npu Fusion Attention.")
    assert theirs[0][0] == "TypeError", theirs  # npu_fusion_attention is None: nothing to call


def test_diffusers_reads_the_ops_from_its_module_at_each_call():
    """_native_npu_attention names both ops as module globals inside its body (attention_dispatch.py), so the
    patched module attributes are what TemplatedUlyssesAttention / TemplatedRingAttention receive."""
    from diffusers.models import attention_dispatch as dispatch

    body = inspect.getsource(dispatch._native_npu_attention).replace(" ", "")
    assert "forward_op=_npu_attention_forward_op," in body and "backward_op=_npu_attention_backward_op," in body
