"""Every hook is documented with its exact signature, called by accel-npu, and exercised by a test."""
import inspect
import re
from pathlib import Path

import pytest

from accel_npu import hookspecs

REPO = Path(__file__).resolve().parents[1]
HOOKS = sorted(n for n in dir(hookspecs) if n.startswith("accel_npu_"))


def signature_text(name: str) -> str:
    fn = getattr(hookspecs, name)
    sig = inspect.signature(fn)
    params = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"{name}({params}) -> {sig.return_annotation}"


def test_docs_list_exactly_the_declared_hooks():
    doc = (REPO / "docs" / "plugin_hooks.md").read_text()
    documented = set(re.findall(r"^### `(accel_npu_\w+)\(", doc, flags=re.M))
    assert documented == set(HOOKS)


@pytest.mark.parametrize("name", HOOKS)
def test_hook_documented_with_exact_signature(name):
    doc = (REPO / "docs" / "plugin_hooks.md").read_text()
    assert f"### `{signature_text(name)}`" in doc


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_called_and_tested(name):
    code = "\n".join(p.read_text() for p in list((REPO / "accel_npu").rglob("*.py")) +
                     list((REPO / "plugins").rglob("*.py")))
    assert f"hook.{name}" in code, f"{name} is declared but accel-npu never calls it"
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py")
                      if p.name != Path(__file__).name)
    assert name in tests, f"no test exercises {name}"
