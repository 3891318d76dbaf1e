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


def _is_hookimpl(function: ast.FunctionDef) -> bool:
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if getattr(target, "id", getattr(target, "attr", None)) == "hookimpl":
            return True
    return False


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Every statement in ``body``, nested ones included, a leading docstring left out."""
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [n for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.stmt)]


#: how many statements a hook implementation in a manifest may have: return a declaration, or import
#: the module beside it and delegate
HOOKIMPL_STATEMENTS = 3
#: the package's own path as a string: a wrapper named absolutely, or a `_PKG = "accel_npu.plugins.x"` constant
OWN_PACKAGE_PATH = re.compile(r"^accel_npu\.plugins\.[\w.]+(:[\w.]+)?$")


def wrapper_problems(source: str) -> list[str]:
    """Where a plugin module names a wrapper other than by a path relative to its package (".module:function")."""
    tree = ast.parse(source)
    problems = []
    factory_parameters = {a.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) for a in node.args.args}
    docstring = ast.get_docstring(tree, clean=False)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value != docstring:
            if OWN_PACKAGE_PATH.match(node.value):
                problems.append(f"line {node.lineno}: {node.value!r} names the plugin's package absolutely")
        if not isinstance(node, ast.Call):
            continue
        for keyword in node.keywords:
            if keyword.arg != "wrapper":
                continue
            value = keyword.value
            if isinstance(value, ast.JoinedStr) and value.values:
                value = value.values[0]
            if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value.startswith("."):
                continue
            if isinstance(value, ast.Name) and value.id in factory_parameters:
                continue  # a Patch factory's parameter: its callers pass the path
            problems.append(f"line {node.lineno}: wrapper={ast.unparse(keyword.value)} is not a relative path")
    return problems


def manifest_problems(source: str) -> list[str]:
    """Where a plugin's __init__.py is more than a manifest: imports, a docstring, constants and
    ``Patch`` declarations (Patch factories: one ``return Patch(...)``), hook implementations that return
    a declaration or delegate in a line or two; wrappers named by relative path."""
    problems = wrapper_problems(source)
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.FunctionDef):
            body = _statements(node.body)
            if _is_hookimpl(node):
                if len(body) > HOOKIMPL_STATEMENTS or any(
                    isinstance(s, (ast.For, ast.While, ast.Try, ast.With, ast.If)) for s in body
                ):
                    problems.append(f"line {node.lineno}: hook {node.name} does more than declare or delegate")
                continue
            returns = body[0].value if len(body) == 1 and isinstance(body[0], ast.Return) else None
            if isinstance(returns, ast.Call) and getattr(returns.func, "id", None) == "Patch":
                continue
            problems.append(f"line {node.lineno}: function {node.name} is neither a hook nor a Patch factory")
            continue
        problems.append(f"line {node.lineno}: {type(node).__name__} at the top of a manifest")
    return problems


def test_the_manifest_checker_sees_logic_helpers_and_absolute_paths():
    good = (
        '"""Doc naming accel_npu.plugins.x is fine."""\nfrom accel_npu.patching import Patch\n'
        'P = Patch(target="m:f", supports="x", reason="r", remove_when="w", wrapper=".mod:fn")\n'
        'Q = [Patch(target=f"m:{n}", supports="x", reason="r", remove_when="w", wrapper=f".mod:{n}") for n in "ab"]\n'
        "def _factory(name, wrapper):\n    return Patch(target=name, supports='x', reason='', remove_when='',"
        " wrapper=wrapper)\n"
        "@hookimpl\ndef accel_npu_register_patches():\n    return [P, *Q]\n"
        "@hookimpl(tryfirst=True)\ndef accel_npu_env_report(backend):\n    from . import report\n\n"
        "    return report.section(backend)\n"
    )
    assert manifest_problems(good) == []
    bad = {
        "absolute": 'P = Patch(target="m:f", supports="x", reason="r", remove_when="w", '
        'wrapper="accel_npu.plugins.x.mod:fn")\n',
        "pkg constant": '_PKG = "accel_npu.plugins.x"\n',
        "callable": 'P = Patch(target="m:f", supports="x", reason="r", remove_when="w", wrapper=fn)\n',
        "helper": "def helper(env):\n    return env.get('X')\n",
        "long hook": "@hookimpl\ndef accel_npu_check_launch(env):\n    a = 1\n    b = 2\n    c = 3\n    return a\n",
        "logic in a hook": "@hookimpl\ndef accel_npu_check_launch(env):\n    if env:\n        raise X\n",
        "class": "class Finder:\n    pass\n",
        "top-level logic": "for name in ():\n    pass\n",
    }
    for what, source in bad.items():
        assert manifest_problems(source), what


def builtin_plugin_files() -> dict[str, Path]:
    """{plugin name: its file} of the built-in plugins (accel_npu.manager.DEFAULT_PLUGINS)."""
    from accel_npu.manager import DEFAULT_PLUGINS

    return {name: MODULES[module] for name, module in DEFAULT_PLUGINS}


def test_plugin_inits_hold_declarations_only():
    """Every plugin package's __init__.py (and the folders' between them) reads in a minute: what the
    plugin patches and which hooks it implements; the logic sits in the modules beside it. The root
    plugins/__init__.py is no plugin: it refuses an import under another name."""
    inits = sorted((REPO / "plugins").rglob("__init__.py"))
    assert {p for p in builtin_plugin_files().values() if p.name == "__init__.py"} <= set(inits)
    offenders = {
        path.relative_to(REPO).as_posix(): problems
        for path in inits
        if path != REPO / "plugins" / "__init__.py" and (problems := manifest_problems(path.read_text()))
    }
    assert not offenders, offenders


def test_builtin_plugins_name_wrappers_by_relative_path():
    """Module plugins too (devices/cpu.py, launch/*.py): `wrapper=".module:function"`, no `_PKG` constant."""
    offenders = {
        name: problems
        for name, path in builtin_plugin_files().items()
        if (problems := wrapper_problems(path.read_text()))
    }
    assert not offenders, offenders


def plugin_name_problems(plugins, essential, aliases) -> list[str]:
    """Where a built-in plugin's name is not its module path inside accel_npu.plugins, or an alias or
    essential plugin names no built-in plugin."""
    names = {name for name, _ in plugins}
    problems = [f"{name}: module {module}" for name, module in plugins if module != f"accel_npu.plugins.{name}"]
    problems += [f"alias {old} -> {new}: no such plugin" for old, new in aliases.items() if new not in names]
    problems += [f"alias {old}: a plugin's own name" for old in aliases if old in names]
    problems += [f"essential {name}: no such plugin" for name in essential if name not in names]
    return problems


def test_builtin_plugin_names_are_their_module_paths_and_aliases_name_plugins():
    from accel_npu import manager
    from accel_npu.environment import PLUGIN_ALIASES

    assert plugin_name_problems(manager.DEFAULT_PLUGINS, manager.ESSENTIAL_PLUGINS, PLUGIN_ALIASES) == []
    assert all(module in MODULES for _, module in manager.DEFAULT_PLUGINS)


def test_the_plugin_name_checker_sees_other_names_and_dangling_aliases():
    good = (("devices.npu", "accel_npu.plugins.devices.npu"), ("deepspeed", "accel_npu.plugins.deepspeed"))
    assert plugin_name_problems(good, {"deepspeed": ""}, {"npu": "devices.npu"}) == []
    assert plugin_name_problems((("npu", "accel_npu.plugins.devices.npu"),), {}, {})
    assert plugin_name_problems(good, {}, {"launcher": "launch.launcher"})
    assert plugin_name_problems(good, {}, {"deepspeed": "devices.npu"})
    assert plugin_name_problems(good, {"deepspeed_setup": ""}, {})


def test_test_markers_are_strict_and_process_starting_tests_are_guarded():
    """Every marker a test uses is declared (``--strict-markers``), ``slow`` among them, and the conftest installs
    the guard that fails an unmarked test which starts a process (tests/test_process_guard.py tests the guard)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    pytest_section = config["tool:pytest"]
    assert "--strict-markers" in pytest_section["addopts"].split()
    declared = {line.split(":", 1)[0].strip() for line in pytest_section["markers"].strip().splitlines()}
    assert {"slow", "contract", "official_matrix"} <= declared, declared
    conftest = (REPO / "tests" / "conftest.py").read_text()
    assert "process_guard.install(" in conftest and 'get_closest_marker("slow")' in conftest


def _missing_cross_imports(sources: dict[str, str]) -> list[str]:
    """``from tests.X import name`` (at any depth: most are inside test functions) naming what tests/X.py does
    not define at its top level. Such an import fails only when that test runs, so a rename breaks tests
    that nothing else exercises until CI; ``sources`` maps a module name (``tests.launch_utils``) to its text."""
    trees = {module: ast.parse(text) for module, text in sources.items()}
    defined = {}
    for module, tree in trees.items():
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        defined[module] = names
    missing = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in defined:
                missing += [
                    f"{module}: {node.module}.{a.name}" for a in node.names if a.name not in defined[node.module]
                ]
    return missing


def _test_helper_sources() -> dict[str, str]:
    files = [*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py"), *(REPO / "tools").rglob("*.py")]
    return {".".join(f.relative_to(REPO).with_suffix("").parts): f.read_text() for f in files}


def test_names_imported_from_test_modules_exist():
    assert _missing_cross_imports(_test_helper_sources()) == []


def test_the_cross_import_checker_sees_a_renamed_name():
    sources = {
        "tests.a": "X = 1\ndef f(): pass\nfrom os import path\n",
        "tests.b": "def test():\n    from tests.a import X, f, path, GONE\n",
    }
    assert _missing_cross_imports(sources) == ["tests.b: tests.a.GONE"]
