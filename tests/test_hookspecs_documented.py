"""Every hook is documented with its exact signature and called by accel-npu's own call sites."""

import argparse
import inspect
import re
import types
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


class Recorder:
    """A plugin that implements every hook and records the calls that reach it."""

    def __init__(self):
        self.seen: set[str] = set()


def _recording(name):
    """An implementation of hook ``name`` with its exact parameters, recording that it was called."""

    def impl(self, *args, **kwargs):
        self.seen.add(name)
        return [] if name == "accel_npu_register_patches" else None

    impl.__name__ = name
    params = [
        inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for p in ["self", *inspect.signature(getattr(hookspecs, name)).parameters]
    ]
    impl.__signature__ = inspect.Signature(params)
    return hookspecs.hookimpl(impl)


for _name in HOOKS:
    setattr(Recorder, _name, _recording(_name))


def _trigger_all():
    """accel-npu's own call sites of every hook, in-process."""
    from accelerate.utils import DeepSpeedPlugin

    from accel_npu import activation
    from accel_npu.backend import current_backend, reset_backend_cache
    from accel_npu.cli import build_parser
    from accel_npu.cli.config.settings import worker_tuning
    from accel_npu.cli.env import collect
    from accel_npu.plugins.deepspeed.prepare import before_engine
    from accel_npu.plugins.explain_errors.excepthook import explanations
    from accel_npu.plugins.launch.launcher import _validate_launch_command as validate_launch_command
    from accel_npu.plugins.launch.launcher import prepare_worker_environment

    return {
        "accel_npu_select_backend": lambda: (reset_backend_cache(), current_backend()),
        "accel_npu_register_patches": activation._activate,
        "accel_npu_activate": activation._activate,
        "accel_npu_launch_env": lambda: prepare_worker_environment(1, {}),
        "accel_npu_check_launch": lambda: prepare_worker_environment(1, {}),
        "accel_npu_worker_tuning": lambda: worker_tuning("npu"),
        "accel_npu_env_report": lambda: collect(import_targets=False),
        "accel_npu_add_commands": build_parser,
        "accel_npu_selftest_checks": lambda: __import__("accel_npu.cli.selftest", fromlist=["x"]).checks_for(
            current_backend()
        ),
        "accel_npu_configure_deepspeed": lambda: DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 1}}),
        "accel_npu_explain_error": lambda: explanations(RuntimeError("an uncaught error")),
        "accel_npu_launch_args": lambda: validate_launch_command(
            lambda args: (args, {}, False), None, (_launch_args(),), {}
        ),
        "accel_npu_prepare_deepspeed": lambda: before_engine(types.SimpleNamespace(parallelism_config=None), ()),
    }


def _launch_args():
    """What ``accelerate launch`` parses for ``--num_processes 1 train.py``, the fields the hooks read."""
    fields = ("multi_gpu", "use_deepspeed", "use_fsdp", "use_megatron_lm", "tpu", "cpu", "use_parallelism_config")
    return argparse.Namespace(num_processes=1, num_machines=1, mpirun_hostfile=None, **dict.fromkeys(fields, False))


def test_every_hook_is_called_by_accel_npu_itself(fresh_pm):
    """Each hook reaches a plugin through accel-npu's real call site (not a name found in a file)."""
    from accel_npu.manager import get_plugin_manager

    triggers = _trigger_all()
    assert set(triggers) == set(HOOKS), "a new hook needs its call site here"
    recorder = Recorder()
    get_plugin_manager().register(recorder, name="recorder")
    for name, trigger in triggers.items():
        recorder.seen.discard(name)
        trigger()
        assert name in recorder.seen, f"{name}: accel-npu's call site did not call it"
