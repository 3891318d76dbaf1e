"""The distributed half of ``accel-npu env --selftest``: run by ``torchrun`` (so through accel-npu's
launcher: its checks, the workers' defaults, the bootstrap). Rank 0 prints one line per check
(accel_npu/cli/selftest.py LAUNCH_CHECKS); a rank that fails says why on stderr.
"""

import json
import os
import sys

MARK = "ACCEL_NPU_SELFTEST "
RANK = int(os.environ.get("RANK", "0"))


def emit(name, status, detail=""):
    if RANK == 0:
        print(MARK + json.dumps({"name": name, "status": status, "detail": detail}), flush=True)


def timeout_ordering(backend: str, group_s: float | None, exec_s: int | None) -> tuple[str, str]:
    """(status, detail) of the live group's timeout against HCCL_EXEC_TIMEOUT: the collective must time
    out (and say why) before the watchdog tears the job down. ``group_s`` is what the group kept
    (torch_npu raises it to HCCL_EXEC_TIMEOUT + 1800 s at torch's 30-minute default)."""
    if backend != "hccl":
        return "skipped", (
            f"{backend} has no HCCL_EXEC_TIMEOUT (the live process group's timeout: "
            + (f"{group_s:.0f} s)" if group_s else "none)")
        )
    if exec_s is None:
        return "ok", f"HCCL_EXEC_TIMEOUT=0: collectives never time out; the group's watchdog: {group_s or 0:.0f} s"
    if group_s is None or group_s > exec_s:
        return "ok", f"the live group's watchdog {group_s or float('inf'):.0f} s > HCCL_EXEC_TIMEOUT {exec_s} s"
    return "failed", (
        f"the live group's timeout {group_s:.0f} s is not above HCCL_EXEC_TIMEOUT {exec_s} s: a slow "
        "collective kills the job first"
    )


def main():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    env = {k: os.environ[k] for k in ("DS_ACCELERATOR", "DEEPSPEED_TIMEOUT", "HCCL_EXEC_TIMEOUT") if k in os.environ}
    emit("launch (torchrun)", "ok", f"{world} rank(s); " + ", ".join(f"{k}={v}" for k, v in env.items()))

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from accel_npu._torch.dist import default_group_timeout, hccl_exec_timeout
    from accel_npu.backend import current_backend

    backend = current_backend()
    accelerator = get_accelerator()
    device = torch.device(accelerator.device_name(local_rank)) if backend.device_type != "cpu" else torch.device("cpu")
    if device.type != "cpu":
        accelerator.set_device(local_rank)
    deepspeed.init_distributed()  # the process group as DeepSpeed makes it: its backend, its timeout
    value = torch.tensor([float(RANK + 1)], device=device)
    dist.all_reduce(value)
    dist.barrier()
    want = world * (world + 1) / 2
    if float(value.item()) != want:
        emit("all_reduce + barrier", "failed", f"all_reduce gave {value.item()}, expected {want}")
    elif world < 2:
        emit(
            "all_reduce + barrier",
            "skipped",
            f"1 rank only ({backend.device_count} {backend.device_type} "
            "device visible): a 2-rank check needs 2 devices",
        )
    else:
        emit("all_reduce + barrier", "ok", f"{dist.get_backend()} over {world} ranks on {device.type}")

    emit(
        "timeout ordering",
        *timeout_ordering(
            dist.get_backend(), default_group_timeout(), hccl_exec_timeout(os.environ, soc=backend.model())
        ),
    )

    name, comm = accelerator._name, accelerator.communication_backend_name()
    want_name = backend.ds_accelerator or backend.device_type
    if (name, comm) == (want_name, backend.dist_backend):
        emit("get_accelerator()", "ok", f"{name}/{comm}")
    else:
        emit(
            "get_accelerator()",
            "failed",
            f"DeepSpeed's accelerator is {name}/{comm}, expected {want_name}/{backend.dist_backend}",
        )

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        },
    )
    before = engine.module.weight.detach().clone()
    loss = engine(torch.randn(2, 16, device=engine.device)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    moved = (engine.module.weight.detach() - before).abs().max()
    spread = engine.module.weight.detach().clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    same = float((spread - engine.module.weight.detach()).abs().max()) == 0.0
    if float(moved) > 0 and same:
        emit(
            "ZeRO-2 step",
            "ok",
            f"one step on {world} rank(s), weights moved {float(moved):.1e}, identical on every rank",
        )
    else:
        emit("ZeRO-2 step", "failed", f"weights moved {float(moved):.1e}, identical on every rank: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # say which rank and why; the runner marks the rest failed
        print(f"accel-npu self-test: rank {RANK} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise
