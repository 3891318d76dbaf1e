"""Host memory of loading a deep DiT and keeping 2 blocks. Prints a table.

Checkpoint: the real ``QwenImageTransformer2DModel`` class, all 60 blocks, width reduced to 1024
(8 heads x 128) so the bf16 checkpoint is ~4.5 GB, 9 shards + index like the real one. Built once,
shard by shard (never all in RAM), into ``~/.cache/accel-npu-bench/qwen-image-60x1024`` (outside git).

Cases (each launched with ``torchrun --nproc_per_node N``, N = 1, 2, 3):
  (a) stock, the OOM pattern: ``from_pretrained(path)`` without torch_dtype, keep 2 blocks
  (b) stock ``from_pretrained(path, num_layers=2)``
  (c) (a) unchanged, with accel-npu and ``ACCEL_NPU_TRUNCATE=QwenImageTransformer2DModel:2``
  (d) (b) with accel-npu
ZeRO-3 (an Accelerator with a ZeRO-3 bf16 DeepSpeedPlugin, ``zero3_init_flag=True``, created first,
then the whole 60-block ``from_pretrained(path)`` without torch_dtype):
  (e) stock (``ACCEL_NPU_DISABLE=1``): diffusers ignores zero3_init_flag, every rank builds the whole model
  (f) accel-npu: straight into ZeRO-3 partitions, rank 0 reads the checkpoint once
  Their baseline is a rank that creates the same Accelerator and loads nothing (stock's for (e)).
FSDP2 with ``fsdp_cpu_ram_efficient_loading`` (an FSDP Accelerator from accelerate's launch
environment, then ``from_pretrained(path, torch_dtype=bfloat16)`` and ``accelerator.prepare``; N >= 2):
  (g) every rank reads the whole checkpoint, as stock diffusers does (accel-npu's loading plugin
      blocked; the cpu plugin still runs FSDP on gloo ranks)
  (h) accel-npu: rank 0 reads, the other ranks get rank 0's weights at prepare
  (i), (j): (g), (h) without torch_dtype (fp32 models, the unchanged script's call)
  (k) (j) without the ``prepare`` patch (``ACCEL_NPU_DISABLED_PATCHES=`` accelerate's
      ``fsdp2_load_full_state_dict``): rank 0 keeps its whole model until every shard is built
  Peaks include ``prepare`` (accelerate broadcasts rank 0's weights into the shards there).
Node peak = max over time of the *sum* of RssAnon of all rank processes (sampled from
/proc/<pid>/status every 20 ms). Page cache (file-backed) is not counted. A case whose predicted
peak does not fit in this node's MemAvailable is not run (it would be OOM-killed, which is the
point of (a)); the table says so and gives the estimate from N=1.

Usage: python benchmarks/host_memory.py [--ns 1,2,3] [--cases a,b,c,d,e,f,g,h,i,j,k] [--cache DIR]
Writes benchmarks/results/host_memory.md (``--results NAME``: results/NAME.md, for partial runs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _proc import mem_available, rss_anon
from _results import Report

REPO = Path(__file__).resolve().parents[1]
#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = ("plugins/loading/", "plugins/deepspeed/", "plugins/devices/", "accel_npu/_torch/")
BIN = Path(sys.executable).parent
GB = 1024**3
MB = 1024**2

CONFIG = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=8,
    joint_attention_dim=3584,
    axes_dims_rope=(16, 56, 56),
)
SHARDS = 9

WORKER = r"""
import json, os, sys, time
import torch
torch.set_num_threads(1)
from diffusers import QwenImageTransformer2DModel
mode, path = sys.argv[1], sys.argv[2]
t = time.time()
if mode.startswith("zero3"):                # a ZeRO-3 job: the Accelerator comes first
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1,
          "gradient_accumulation_steps": 1}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds, zero3_init_flag=True))
    t = time.time()
if mode.startswith("fsdp2"):               # FSDP from the launch environment, as accelerate launch sets it
    from accelerate import Accelerator
    accelerator = Accelerator()
    t = time.time()
if mode in ("baseline", "zero3_baseline", "fsdp2_baseline"):
    model = None
elif mode.startswith("fsdp2"):             # fsdp2: bf16 as stored; fsdp2_fp32: no torch_dtype (fp32)
    dtype = torch.bfloat16 if mode == "fsdp2" else None
    model = QwenImageTransformer2DModel.from_pretrained(path, torch_dtype=dtype)
    # FSDP2 prepares the model with its optimizer (SGD: no state, nothing allocated)
    model, _opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
elif mode == "zero3_full":
    model = QwenImageTransformer2DModel.from_pretrained(path)
elif mode in ("raw", "raw_fp32"):          # the yardstick: safe_open read of the kept tensors only
    import accelerate
    from safetensors import safe_open
    cfg = {k: v for k, v in json.load(open(os.path.join(path, "config.json"))).items() if not k.startswith("_")}
    cfg["num_layers"] = 2
    with accelerate.init_empty_weights():
        keys = list(QwenImageTransformer2DModel(**cfg).state_dict())
    wm = json.load(open(os.path.join(path, "diffusion_pytorch_model.safetensors.index.json")))["weight_map"]
    t = time.time()
    model, got = None, []
    for name in sorted(set(wm[k] for k in keys)):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            if mode == "raw":
                got += [f.get_tensor(k).clone() for k in keys if wm[k] == name]
            else:                          # the same read, cast like from_pretrained without torch_dtype
                got += [f.get_tensor(k).to(torch.float32) for k in keys if wm[k] == name]
    secs = time.time() - t
    print("RESULT " + json.dumps({"rank": 0, "seconds": secs, "params": 0,
                                  "param_bytes": sum(x.numel() * x.element_size() for x in got)}), flush=True)
    sys.exit(0)
elif mode == "full_then_slice":            # the OOM pattern: load whole, then slice
    model = QwenImageTransformer2DModel.from_pretrained(path)
    model.transformer_blocks = model.transformer_blocks[:2]
else:                                      # "num_layers"
    model = QwenImageTransformer2DModel.from_pretrained(path, num_layers=2)
secs = time.time() - t
if mode.startswith(("zero3", "fsdp2")):   # a job holds its model until prepare: so do all ranks here
    accelerator.wait_for_everyone()
import gc; gc.collect()
# this rank's ZeRO-3 partition / FSDP shard
held = lambda p: p.ds_tensor if hasattr(p, "ds_id") else p.to_local() if hasattr(p, "to_local") else p
n = 0 if model is None else sum(held(p).numel() for p in model.parameters())
nbytes = 0 if model is None else sum(held(p).numel() * p.element_size() for p in model.parameters())
print("RESULT " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "seconds": secs, "params": n,
                              "param_bytes": nbytes}), flush=True)
time.sleep(1.0)  # let the sampler see the steady state
"""


def default_cache() -> Path:
    return Path(os.environ.get("ACCEL_NPU_BENCH_CACHE", Path.home() / ".cache" / "accel-npu-bench"))


# ------------------------------------------------------------------------------------------------
# the checkpoint
# ------------------------------------------------------------------------------------------------
def build_checkpoint(root: Path) -> Path:
    path = root / "qwen-image-60x1024"
    if (path / "diffusion_pytorch_model.safetensors.index.json").exists():
        return path
    import accelerate
    import torch
    from diffusers import QwenImageTransformer2DModel
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    with accelerate.init_empty_weights():
        meta = QwenImageTransformer2DModel(**CONFIG)
    meta.save_config(str(tmp))
    shapes = [(k, tuple(v.shape)) for k, v in meta.state_dict().items()]
    total = sum(2 * _numel(s) for _, s in shapes)
    per_shard = total / SHARDS
    groups, cur, size = [], [], 0
    for k, s in shapes:
        cur.append((k, s))
        size += 2 * _numel(s)
        if size >= per_shard and len(groups) < SHARDS - 1:
            groups.append(cur)
            cur, size = [], 0
    groups.append(cur)
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for k, s in group:
            t = torch.randn(s, generator=g) * 0.02
            tensors[k] = t.to(torch.bfloat16)
            del t
            weight_map[k] = name
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        del tensors
        print(f"  wrote {name}", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    tmp.rename(path)
    return path


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ------------------------------------------------------------------------------------------------
# measuring
# ------------------------------------------------------------------------------------------------
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def make_memory_cgroup(limit: int) -> Path | None:
    """A cgroup-v1 memory cgroup for the launched ranks (None where this machine cannot make one)."""
    path = CGROUP_V1 / f"accel-npu-bench-{os.getpid()}"
    try:
        path.mkdir(exist_ok=True)
        (path / "memory.limit_in_bytes").write_text(str(limit))
        return path
    except OSError:
        return None


def remove_cgroup(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def run_case(
    worker: Path, mode: str, ckpt: Path, n: int, accel: bool, extra_env: dict, cgroup: Path | None = None
) -> dict:
    import psutil

    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_NPU_")}
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        ACCEL_NPU_DISABLE="0" if accel else "1",
        **extra_env,
    )
    cmd = [
        str(BIN / "torchrun"),
        f"--nproc_per_node={n}",
        "--master_port",
        str(_free_port()),
        str(worker),
        mode,
        str(ckpt),
    ]
    # output to files, not pipes: stock's per-key warning flood would fill a pipe and block the ranks
    import tempfile

    out_f, err_f = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")

    def enter_cgroup():
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    proc = subprocess.Popen(cmd, env=env, stdout=out_f, stderr=err_f, text=True, preexec_fn=enter_cgroup)
    parent = psutil.Process(proc.pid)
    peak = 0
    t0 = time.time()
    while proc.poll() is None:
        try:
            ranks = [c.pid for c in parent.children(recursive=True) if str(worker) in " ".join(c.cmdline())]
        except psutil.Error:
            ranks = []
        peak = max(peak, sum(rss_anon(p) for p in ranks))
        time.sleep(0.02)
    proc.wait()
    out_f.seek(0)
    err_f.seek(0)
    out, err = out_f.read(), err_f.read()
    summary = [
        line
        for line in err.splitlines()
        if "accel-npu:" in line
        and ("truncated" in line or "ZeRO-3 partitions" in line or "read on rank 0 only" in line)
    ]
    flood = sum(1 for line in err.splitlines() if "were not used when initializing" in line)
    res = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line]
    return {
        "rc": proc.returncode,
        "peak": peak,
        "wall": time.time() - t0,
        "results": res,
        "stderr": err[-2000:],
        "killed": proc.returncode != 0,
        "summary": summary[:1],
        "stderr_bytes": len(err),
        "unused_key_warnings": flood,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FSDP2_PREPARE_PATCH = "accelerate.utils.fsdp_utils:fsdp2_load_full_state_dict"
CASES = {
    "a": ("stock: full from_pretrained (no torch_dtype), slice 2", "full_then_slice", False, {}),
    "b": ("stock: from_pretrained(num_layers=2)", "num_layers", False, {}),
    "c": (
        "accel-npu: (a) + ACCEL_NPU_TRUNCATE=...:2",
        "full_then_slice",
        True,
        {"ACCEL_NPU_TRUNCATE": "QwenImageTransformer2DModel:2"},
    ),
    "d": ("accel-npu: (b)", "num_layers", True, {}),
    "e": ("ZeRO-3, stock (ACCEL_NPU_DISABLE=1): whole model per rank", "zero3_full", False, {}),
    "f": ("ZeRO-3, accel-npu: partitions, read once", "zero3_full", True, {}),
    "g": (
        "FSDP2 efficient loading, every rank reads (stock diffusers)",
        "fsdp2",
        True,
        {"ACCEL_NPU_DISABLED_PLUGINS": "loading"},
    ),
    "h": ("FSDP2 efficient loading, accel-npu: rank 0 reads", "fsdp2", True, {}),
    "i": (
        "(g) without torch_dtype (fp32), every rank reads",
        "fsdp2_fp32",
        True,
        {"ACCEL_NPU_DISABLED_PLUGINS": "loading"},
    ),
    "j": ("(h) without torch_dtype (fp32), accel-npu: rank 0 reads", "fsdp2_fp32", True, {}),
    "k": (
        "(j) without the prepare patch (ACCEL_NPU_DISABLED_PATCHES=" + FSDP2_PREPARE_PATCH + ")",
        "fsdp2_fp32",
        True,
        {"ACCEL_NPU_DISABLED_PATCHES": FSDP2_PREPARE_PATCH},
    ),
}
_DS_ENV = {"ACCELERATE_USE_DEEPSPEED": "true"}
_FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_SYNC_MODULE_STATES": "true",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "ACCELERATE_MIXED_PRECISION": "no",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="1,2,3")
    ap.add_argument("--cases", default="a,b,c,d,e,f,g,h,i,j,k")
    ap.add_argument("--results", default="host_memory", help="results file name (benchmarks/results/NAME.md)")
    ap.add_argument("--cache", default=str(default_cache()))
    ap.add_argument("--json", default=None, help="also write the measurements here")
    ap.add_argument(
        "--cgroup-gib",
        type=float,
        default=4.0,
        help="memory limit for the (a)-vs-(c) run at N=2 in a memory cgroup (0: skip)",
    )
    a = ap.parse_args(argv)
    # before measuring, and before the checkpoint is built where it is absent
    report = Report(a.results, "Host memory of loading a deep DiT (node peak of summed RssAnon)", MEASURES)
    ns = [int(x) for x in a.ns.split(",")]
    cache = Path(a.cache)
    print(f"checkpoint cache: {cache}", flush=True)
    ckpt = build_checkpoint(cache)
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    # a worker file per content: another run of an older version of this script may be using its own
    worker = cache / f"host_memory_worker_{hashlib.sha1(WORKER.encode()).hexdigest()[:10]}.py"
    if not worker.exists():
        worker.write_text(WORKER)
    print(f"checkpoint: {ckpt} ({ckpt_bytes / GB:.2f} GB bf16, 60 blocks)", flush=True)

    summary: list[str] = []

    def out(line: str = "", record: bool = True) -> None:
        print(line)
        if line.strip() and record:
            summary.append(line.strip())

    base = run_case(worker, "baseline", ckpt, 1, True, {})
    baseline = base["peak"]
    rows, per_rank_a, per_rank_e, zero3_base = [], None, None, {}
    measured: dict = {"baseline": baseline, "checkpoint_bytes": ckpt_bytes, "cases": {}}
    for case in [c for c in a.cases.split(",") if c]:
        label, mode, accel, env = CASES[case]
        if case in "ef":
            env = {**env, **_DS_ENV}
        if case in "ghijk":
            env = {**env, **_FSDP_ENV}
        for n in ns:
            zkey = f"zs{n}" if case == "e" else f"z{n}"  # stock's own baseline for the stock case
            if case in "ef" and zkey not in zero3_base:
                zero3_base[zkey] = run_case(worker, "zero3_baseline", ckpt, n, case == "f", _DS_ENV)["peak"]
                measured["zero3_baseline"] = zero3_base
            if case in "ghijk":
                if n < 2:
                    continue  # one rank: nothing to shard
                if f"s{n}" not in zero3_base:
                    zero3_base[f"s{n}"] = run_case(worker, "fsdp2_baseline", ckpt, n, True, _FSDP_ENV)["peak"]
                    measured["fsdp2_baseline"] = {k: v for k, v in zero3_base.items() if k.startswith("s")}
            per_rank = per_rank_a if case == "a" else per_rank_e if case == "e" else None
            formula = f"{n} × N=1"
            if case == "i":  # every rank a whole fp32 model, plus the shards made at prepare
                per_rank = 2 * ckpt_bytes * (n + 1) / n + baseline
                formula = "N × (fp32 model × (N+1)/N + baseline)"
            if case == "k":  # rank 0's whole fp32 model + all fp32 shards + the other ranks' buffers
                per_rank = (2 * ckpt_bytes * (1 + 1 + (n - 1) / n)) / n + baseline
                formula = "fp32 model × (2 + (N-1)/N) + N × baseline"
            if per_rank is not None:
                need = n * per_rank
                if need > 0.85 * mem_available():
                    rows.append(
                        (
                            case,
                            n,
                            label,
                            None,
                            f"not run: needs ~{need / GB:.1f} GiB "
                            f"(estimate: {formula}), {mem_available() / GB:.1f} GiB available",
                            None,
                        )
                    )
                    measured["cases"][f"{case}{n}"] = {"estimate": need}
                    continue
            r = run_case(worker, mode, ckpt, n, accel, env)
            secs = max((x["seconds"] for x in r["results"]), default=float("nan"))
            params = r["results"][0]["param_bytes"] if r["results"] else 0
            note = "OK" if r["rc"] == 0 else f"FAILED rc={r['rc']}: {r['stderr'][-300:]!r}"
            rows.append((case, n, label, r["peak"], note, secs))
            measured["cases"][f"{case}{n}"] = {
                "peak": r["peak"],
                "rc": r["rc"],
                "seconds": secs,
                "param_bytes": params,
                "stderr_bytes": r["stderr_bytes"],
                "summary": r["summary"],
            }
            if case == "a" and n == 1 and r["rc"] == 0:
                per_rank_a = r["peak"]
            if case == "e" and n == 1 and r["rc"] == 0:
                per_rank_e = r["peak"]
            if case == "c" and n == 1:
                measured["truncated_bytes"] = params
            print(f"  ({case}) N={n}: {r['peak'] / MB:,.0f} MB  {secs:.1f} s  {note[:80]}", flush=True)

    out()
    out(
        f"Node peak of summed RssAnon (MB); process baseline {baseline / MB:,.0f} MB; checkpoint "
        f"{ckpt_bytes / GB:.2f} GB bf16",
        record=False,
    )
    table = []
    out(f"{'case':<5}{'N':>3}  {'peak MB':>10}  {'load s':>7}  {'log KB':>7}  description / note", record=False)
    for case, n, label, peak, note, secs in rows:
        p = f"{peak / MB:>10,.0f}" if peak is not None else f"{'-':>10}"
        s = f"{secs:>7.1f}" if secs is not None else f"{'-':>7}"
        logkb = measured["cases"].get(f"{case}{n}", {}).get("stderr_bytes")
        lk = f"{logkb / 1024:>7.0f}" if logkb is not None else f"{'-':>7}"
        out(f"({case}) {n:>3}  {p}  {s}  {lk}  {label}" + ("" if note == "OK" else f"  [{note}]"), record=False)
        table.append(
            [
                f"({case})",
                str(n),
                f"{peak / MB:,.0f} MB" if peak is not None else "-",
                f"{secs:.1f} s" if secs is not None else "-",
                f"{lk.strip()} KB",
                label,
                "" if note == "OK" else note,
            ]
        )
    report.text(
        f"Checkpoint: {ckpt.name}, {ckpt_bytes / GB:.2f} GB bf16 (60 blocks, 9 shards). Node peak = max "
        f"over time of the summed RssAnon of all rank processes (20 ms samples); process baseline "
        f"{baseline / MB:,.0f} MB; {mem_available() / GB:.1f} GiB available at the end."
    )
    report.table(["case", "N", "node peak", "load", "stderr", "description", "note"], table)
    report.text("Derived:")
    trunc = measured.get("truncated_bytes")
    out()
    for n in ns:
        c, a_, b_, d_ = (measured["cases"].get(f"{x}{n}", {}) for x in "cabd")
        a_peak = a_.get("peak") or a_.get("estimate")
        if c.get("peak") and a_peak:
            out(
                f"N={n}: (a)/(c) = {a_peak / c['peak']:.1f}x (goal >= 10x at N=3)"
                + (" [a estimated]" if "estimate" in a_ else "")
            )
        if d_.get("peak") and b_.get("peak"):
            out(f"N={n}: (d)/(b) = {d_['peak'] / b_['peak']:.2f} (goal <= 1.0)")
        if d_.get("peak") and trunc:
            bound = 1.2 * (n * (trunc + baseline))
            out(
                f"N={n}: (d) {d_['peak'] / MB:,.0f} MB vs 1.2 x (N x (truncated model {trunc / MB:,.0f} MB + "
                f"baseline)) = {bound / MB:,.0f} MB -> {'OK' if d_['peak'] <= bound else 'ABOVE'}"
            )
    for n in ns:
        e_, f_ = (measured["cases"].get(f"{x}{n}", {}) for x in "ef")
        zb = zero3_base.get(f"z{n}")
        if f_.get("peak") and zb:
            bound = 1.2 * ckpt_bytes + zb
            e_peak = e_.get("peak") or e_.get("estimate")
            out(
                f"N={n}: ZeRO-3 (f) {f_['peak'] / MB:,.0f} MB vs 1.2 x model + N x baseline = "
                f"{1.2 * ckpt_bytes / MB:,.0f} + {zb / MB:,.0f} = {bound / MB:,.0f} MB -> "
                f"{'OK' if f_['peak'] <= bound else 'ABOVE'}; above baseline: {(f_['peak'] - zb) / ckpt_bytes:.2f} x "
                "model"
                + (
                    f"; (e)/(f) = {e_peak / f_['peak']:.1f}x" + (" [e estimated]" if "estimate" in e_ else "")
                    if e_peak
                    else ""
                )
            )
    for stock, ours in ("gh", "ij"):
        for n in ns:
            g_, h_ = (measured["cases"].get(f"{x}{n}", {}) for x in (stock, ours))
            sb = zero3_base.get(f"s{n}")
            if h_.get("peak") and sb:
                g_peak = g_.get("peak") or g_.get("estimate")
                out(
                    f"N={n}: FSDP2 ({ours}) {h_['peak'] / MB:,.0f} MB, above baseline "
                    f"{(h_['peak'] - sb) / ckpt_bytes:.2f} x bf16 model"
                    + (
                        f"; ({stock}) above baseline {(g_peak - sb) / ckpt_bytes:.2f} x; ({stock})/({ours}) = "
                        f"{g_peak / h_['peak']:.1f}x" + (f" [{stock} estimated]" if "estimate" in g_ else "")
                        if g_peak
                        else ""
                    )
                )
    # load throughput: benchmarks/load_throughput.py (whole calls, same threads, warm and cold)
    for key in ("c1", "d1", *(f"f{n}" for n in ns), *(f"h{n}" for n in ns)):
        if measured["cases"].get(key, {}).get("summary"):
            out(f"({key[0]}) log line: {measured['cases'][key]['summary'][0].strip()}")
    if a.cgroup_gib:
        limit = int(a.cgroup_gib * GB)
        cg = make_memory_cgroup(limit)
        if cg is None:
            out("memory cgroup: cannot create one here (cgroup v1 memory controller not writable); skipped")
        else:
            out(f"\nN=2 inside a {a.cgroup_gib:g} GiB memory cgroup (page cache counted, reclaimable):")
            try:
                for case in ("a", "c"):
                    label, mode, accel, env = CASES[case]
                    r = run_case(worker, mode, ckpt, 2, accel, env, cgroup=cg)
                    killed = "OOM-killed" if "Signal 9" in r["stderr"] or "-9" in r["stderr"] else ""
                    status = "completed" if r["rc"] == 0 else f"FAILED rc={r['rc']} {killed}".strip()
                    out(f"  ({case}) {label}: {status}, node peak {r['peak'] / MB:,.0f} MB")
                    measured["cgroup"] = {
                        **measured.get("cgroup", {}),
                        case: {"rc": r["rc"], "peak": r["peak"], "status": status},
                    }
            finally:
                remove_cgroup(cg)
    report.text("\n".join(f"- {line}" for line in summary))
    report.write()
    if a.json:
        Path(a.json).write_text(json.dumps(measured, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
