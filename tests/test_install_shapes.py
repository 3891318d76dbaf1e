"""accel-npu works however it is installed, found and launched.

Shapes users arrive with: the repository root first on sys.path (``python -c`` from the root;
accelerate's DeepSpeed launcher appends the working directory to the workers' PYTHONPATH), the
installed distribution (CI installs non-editably, README's test command), a wheel installed into
another location, launches from the root and from elsewhere. Witnesses are read off the worker
processes themselves: sys.modules, the world size torch.distributed reports, an all-reduce.
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.launch_utils import REPO, SCRIPTS, accelerate_launch, base_env, explain, results, source_tree


def builtin_modules() -> set[str]:
    from accel_npu.manager import DEFAULT_PLUGINS

    return {module for _, module in DEFAULT_PLUGINS}


def plugin_loading_lines(text: str) -> list[str]:
    return [l for l in text.splitlines() if "failed to load" in l or "no built-in plugin loads" in l]


@pytest.mark.slow
def test_repository_root_first_on_sys_path_loads_every_plugin():
    """`python -c` from the repository root: the source accel_npu/ comes first."""
    code = (
        "import torch, sys, accel_npu.plugins as p; from accel_npu.manager import get_plugin_manager; "
        "print('RESULT', accel_npu.__file__, p.__file__, "
        "sorted(r.status for r in get_plugin_manager().records if r.source.startswith('builtin')))"
    )
    code = "import accel_npu; " + code
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, explain(proc)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    _, init, plugins_init, statuses = line.split(" ", 3)
    assert Path(init) == REPO / "accel_npu" / "__init__.py"
    assert Path(plugins_init) == REPO / "plugins" / "__init__.py"
    assert statuses == repr(["loaded"] * len(builtin_modules()))
    assert not plugin_loading_lines(proc.stderr), proc.stderr


@pytest.fixture(scope="module")
def wheel_target(tmp_path_factory):
    """`pip install accel-npu`'s shape: a wheel built from the tree, installed (no deps) into a
    directory of its own that the processes below get on PYTHONPATH."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    source_tree(src)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(work / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = next((work / "dist").glob("accel_npu-*.whl"))
    target = work / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (target / "accel_npu" / "plugins" / "__init__.py").is_file()
    assert not (target / "plugins").exists(), "the wheel must not install a top-level 'plugins' package"
    return target


STARTUP_PTH = "accel_npu_startup.pth"
# -S: no site-packages of this interpreter (whose own install has the hook), only the directory given
STARTUP_PROBE = (
    "import site, sys; site.addsitedir(sys.argv[1]); m = sys.modules.get('_accel_npu_startup'); "
    "print('RESULT', m and m.__file__, [repr(f) for f in sys.meta_path "
    "if type(f).__name__ == 'ExplainTorchNpuImport'])"
)


def startup_hook_in(site_dir: Path, **env) -> tuple[str, str]:
    """(the file _accel_npu_startup was imported from, the hooks on sys.meta_path) in a process
    whose only site directory is ``site_dir``."""
    proc = subprocess.run(
        [sys.executable, "-S", "-c", STARTUP_PROBE, str(site_dir)],
        env=base_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert proc.returncode == 0 and not proc.stderr, explain(proc)
    return next(l for l in proc.stdout.splitlines() if l.startswith("RESULT")).split(" ", 2)[1:]


@pytest.mark.slow
def test_every_install_shape_ships_the_startup_hook(wheel_target, tmp_path):
    """accel_npu_startup.pth (written by setup.py) reaches site-packages from a wheel / `pip install .`
    and from `pip install -e .`, and there puts the torch_npu startup hook on sys.meta_path (not
    under ACCEL_NPU_DISABLE=1). Its effect on a failing torch_npu: tests/contract/test_npu_contract.py."""
    # the wheel, installed: the .pth and its module at the top, where site-packages would have them
    assert "import _accel_npu_startup" in (wheel_target / STARTUP_PTH).read_text()
    module, hooks = startup_hook_in(wheel_target)
    assert Path(module) == wheel_target / "_accel_npu_startup.py"
    assert hooks == "['<accel-npu startup hook: waiting for the first import of torch_npu>']", hooks
    assert startup_hook_in(wheel_target, ACCEL_NPU_DISABLE="1") == [module, "[]"]

    # the editable wheel `pip install -e .` installs (PEP 660, built from the same tree): the .pth
    # sorts after the editable finder's (site runs .pth files in name order), which serves the module
    src = wheel_target.parent / "src"
    out = tmp_path / "editable"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; print('WHEEL', build_meta.build_editable(sys.argv[1]))",
            str(out),
        ],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    site_dir = tmp_path / "editable-site"
    with zipfile.ZipFile(next(out.glob("*.whl"))) as whl:
        pth_files = sorted(n for n in whl.namelist() if n.endswith(".pth"))
        assert len(pth_files) == 2 and pth_files[0].startswith("__editable__") and pth_files[1] == STARTUP_PTH, (
            pth_files
        )
        whl.extractall(site_dir)  # what an installer does with a pure wheel's top level
    module, hooks = startup_hook_in(site_dir)
    assert Path(module) == src / "_accel_npu_startup.py", module
    assert hooks == "['<accel-npu startup hook: waiting for the first import of torch_npu>']", hooks


def test_accel_npu_env_says_whether_the_startup_hook_runs(monkeypatch):
    """`accel-npu env` (Installation -> startup hook): this interpreter's install has the hook."""
    import _accel_npu_startup
    from accel_npu import install

    state = install.startup_hook_state()
    assert state.startswith(f"{_accel_npu_startup.__file__}: ") and state.endswith("the first import of torch_npu"), (
        state
    )
    monkeypatch.delitem(sys.modules, "_accel_npu_startup")
    assert install.startup_hook_state().startswith("not loaded in this process, though "), install.startup_hook_state()


def check_workers(proc, expect_dir: Path):
    """Both ranks: one process group of 2, every built-in plugin imported from expect_dir."""
    recs = results(proc)
    assert [r["rank"] for r in recs] == [0, 1], explain(proc)
    for rec in recs:
        assert rec["world_size"] == 2 and rec["rank_sum"] == 1.0, rec
        assert builtin_modules() <= set(rec["modules"]), sorted(builtin_modules() - set(rec["modules"]))
        for name, path in rec["modules"].items():
            assert Path(path).resolve().is_relative_to(expect_dir.resolve()), (name, path, expect_dir)
        # accelerate was imported before torch: the checkpoint guards are on anyway
        assert rec["save_state_type"] == "FunctionWrapper", rec
    assert not plugin_loading_lines(proc.stdout + proc.stderr), explain(proc)


def installed_dir() -> Path:
    from accel_npu import install

    return Path(install.installed_package_dir()).parent


@pytest.mark.slow
def test_deepspeed_launch_from_the_repository_root():
    """accelerate's DeepSpeed launcher puts the root on the workers' PYTHONPATH: under a non-editable
    install (CI) the source accel_npu/ then shadows the installed one, and must work the same."""
    proc = accelerate_launch(
        ["--config_file", "launch_configs/cpu_zero2.yaml", str(SCRIPTS / "report_activation.py")], cwd=REPO
    )
    assert proc.returncode == 0, explain(proc)
    check_workers(proc, REPO)


@pytest.mark.slow
def test_deepspeed_launch_of_a_wheel_from_elsewhere(wheel_target, tmp_path):
    """The wheel, first on PYTHONPATH, launched from an unrelated directory with a copied config."""
    for name in ("cpu_zero2.yaml", "cpu_zero2.deepspeed.json", "cpu_zero2.accel-npu.yaml"):
        shutil.copy(REPO / "launch_configs" / name, tmp_path / name)
    shutil.copy(SCRIPTS / "report_activation.py", tmp_path / "train.py")
    env = base_env(PYTHONPATH=str(wheel_target))
    proc = accelerate_launch(["--config_file", "cpu_zero2.yaml", "train.py"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, explain(proc)
    check_workers(proc, wheel_target)


def stale_checkout(root: Path) -> Path:
    """A checkout of an older accel-npu: accel_npu/ beside plugins/, without the source mapping."""
    shutil.copytree(REPO / "accel_npu", root / "accel_npu", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "plugins", root / "plugins", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "setup.cfg", root / "setup.cfg")
    init = root / "accel_npu" / "__init__.py"
    text = init.read_text()
    start, end = (
        text.index("#: Subpackages whose source"),
        text.index("_map_source_checkout()\n", text.index("def _map")),
    )
    init.write_text(text[:start] + text[end + len("_map_source_checkout()\n") :])
    return root


# An editable install's finder would hand this checkout's plugins/ to the stale copy (a silent
# mix of two versions); drop it so the process sees what it sees under a non-editable install.
AS_NON_EDITABLE = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
    "if 'Editable' not in getattr(f, '__name__', type(f).__name__)]; "
)


@pytest.mark.slow
def test_a_shadowing_copy_that_cannot_load_plugins_is_named_once_per_process(tmp_path):
    stale = stale_checkout(tmp_path / "old")
    # accelerate: the import that activates outside a launched rank (accel_npu/activation/triggers.py)
    proc = subprocess.run(
        [sys.executable, "-c", AS_NON_EDITABLE + "import torch, accelerate"],
        cwd=tmp_path,
        env=base_env(PYTHONPATH=str(stale)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, explain(proc)
    lines = plugin_loading_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert f"accel_npu is imported from {stale / 'accel_npu'}, not the installed accel-npu at" in lines[0]
    assert "cannot import accel_npu.plugins (ModuleNotFoundError" in lines[0]
    # accel-npu env says the same
    env_out = subprocess.run(
        [
            sys.executable,
            "-c",
            AS_NON_EDITABLE + "from accel_npu.cli import main; sys.exit(main(['env', '--no-import']))",
        ],
        cwd=tmp_path,
        env=base_env(PYTHONPATH=str(stale)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert f"shadowed                accel_npu is imported from {stale / 'accel_npu'}" in env_out.stdout, explain(
        env_out
    )
    assert "cannot import accel_npu.plugins" in env_out.stdout


@pytest.mark.slow
def test_launcher_refuses_workers_that_would_not_activate(tmp_path):
    """Launched from inside a stale checkout: the DeepSpeed launcher would put it first on the
    workers' PYTHONPATH. Refused before any worker starts (the script would write a file)."""
    stale = stale_checkout(tmp_path / "old")
    shutil.copy(REPO / "launch_configs" / "cpu_zero2.yaml", stale / "zero2.yaml")
    shutil.copy(REPO / "launch_configs" / "cpu_zero2.deepspeed.json", stale / "cpu_zero2.deepspeed.json")
    (tmp_path / "train.py").write_text("open('worker-started', 'w').close()\n")
    proc = accelerate_launch(["--config_file", "zero2.yaml", str(tmp_path / "train.py")], cwd=stale)
    assert proc.returncode == 1, explain(proc)
    assert not (stale / "worker-started").exists()
    assert "Traceback" not in proc.stderr, explain(proc)
    assert (
        f"LaunchError: accel-npu: refusing to start workers: workers would import accel_npu from {stale / 'accel_npu'} "
        "(first on their sys.path through PYTHONPATH)" in proc.stderr
    ), explain(proc)


@pytest.mark.slow
def test_first_run_needs_no_cxx_toolchain(tmp_path):
    """A first run (empty JIT cache) on a machine without a C++ compiler. Stock: DeepSpeed's CPU
    accelerator compiles its shm all-reduce op while setting up the process group and dies. Ours:
    trains without building it (ZeRO training never uses that op)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("cpu_zero2.yaml", "cpu_zero2.deepspeed.json"):  # beside the working directory: stock finds it
        shutil.copy(REPO / "launch_configs" / name, run_dir / name)

    def launch(**extra):
        env = base_env(CXX=str(tmp_path / "no-compiler" / "g++"), TORCH_EXTENSIONS_DIR=str(tmp_path / "jit"), **extra)
        return accelerate_launch(
            ["--config_file", "cpu_zero2.yaml", str(SCRIPTS / "report_activation.py")], cwd=run_dir, env=env
        )

    stock = launch(ACCEL_NPU_DISABLE="1")
    assert stock.returncode != 0 and "Error building extension 'deepspeed_shm_comm'" in stock.stderr, explain(stock)
    ours = launch()
    assert ours.returncode == 0, explain(ours)
    assert [r["world_size"] for r in results(ours)] == [2, 2]
    assert not list((tmp_path / "jit").rglob("*.so")), "nothing was compiled"
