"""Validate written configs with accelerate's and DeepSpeed's own parsers (stock, accel-npu off).

Run as a script in a fresh process: ``python tests/config_checks.py YAML...`` from the directory
the launch would use. For each YAML it does what ``accelerate launch`` does before starting
workers (parse, ``_validate_launch_command``, ``prepare_deepspeed_cmd_env``), then what a worker
does (``DeepSpeedPlugin`` from that environment, including the 7.10 check), then DeepSpeed's own
``DeepSpeedConfig`` / ``DeepSpeedZeroConfig`` on the JSON with the "auto" values filled the way
accelerate fills them; and the sequence-parallel size the workers get from a ``parallelism_config`` section.
Prints one ``CHECKED {json}`` line per file; exits non-zero on the first failure.
"""

import copy
import json
import os
import sys


def check(yaml_path: str) -> dict:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    cluster = load_config_from_file(yaml_path)
    # a free port: accelerate refuses a busy one on machine rank 0 (the YAML's port is a template value)
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    args = launch_command_parser().parse_args(["--config_file", yaml_path, "--main_process_port", port, "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    out = {
        "file": yaml_path,
        "distributed_type": str(cluster.distributed_type.value),
        "num_processes": cluster.num_processes,
        "num_machines": cluster.num_machines,
    }
    if cluster.distributed_type.value != "DEEPSPEED":
        out["mixed_precision"] = cluster.mixed_precision
        return out
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _cmd, env = prepare_deepspeed_cmd_env(args)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        plugin = DeepSpeedPlugin()  # a worker's view: raises on 7.10 and on unreadable JSON
    finally:
        os.environ.clear()
        os.environ.update(saved)
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds = copy.deepcopy(plugin.deepspeed_config)
    micro = ds["train_micro_batch_size_per_gpu"]
    micro = 2 if micro == "auto" else micro
    ga = ds["gradient_accumulation_steps"]
    ga = 1 if ga == "auto" else ga
    ds.update(
        train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=ga, train_batch_size=micro * ga
    )  # world size 1 outside a launch
    zero = DeepSpeedZeroConfig(**ds["zero_optimization"])
    parsed = DeepSpeedConfig(ds)
    out.update(
        ds_file=env["ACCELERATE_DEEPSPEED_CONFIG_FILE"],
        zero_stage=int(zero.stage),
        offload_optimizer=str(getattr(zero.offload_optimizer.device, "value", zero.offload_optimizer.device))
        if zero.offload_optimizer
        else None,
        offload_param=str(getattr(zero.offload_param.device, "value", zero.offload_param.device))
        if zero.offload_param
        else None,
        bf16=bool(parsed.bfloat16_config.enabled),
        fp16=bool(parsed.float16_config.enabled),
        accelerate_mixed_precision=env.get("ACCELERATE_MIXED_PRECISION"),
        ds_fields=env.get("ACCELERATE_CONFIG_DS_FIELDS"),
        persistence_threshold=int(zero.param_persistence_threshold),
        gather_16bit_on_save=bool(zero.gather_16bit_weights_on_model_save),
        reduce_bucket_size=int(zero.reduce_bucket_size),
        multinode_launcher=getattr(args, "deepspeed_multinode_launcher", None),
        # the YAML's parallelism_config section, as the launcher resolves it and hands it to the workers
        use_parallelism_config=bool(args.use_parallelism_config),
        sp_size=int(env.get("PARALLELISM_CONFIG_SP_SIZE", "1")),
    )
    return out


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print("CHECKED " + json.dumps(check(path)), flush=True)
