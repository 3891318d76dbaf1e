"""The docs that describe the tree match it: README's layout line names every plugin package,
docs/developing.md's map names every module and every hook, and docs/patches.md is the ledger's
current table (``accel-npu env --patch-table``). Fast: reads files."""

from __future__ import annotations

import re
from pathlib import Path

from accel_npu import hookspecs
from accel_npu.cli.env import patch_table

REPO = Path(__file__).resolve().parents[1]


def _words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def _map() -> str:
    text = (REPO / "docs" / "developing.md").read_text()
    return text.split("## Where code goes\n```\n", 1)[1].split("```", 1)[0]


def test_readme_layout_names_every_plugin_package():
    layout = (REPO / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    packages = {p.parent.name for p in (REPO / "plugins").glob("*/__init__.py")}
    assert packages - _words(layout) == set(), "README.md's Layout does not name these plugin packages"


def test_developing_map_names_every_module_package_and_hook():
    words = _words(_map())
    names = set()
    for root in (REPO / "accel_npu", REPO / "plugins"):
        for path in root.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            names.add(path.stem)
            names.update(part for part in path.relative_to(root).parent.parts)
    names -= {"__init__"}
    assert names - words == set(), "docs/developing.md's map ('Where code goes') does not name these"
    hooks = {n[len("accel_npu_") :] for n in dir(hookspecs) if n.startswith("accel_npu_")}
    assert hooks - words == set(), "docs/developing.md's map does not name these hooks"


def test_patches_doc_is_the_ledger_table():
    doc = (REPO / "docs" / "patches.md").read_text()
    assert doc == patch_table(), "docs/patches.md is out of date: run `accel-npu env --patch-table > docs/patches.md`"


def torch_npu_uses(source: str) -> tuple[bool, set[str]]:
    """(whether ``source`` imports torch_npu, the ``torch_npu.<name>`` attributes its code reads)."""
    import ast

    tree = ast.parse(source)
    imports = any(
        (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch_npu" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch_npu")
        for node in ast.walk(tree)
    )
    names = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch_npu"
    }
    return imports, names


def test_the_npu_contract_names_every_module_importing_torch_npu_and_what_it_calls():
    doc = (REPO / "docs" / "npu-contract.md").read_text()
    missing = []
    for root in (REPO / "accel_npu", REPO / "plugins"):
        for path in root.rglob("*.py"):
            imports, names = torch_npu_uses(path.read_text())
            if not imports:
                continue
            rel = path.relative_to(REPO).as_posix()
            missing += [rel] if rel not in doc else []
            missing += [f"{rel}: torch_npu.{n}" for n in sorted(names) if f"torch_npu.{n}" not in doc]
    assert not missing, f"docs/npu-contract.md does not name these torch_npu uses: {missing}"


def test_the_torch_npu_use_finder_sees_imports_and_attributes():
    assert torch_npu_uses("def f():\n    import torch_npu\n    return torch_npu.npu_x(1).y\n") == (True, {"npu_x"})
    assert torch_npu_uses("from torch_npu.npu import utils\n")[0] is True
    assert torch_npu_uses("import torch\nx = 'torch_npu.npu_x'\n") == (False, set())
