"""fp16 autocast written for CUDA with loss scaling: ``torch.autocast("cuda", torch.float16)`` and a
"cuda" GradScaler (three spellings), against an fp32 reference of the same model and data.

The loss is multiplied by 2**-24 so that its gradients (about 1e-9) lie below float16's smallest
subnormal (2**-24, about 6e-8): unscaled, they flush to zero in the fp16 backward; scaled by
GradScaler's 2**16 they are normal fp16 numbers. The learning rates are multiplied back, so the
updates have an ordinary size. No accel_npu import: an unchanged user script.

Prints ``RESULT {json}`` with, per scaler spelling and optimizer: whether the scaler is enabled,
its scale after each step, the fraction of gradients that are exactly zero and the gradients'
relative error against fp32 at step 1, and the parameters' relative error after the last step.
"""

import json
import warnings

import torch

TINY = 2.0**-24
STEPS = 3

SCALERS = {
    "torch.cuda.amp.GradScaler()": lambda: torch.cuda.amp.GradScaler(growth_interval=1),
    "torch.amp.GradScaler('cuda')": lambda: torch.amp.GradScaler("cuda", growth_interval=1),
    "torch.GradScaler('cuda')": lambda: torch.GradScaler("cuda", growth_interval=1),
}

OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.01 / TINY),
    # fused: on cpu torch's kernel takes the scaler's grad_scale/found_inf (_step_supports_amp_scaling)
    "AdamW(fused=True)": lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-30, fused=True),
}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y) * TINY


def rel(a, b):
    return float((a - b).norm() / b.norm())


def reference(opt_name):
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    grads = None
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        if grads is None:
            grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def amp_run(scaler_name, opt_name):
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation / "Disabling" warnings: stock's are part of the test
        scaler = SCALERS[scaler_name]()
    scales, grads, out_dtype = [], None, None
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            out_dtype = str(model(x).dtype)
            loss = loss_of(model, x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if grads is None:
            grads = [p.grad.clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scaler, scales, grads, out_dtype, [p.detach().clone() for p in model.parameters()]


def main():
    out = {"cuda_available": torch.cuda.is_available(), "runs": {}}
    for opt_name in OPTIMIZERS:
        ref_grads, ref_params = reference(opt_name)
        for scaler_name in SCALERS:
            scaler, scales, grads, out_dtype, params = amp_run(scaler_name, opt_name)
            flat = torch.cat([g.flatten() for g in grads])
            out["runs"][f"{scaler_name} + {opt_name}"] = {
                "enabled": scaler.is_enabled(),
                "scales": scales,
                "autocast_output_dtype": out_dtype,
                "zero_grad_fraction": float((flat == 0).float().mean()),
                "grad_rel_err": max(rel(g, r) for g, r in zip(grads, ref_grads)),
                "param_rel_err": max(rel(p, r) for p, r in zip(params, ref_params)),
                "params_moved": max(rel(p, r) for p, r in zip(params, [q.detach() for q in make_model().parameters()])),
            }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
