"""plugins/launch/settings.py in the launcher process: which config is launched, how its sidecar
is applied (the shell wins), broken sidecars, and deepspeed_config_file resolution rules —
with accelerate's real `accelerate launch` argument parser."""

from __future__ import annotations

import pytest

from accel_npu.errors import ConfigError
from accel_npu.plugins.launch import settings as launch_settings


def parse(*argv: str):
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser().parse_args([*argv, "train.py"])


def test_sidecar_sets_only_what_the_shell_does_not(tmp_path, capsys):
    cfg = tmp_path / "a.yaml"
    cfg.write_text("distributed_type: NO\n")
    (tmp_path / "a.accel-npu.yaml").write_text(
        "backend: cpu\nenv:\n  TASK_QUEUE_ENABLE: 2\n  X_FLAG: true\n  ACCEL_NPU_LOAD_SLOTS: '1'\n"
    )
    environ = {"ACCEL_NPU_LOAD_SLOTS": "4"}
    applied, kept = launch_settings.apply_sidecar(str(cfg), environ)
    assert applied == {"TASK_QUEUE_ENABLE": "2", "X_FLAG": "true"} and kept == {"ACCEL_NPU_LOAD_SLOTS": "4"}
    assert environ == {"ACCEL_NPU_LOAD_SLOTS": "4", "TASK_QUEUE_ENABLE": "2", "X_FLAG": "true"}
    assert "kept from your environment: ACCEL_NPU_LOAD_SLOTS=4" in capsys.readouterr().err
    # no sidecar: nothing happens
    assert launch_settings.apply_sidecar(str(tmp_path / "other.yaml"), environ) == ({}, {})


@pytest.mark.parametrize(
    "text, message",
    [
        ("env: [1, 2\n", "cannot read the launch settings"),
        ("- a\n- b\n", "must be a mapping with an 'env:' mapping"),
        ("env:\n  'A=B': 1\n", "'A=B' is not an environment variable name"),
    ],
)
def test_broken_sidecar_is_one_error_naming_the_file(tmp_path, text, message):
    cfg = tmp_path / "a.yaml"
    (tmp_path / "a.accel-npu.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        launch_settings.apply_sidecar(str(cfg), {})
    assert str(tmp_path / "a.accel-npu.yaml") in str(info.value)


def test_launched_config_file_follows_accelerates_rules(tmp_path, monkeypatch):
    import accelerate.commands.launch as launch

    assert launch_settings.launched_config_file(parse("--config_file", "x.yaml")) == "x.yaml"
    default = tmp_path / "default_config.yaml"
    monkeypatch.setattr(launch, "default_config_file", str(default))
    assert launch_settings.launched_config_file(parse()) is None  # no default file: none launched
    default.write_text("distributed_type: NO\n")
    assert launch_settings.launched_config_file(parse()) == str(default)
    assert launch_settings.launched_config_file(parse("--cpu")) is None  # accelerate ignores it with --cpu


def test_relative_deepspeed_file_is_resolved_next_to_the_yaml_unless_given_on_the_command_line(tmp_path):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    (cfg_dir / "ds.json").write_text("{}")
    cfg = cfg_dir / "a.yaml"
    cfg.write_text(
        "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
    )
    args = parse("--config_file", str(cfg))
    assert launch_settings.resolve_deepspeed_config_file(str(cfg), args) == str(cfg_dir / "ds.json")
    assert args.deepspeed_config_file == str(cfg_dir / "ds.json") and "deepspeed_config_file" in args.nondefault
    # accelerate's own merge of the config does not put the relative value back
    from accelerate.commands import launch

    from accel_npu.patching import original_of

    validate = original_of("accelerate.commands.launch:_validate_launch_command") or launch._validate_launch_command
    validated, _defaults, _mp = validate(args)
    assert validated.deepspeed_config_file == str(cfg_dir / "ds.json")

    given = parse("--config_file", str(cfg), "--deepspeed_config_file", "ds.json")
    assert launch_settings.resolve_deepspeed_config_file(str(cfg), given) is None
    assert given.deepspeed_config_file == "ds.json"  # typed by the user: relative to the cwd, as stock

    (cfg_dir / "ds.json").unlink()  # nothing next to the YAML: stock behaviour
    args = parse("--config_file", str(cfg))
    assert launch_settings.resolve_deepspeed_config_file(str(cfg), args) is None
    assert args.deepspeed_config_file is None
