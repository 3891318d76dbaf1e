"""The layout holds: no import cycles, layers import downwards, one reader per environment
variable, every package installed.

Read off the source with ``ast`` (every import statement, at module level or inside a function),
so a cycle hidden in a function-level import counts too; only ``if TYPE_CHECKING:`` imports,
which never run, are left out.
"""

import ast
import configparser
import re
from pathlib import Path

from tests.launch_utils import REPO

#: source folder -> the package it is installed as (setup.cfg package_dir)
ROOTS = {"accel_npu": REPO / "accel_npu", "accel_npu.plugins": REPO / "plugins"}


def modules() -> dict[str, Path]:
    """{dotted module name: file} of accel_npu and the built-in plugins."""
    out = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if package == "accel_npu" and parts[:1] == ["plugins"]:
                continue
            out[".".join([package, *parts])] = path
    return out


MODULES = modules()


def imports_of(name: str, path: Path) -> set[str]:
    """accel_npu modules ``name`` imports anywhere in its file (resolved to module names)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    # `if TYPE_CHECKING:` blocks never run: their imports are for annotations, not dependencies
    type_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                base = ".".join(parent[: len(parent) - node.level + 1] + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_checker_sees_cycles_and_relative_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "accel_npu.plugins.loading.slots" in GRAPH["accel_npu.plugins.loading.placement.local"]


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_framework_imports_no_plugin():
    framework = {n: deps for n, deps in GRAPH.items() if not n.startswith("accel_npu.plugins")}
    offenders = {n: sorted(d for d in deps if d.startswith("accel_npu.plugins")) for n, deps in framework.items()}
    assert not {n: d for n, d in offenders.items() if d}


def test_the_bottom_layer_imports_only_environment_and_errors():
    allowed = {"accel_npu.environment", "accel_npu.errors", "accel_npu"}
    for name, deps in GRAPH.items():
        if name.startswith("accel_npu._torch"):
            assert {d for d in deps if not d.startswith("accel_npu._torch")} <= allowed, (name, deps)


def test_plugins_do_not_import_each_other():
    """A plugin package imports the framework and its own modules; shared code goes to accel_npu._torch."""

    def plugin_of(name: str) -> str:  # accel_npu.plugins.<concern>
        return ".".join(name.split(".")[:3])

    for name, deps in GRAPH.items():
        if not name.startswith("accel_npu.plugins."):
            continue
        others = {d for d in deps if d.startswith("accel_npu.plugins.") and plugin_of(d) != plugin_of(name)}
        assert not others, (name, others)


def test_wrapt_style_wrappers_live_in_plugins():
    signature = re.compile(r"def \w+\(wrapped, (instance|cls|accelerator)\b")
    for name, path in MODULES.items():
        if not name.startswith("accel_npu.plugins"):
            assert not signature.search(path.read_text()), name


def wrapt_wrappers(source: str) -> list[str]:
    """Functions (nested ones too) with wrapt's ``(wrapped, instance, args, kwargs)`` signature."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
            if len(params) == 4 and params[0] == "wrapped":
                found.append(node.name)
    return found


#: plugin __init__.py files that may still define wrappers inline
WRAPPERS_IN_INIT_ALLOWED: set[str] = set()  # none: every plugin package's __init__ is a manifest


def test_the_wrapper_finder_sees_nested_and_module_level_wrappers():
    source = (
        "def outer(name):\n    def wrapper(wrapped, instance, args, kwargs):\n        pass\n    return wrapper\n"
        "def on_init(wrapped, cls, args, kwargs):\n    pass\n"
        "def helper(wrapped, args):\n    pass\ndef other(model, instance, args, kwargs):\n    pass\n"
    )
    assert sorted(wrapt_wrappers(source)) == ["on_init", "wrapper"]


def test_plugin_inits_are_manifests():
    """A plugin package's __init__.py declares its patches (wrappers named by path in ``wrapper=``) and
    hook implementations; the wrappers themselves live in the modules beside it."""
    offenders = {}
    for path in sorted((REPO / "plugins").rglob("__init__.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in WRAPPERS_IN_INIT_ALLOWED:
            continue
        wrappers = wrapt_wrappers(path.read_text())
        if wrappers:
            offenders[rel] = wrappers
    assert not offenders, f"wrappers defined in a plugin's __init__.py (move them beside it): {offenders}"


ENV_READ = re.compile(
    r"""(environ|env)(\.get\(|\[|\.setdefault\(|\.pop\()\s*["']ACCEL_NPU_|getenv\(\s*["']ACCEL_NPU_"""
)


#: The startup hook accel_npu_startup.pth imports in every Python process (setup.py), beside the package.
STARTUP_HOOK = REPO / "_accel_npu_startup.py"


def test_one_reader_per_environment_variable():
    """ACCEL_NPU_* variables are read through accel_npu.environment only (the worker bootstrap and the
    startup hook keep one stdlib-only copy each of the ACCEL_NPU_DISABLE check: they run before
    accel_npu is imported, in processes that may never import it)."""
    allowed = {"accel_npu.environment", "accel_npu.activation._bootstrap.sitecustomize", "_accel_npu_startup"}
    readers = {
        name
        for name, path in [*MODULES.items(), ("_accel_npu_startup", STARTUP_HOOK)]
        if ENV_READ.search(path.read_text())
    }
    assert readers <= allowed, sorted(readers - allowed)
    assert ENV_READ.search('os.environ.get("ACCEL_NPU_X")') and ENV_READ.search("env.get('ACCEL_NPU_BACKEND', '')")
    copies = re.findall(r"""environ\.get\(\s*["'](ACCEL_NPU_\w+)""", STARTUP_HOOK.read_text())
    assert copies == ["ACCEL_NPU_DISABLE"], copies


def test_the_startup_hook_imports_nothing_at_startup():
    """Module level: the standard library modules every interpreter has loaded before site runs .pth
    files. accel_npu only inside the finder, once torch_npu is being imported: the environment and
    the npu plugin's diagnostics (the one plugin module it names, as manager.py names every plugin)."""
    tree = ast.parse(STARTUP_HOOK.read_text())
    top = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert top <= {"_thread", "os", "sys"}, top
    lazy = {
        (node.module or "") + ":" + alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert lazy == {"accel_npu:environment", "accel_npu.plugins.devices.npu.diagnostics:install_import_diagnostics"}, (
        lazy
    )


def test_the_startup_hook_reads_accel_npu_disable_as_environment_does(monkeypatch):
    import _accel_npu_startup
    from accel_npu import environment

    for value in ("1", "true", " Yes ", "on", "0", "", "no", "2", "off"):
        monkeypatch.setenv("ACCEL_NPU_DISABLE", value)
        assert _accel_npu_startup._disabled() == environment.disabled(), value


def test_setup_cfg_lists_every_package():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    listed = {p.strip() for p in cfg["options"]["packages"].split("\n") if p.strip()}
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    packages.add("accel_npu.launch_configs")
    assert listed == packages, (sorted(packages - listed), sorted(listed - packages))


def positional_reads(source: str) -> list[str]:
    """``wrapper:args[<int>]`` for each wrapt-style wrapper (nested ones too) that subscripts its ``args``
    with a number: a parameter read by position alone, which misses the same parameter passed by keyword."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
        if len(params) != 4 or params[0] != "wrapped":
            continue
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Subscript)
                and isinstance(sub.value, ast.Name)
                and sub.value.id == params[2]
                and isinstance(sub.slice, ast.Constant)
                and isinstance(sub.slice.value, int)
            ):
                found.append(f"{node.name}:{params[2]}[{sub.slice.value}]")
    return found


#: wrappers that may read ``args[<int>]``: where the position is not one named parameter, so
#: ``accel_npu.patching.argument`` (a parameter by position or keyword) does not apply
POSITIONAL_READS_ALLOWED = {
    # Tensor.to / Module.to are overloaded (device, dtype or a tensor first); the device keyword is read
    # on its own, and the hot path avoids another call
    "accel_npu.plugins.cuda_compat.tensors": {"to:args[0]"},
    # Event.__new__ / Stream.__new__: args[0] is the class itself (a staticmethod), never a keyword
    "accel_npu.plugins.cuda_compat.classes": {"event_new:args[0]", "stream_new:args[0]"},
}


def test_the_positional_read_finder_sees_wrappers_only():
    source = (
        "def outer():\n    def wrapper(wrapped, instance, a, kw):\n        return a[1]\n    return wrapper\n"
        "def w(wrapped, instance, args, kwargs):\n    x = args[1:]\n    return argument(args, kwargs, 0, 'x')\n"
        "def helper(args):\n    return args[0]\n"
    )
    assert positional_reads(source) == ["wrapper:a[1]"]


def test_wrappers_read_arguments_by_name_and_position():
    """A wrapper reads a parameter of the wrapped call with ``accel_npu.patching.argument`` (and replaces it
    with ``with_argument``), which finds it however the caller passed it."""
    offenders, unused = {}, {}
    for name, path in MODULES.items():
        if not name.startswith("accel_npu.plugins"):
            continue
        reads = set(positional_reads(path.read_text()))
        allowed = POSITIONAL_READS_ALLOWED.get(name, set())
        if reads - allowed:
            offenders[name] = sorted(reads - allowed)
        if allowed - reads:
            unused[name] = sorted(allowed - reads)
    assert not unused, f"allowed positional reads that are gone (drop them from the list): {unused}"
    assert not offenders, f"args[<int>] in wrappers (use accel_npu.patching.argument / with_argument): {offenders}"


def test_vendored_upstream_files_live_in_third_party_only():
    """Upstream files vendored byte for byte (a folder with a SHA256SUMS) sit under the top-level third_party/,
    which ruff (pyproject.toml extend-exclude) and duplicate-code tools skip; benchmarks/ holds measurements only
    (the compatibility runner is tools/compatibility.py)."""
    skip = {"third_party", "build", "dist", "tmp", "out", "outputs"}
    outside = [
        path.relative_to(REPO).as_posix()
        for top in REPO.iterdir()
        if top.is_dir() and not top.name.startswith(".") and top.name not in skip
        for path in top.rglob("SHA256SUMS")
    ]
    assert not outside, outside
    assert list((REPO / "third_party").glob("*/SHA256SUMS"))
    assert '"third_party"' in (REPO / "pyproject.toml").read_text().split("extend-exclude", 1)[1].splitlines()[0]
    assert not (REPO / "benchmarks" / "compatibility.py").exists() and (REPO / "tools" / "compatibility.py").is_file()
