"""What accel-npu's startup hook (accel_npu_startup.pth -> _accel_npu_startup) costs every Python process.

1. Timed inside fresh ``python -S`` processes (no process-start noise): ``site.addpackage`` of the
   installed .pth, which reads it, runs its line, finds and imports the module (bytecode compiled,
   as pip installs it) and installs the finder, vs the same line importing an empty module from
   the same site directory. Both run after that directory has served one import (site-packages
   always has: the first import from a directory pays for listing it, which is not the hook's
   cost). Which of the two runs first alternates from run to run.
2. ``-X importtime``'s self time of the module in the same script (separate runs).
3. One million ``find_spec`` calls of the finder for a name other than torch_npu (what every
   other import pays while it is on ``sys.meta_path``).

Usage: python benchmarks/startup_hook.py [--runs 40]
Writes benchmarks/results/startup_hook.md. Needs accel-npu installed (the .pth in site-packages).
"""

from __future__ import annotations

import argparse
import compileall
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import Report, median_spread

#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = ("_accel_npu_startup.py", "setup.py")

PTH = "accel_npu_startup.pth"
ADD = r"""
import site, sys, time
directory, hook_first = sys.argv[1], sys.argv[2] == "1"
site.addsitedir(directory)                       # runs 0-baseline.pth: the directory is listed now
known = site._init_pathinfo()
times = {}
for name in (["hook.pth-copy", "twin.pth-copy"] if hook_first else ["twin.pth-copy", "hook.pth-copy"]):
    t0 = time.perf_counter()
    site.addpackage(directory, name, known)
    times[name] = time.perf_counter() - t0
print(times["hook.pth-copy"], times["twin.pth-copy"], "_accel_npu_startup" in sys.modules, "_empty_twin" in sys.modules)
"""
FIND = (
    "import time, _accel_npu_startup as h; f = h.ExplainTorchNpuImport(); t0 = time.perf_counter()\n"
    "for _ in range(1_000_000): f.find_spec('numpy.core', None)\n"
    "print((time.perf_counter() - t0) / 1e6)"
)


def installed_pth() -> Path:
    for directory in [*site.getsitepackages(), site.getusersitepackages()]:
        if (Path(directory) / PTH).is_file():
            return Path(directory) / PTH
    raise SystemExit(f"{PTH} is not in this interpreter's site-packages: pip install accel-npu first")


def add_times(directory: Path, hook_first: bool, importtime: bool = False) -> tuple[float, float, float | None]:
    """(seconds for the hook's .pth, seconds for the twin's, importtime's self time of the module
    when ``importtime``: its own bookkeeping slows every import, so those runs are not timed)."""
    flags = ["-X", "importtime"] if importtime else []
    proc = subprocess.run(
        [sys.executable, "-S", *flags, "-c", ADD, str(directory), str(int(hook_first))],
        # -c puts the working directory first on sys.path: from the repository root that would import its
        # _accel_npu_startup.py source (no bytecode beside it) instead of the compiled copy measured here
        cwd=directory,
        check=True,
        capture_output=True,
        text=True,
    )
    hook, twin, loaded, twin_loaded = proc.stdout.split()
    assert loaded == twin_loaded == "True", proc.stdout
    own = next(
        (
            int(line.split("|")[0].split(":")[1]) / 1e6
            for line in proc.stderr.splitlines()
            if line.rstrip().endswith("| _accel_npu_startup")
        ),
        None,
    )
    return float(hook), float(twin), own


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    a = ap.parse_args()
    pth = installed_pth()
    import _accel_npu_startup

    report = Report("startup_hook", "Startup hook cost: accel_npu_startup.pth in every Python process", MEASURES)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "0-baseline.pth").write_text("import _baseline_probe\n")
        (directory / "_baseline_probe.py").write_text("")
        (directory / "_empty_twin.py").write_text("")
        line = pth.read_text()
        assert "_accel_npu_startup" in line, line
        (directory / "hook.pth-copy").write_text(line)
        (directory / "twin.pth-copy").write_text(line.replace("_accel_npu_startup", "_empty_twin"))
        shutil.copy(_accel_npu_startup.__file__, directory / "_accel_npu_startup.py")
        compileall.compile_dir(str(directory), quiet=1)
        add_times(directory, True)  # warm-up: page cache
        with_hook, twin, own = [], [], []
        for run in range(a.runs):
            h, t, _ = add_times(directory, hook_first=run % 2 == 0)
            with_hook.append(h), twin.append(t)
            own.append(add_times(directory, hook_first=run % 2 == 0, importtime=True)[2])
    pairs = sorted(x - y for x, y in zip(with_hook, twin))
    find = float(
        subprocess.run([sys.executable, "-c", FIND], check=True, capture_output=True, text=True).stdout.strip()
    )
    ms = "{:.2f}"
    rows = [
        [
            f"site.addpackage of the .pth (reads it, runs its line, imports the module, installs the finder), "
            f"{a.runs} runs",
            median_spread([x * 1e3 for x in with_hook], ms, " ms"),
            median_spread([x * 1e3 for x in twin], ms, " ms"),
            f"{pairs[len(pairs) // 2] * 1e3:.2f} ms (pairs {pairs[0] * 1e3:.2f} to {pairs[-1] * 1e3:.2f} ms)",
        ],
        [
            f"`python -S -X importtime`, same script: the _accel_npu_startup line (self time), {a.runs} runs",
            median_spread([x * 1e3 for x in own], ms, " ms"),
            "-",
            "-",
        ],
        [
            "find_spec of another name (every other import while the hook is on sys.meta_path)",
            f"{find * 1e9:.0f} ns",
            "-",
            "-",
        ],
    ]
    report.text(
        f'Installed .pth: `{pth}`. Values: median (min-max). "Same line, empty module": the .pth\'s line '
        "importing an empty module from the same directory instead; the difference pairs the two "
        "measured in one process."
    )
    report.table(["measure", "the hook", "same line, empty module", "difference"], rows)
    print(report.render())
    report.write()


if __name__ == "__main__":
    main()
