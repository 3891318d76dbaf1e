"""Attributes accel-npu sets on models and modules: the protocol between plugins, in one place."""

#: model attribute: how to rebuild a ZeRO-3-partitioned model whole from its files (loading -> frozen_towers)
REBUILD = "_accel_npu_rebuild"
#: model attribute: how to fill a model whose weights were left to FSDP's broadcast from rank 0
FILL = "_accel_npu_fill"
#: model attribute: the local directory a model was loaded from (loading -> frozen_towers)
SOURCE = "_accel_npu_source"
#: parent-module instance-dict key: {attribute: tower} of frozen towers kept out of the engine
HIDDEN_TOWERS = "_accel_npu_hidden_towers"
#: DeepSpeedPlugin attribute: where its DeepSpeed config came from (a path, "<script>", ...)
DS_CONFIG_SOURCE = "_accel_npu_ds_source"
#: module instance-dict key: the models one ``accelerator.prepare`` call put under one DeepSpeed engine, in
#: order, on the container module that engine wraps (deepspeed -> checkpoints: save/load hooks get the models)
MODELS_PREPARED_TOGETHER = "_accel_npu_models_prepared_together"
#: instance-dict key of accelerate's DeepSpeedEngineWrapper (``accelerator.deepspeed_engine_wrapped``) whose engine
#: steps at the script's ``optimizer.step()``, not inside ``accelerator.backward``: the callables to call after each
#: such step (deepspeed sets it, checkpoints adds its step boundary)
STEPS_AT_OPTIMIZER_STEP = "_accel_npu_steps_at_optimizer_step"


def models_prepared_together(module) -> tuple | None:
    """The models under ``module`` when it is the container of several models prepared together, else None."""
    return getattr(module, "__dict__", {}).get(MODELS_PREPARED_TOGETHER)


def hidden_towers(model) -> dict:
    """{dotted name: module} of every frozen tower kept out of the engine under ``model``."""
    out: dict = {}

    def visit(module, prefix: str) -> None:
        for attr, tower in (module.__dict__.get(HIDDEN_TOWERS) or {}).items():
            out[prefix + attr] = tower
        for child_name, child in module.named_children():
            visit(child, f"{prefix}{child_name}.")

    visit(model, "")
    return out


def tower_state_dict(model) -> dict:
    """State-dict entries of hidden towers, prefixed with their names (references, no copy)."""
    out = {}
    for name, tower in hidden_towers(model).items():
        for key, value in tower.state_dict().items():
            out[f"{name}.{key}"] = value
    return out
