"""Several models with one optimizer over them, prepared together: one DeepSpeed engine.

accelerate 1.15 ``Accelerator.prepare`` refuses more than one model under DeepSpeed ("You can't use same
`Accelerator()` instance with multiple models when using DeepSpeed", accelerate/accelerator.py), because
``_prepare_deepspeed`` builds one engine and ``accelerator.backward`` steps one engine. diffusers v0.40.0's
examples/custom_diffusion/train_custom_diffusion.py with ``--modifier_token`` prepares
``custom_diffusion_layers, text_encoder, optimizer, ...`` together, the optimizer built over both models'
parameters (``itertools.chain``), as a DDP script may.

When exactly one optimizer is in the call and it holds every trainable parameter of every model (and
nothing else), the job is one engine's: the models become the children of one container module
(``ModelsTrainedTogether``) and DeepSpeed wraps that, owning the script's one optimizer as it asked.
``accelerator.backward`` is the engine's backward, ``optimizer.step()`` its step (below); ZeRO-3 registers its
gather hooks on every submodule of the container, so the script's direct calls of each model (and of the
UNet whose attention processors are custom_diffusion_layers) gather as they do for one model.

Each model's position in the result gets a ``PreparedTogether``: a ``DeepSpeedEngine`` (what stock gives
a model) whose ``.module`` is that model, so ``accelerator.unwrap_model`` and ``x.module`` (the script's
line 1194 under more than one process) reach the model; calling it calls the model; ``train()``/``eval()``
set that model alone; its ``state_dict()``/``parameters()`` are the model's; the engine's own methods
(``backward``, ``step``, ``save_checkpoint``, ``no_sync``, ...) are the shared engine's. accelerate's
``_models`` holds the one engine, so ``save_state``/``load_state`` write and read one DeepSpeed checkpoint
(``pytorch_model``) holding both models and the optimizer; the container's state dict is each model's
own, prefixed with its index, so models with state-dict hooks (diffusers' AttnProcsLayers renames its
keys) save and load as they do alone. Save/load hooks get the models themselves (the checkpoints plugin
reads ``accel_npu._torch.markers.models_prepared_together``).

The step is taken where the script takes it, at ``optimizer.step()``, as under DDP for which such a script is
written, not inside ``accelerator.backward`` (accelerate's DeepSpeedEngineWrapper.backward steps there for its one
model): such a script edits gradients between the two (train_custom_diffusion.py zeroes the embedding rows of all but
its new tokens, lines 1192-1205). DeepSpeed holds those gradients in its partitions (``param.grad`` None; under ZeRO-3
the parameter is a shape-[0] partition too): the gradient of a parameter the script reads there is shown as its
``param.grad`` and written back before ``engine.step()`` (shown_gradients.py: ``safe_get_full_grad`` /
``safe_set_full_grad``, the parameter gathered while shown under ZeRO-3). A backward at an accumulation boundary with a
step still pending (the script never called ``optimizer.step()``) takes it first.

Several models each with an optimizer of its own over exactly its trainable parameters (a GAN's generator and
discriminator, diffusers' vqgan/train_vqgan.py) get one engine each (engine_per_model.py). A trainable parameter the
one optimizer leaves out of a model whose other parameters it holds never changes under DDP: it is frozen
(``freeze_left_out``). Left as accelerate's assertion, with the reason appended: no optimizer, an optimizer over part
of several models, a model none of whose trainable parameters is in the optimizer (or an optimizer parameter outside
the models), a model with nothing to train, models sharing parameters, and accelerate's ``DummyOptim``.
"""

from __future__ import annotations

import logging

from accel_npu._torch.markers import MODELS_PREPARED_TOGETHER, STEPS_AT_OPTIMIZER_STEP
from accel_npu.plugins.deepspeed.engine_per_model import pairs_of, prepare_engine_per_model
from accel_npu.plugins.deepspeed.shown_gradients import GradientWindow

log = logging.getLogger("accel_npu")

#: accelerate's own message (accelerate/accelerator.py Accelerator.prepare), kept as the start of ours
STOCK_MESSAGE = "You can't use same `Accelerator()` instance with multiple models when using DeepSpeed"
#: instance-dict key of a PreparedTogether: the shared engine (not a submodule: its parameters are not ours)
_ENGINE = "_accel_npu_shared_engine"


def _optimizer_params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def why_not_together(models: list, others: list) -> str | None:
    """None when ``models`` can be one engine with the one optimizer among ``others``, else why not."""
    import torch

    optimizers = [o for o in others if isinstance(o, torch.optim.Optimizer)]
    dummy = [o for o in others if type(o).__name__ == "DummyOptim"]
    if dummy:
        return "accelerate's DummyOptim (the optimizer comes from the DeepSpeed config) with several models"
    if len(optimizers) != 1:
        return (
            f"{len(models)} models with {len(optimizers)} optimizers; one DeepSpeed engine owns one "
            "optimizer: use one optimizer over all the models' parameters, or one Accelerator per model"
        )
    in_optimizer = {id(p) for p in _optimizer_params(optimizers[0])}
    seen: set[int] = set()
    for i, model in enumerate(models):
        params = list(model.parameters())
        ids = {id(p) for p in params}
        if ids & seen:
            return f"model {i} ({type(model).__name__}) shares parameters with another model of the call"
        seen |= ids
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            return f"model {i} ({type(model).__name__}) has no trainable parameter: use it outside accelerator.prepare"
        if all(id(p) not in in_optimizer for p in trainable):
            return f"the trainable parameters of model {i} ({type(model).__name__}) are not in the optimizer"
    if in_optimizer - seen:
        return f"the optimizer holds {len(in_optimizer - seen)} parameters of no model in the call"
    return None


def freeze_left_out(models: list, optimizer) -> None:
    """Freeze the trainable parameters of ``models`` the optimizer does not hold (it holds others of each model).

    Under DDP such a parameter gets a gradient and never changes: no optimizer steps it. diffusers v0.40.0's
    textual_inversion/textual_inversion_sdxl.py leaves CLIPTextModelWithProjection's ``text_projection`` so (it
    freezes the encoder, the final norm and the position embedding, and optimizes the token embeddings only). One
    DeepSpeed engine partitions and reduces what requires a gradient, and under ZeRO-3 autograd would accumulate a
    full gradient into a released partition; frozen, the parameter keeps its value as under DDP, and gradients still
    flow through it to the embeddings."""
    in_optimizer = {id(p) for p in _optimizer_params(optimizer)}
    for i, model in enumerate(models):
        left_out = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_optimizer]
        for _, param in left_out:
            param.requires_grad_(False)
        if left_out:
            log.warning(
                "accel-npu: %d parameter(s) of model %d (%s) require a gradient but are in no optimizer (%s): no "
                "step changes them, as under DDP; frozen for the one DeepSpeed engine",
                len(left_out),
                i,
                type(model).__name__,
                ", ".join(n for n, _ in left_out[:4]) + (", ..." if len(left_out) > 4 else ""),
            )


def _container_class():
    import torch

    class ModelsTrainedTogether(torch.nn.Module):
        """The models of one ``accelerator.prepare`` call as children "0", "1", ...: what one DeepSpeed engine
        wraps. Never called itself (each model is called through what prepare returned for it)."""

        def __init__(self, models):
            super().__init__()
            for i, model in enumerate(models):
                self.add_module(str(i), model)
            self.__dict__[MODELS_PREPARED_TOGETHER] = tuple(models)
            import types

            # accelerate fills "auto" bucket sizes from model.config.hidden_size, and its sequence parallelism
            # requires a model.config (_prepare_deepspeed)
            sizes = [s for s in (_hidden_size(m) for m in models) if s]
            self.config = types.SimpleNamespace(**({"hidden_size": max(sizes)} if sizes else {}))

        def forward(self, *args, **kwargs):
            raise RuntimeError(
                "accel-npu: these models were prepared together under one DeepSpeed engine; call each one "
                "through what accelerator.prepare() returned for it"
            )

        # Each model's own state dict, prefixed: state-dict hooks of a model (diffusers' AttnProcsLayers renames
        # "layers.<i>" to processor names and back) see its keys as they would alone.
        def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
            if args:  # torch's deprecated positional form (destination, prefix, keep_vars)
                destination, prefix, keep_vars = (list(args) + [destination, prefix, keep_vars][len(args) :])[:3]
            if destination is None:
                from collections import OrderedDict

                destination = OrderedDict()
            for name, model in self._modules.items():
                for key, value in model.state_dict(keep_vars=keep_vars).items():
                    destination[f"{prefix}{name}.{key}"] = value
            return destination

        def load_state_dict(self, state_dict, strict=True, assign=False):
            from torch.nn.modules.module import _IncompatibleKeys

            missing, unexpected = [], []
            parts: dict = {name: {} for name in self._modules}
            for key, value in state_dict.items():
                name, _, rest = key.partition(".")
                if name in parts and rest:
                    parts[name][rest] = value
                else:
                    unexpected.append(key)
            if strict and unexpected:
                raise RuntimeError(
                    f"Error(s) in loading state_dict for {type(self).__name__}: unexpected keys {unexpected[:5]}"
                )
            for name, model in self._modules.items():
                result = model.load_state_dict(parts[name], strict=strict, assign=assign)
                missing += [f"{name}.{k}" for k in result.missing_keys]
                unexpected += [f"{name}.{k}" for k in result.unexpected_keys]
            return _IncompatibleKeys(missing, unexpected)

    return ModelsTrainedTogether


def _hidden_size(model):
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    if isinstance(size, int):
        return size
    sizes = getattr(config, "hidden_sizes", None)
    return max(sizes) if isinstance(sizes, (list, tuple)) and sizes else None


#: DeepSpeedEngine methods a PreparedTogether runs for its own model (the rest are the shared engine's)
# also the parameter iterators another plugin may have wrapped on DeepSpeedEngine (gathered reads): this
# model's own parameters, through the same wrapper
_OWN = frozenset(
    {
        "forward",
        "train",
        "eval",
        "module_state_dict",
        "load_module_state_dict",
        "_zero3_consolidated_16bit_state_dict",
        "_consolidated_16bit_state_dict",
        "save_16bit_model",
        "save_fp16_model",
        "parameters",
        "named_parameters",
    }
)
_CLASSES: dict = {}


def _prepared_together_class():
    if "member" in _CLASSES:
        return _CLASSES["member"]
    import torch
    from deepspeed import DeepSpeedEngine

    class PreparedTogether(DeepSpeedEngine):
        """One model's place in the result of a prepare that put several models under one DeepSpeed engine: a
        DeepSpeedEngine (as stock gives each model) whose ``module`` is that model and whose engine methods are
        the shared engine's. Built without DeepSpeedEngine.__init__: it holds no state of its own."""

        def __init__(self, engine, model):
            torch.nn.Module.__init__(self)
            self.module = model
            self.__dict__[_ENGINE] = engine
            self.training = model.training

        @property
        def shared_engine(self):
            return self.__dict__[_ENGINE]

        def forward(self, *args, **kwargs):
            # The model itself: ZeRO-3's hooks on its submodules gather their parameters, as for the processors
            # the UNet calls directly. What the engine's forward prologue does for its module
            # (DeepSpeedEngine._forward_prologue, deepspeed/runtime/engine.py) is done for this model: fp16
            # auto_cast of the inputs, and under ZeRO-3 the discovery of parameters a module reads from a child
            # before calling it (CLIP's text embeddings read position_embedding.weight.shape: ZeROOrderedDict
            # gathers them only while _in_forward is set).
            engine = self.__dict__[_ENGINE]
            if engine.fp16_auto_cast():
                args, kwargs = engine._cast_inputs_half(args), engine._cast_inputs_half(kwargs)
            if not engine.zero_optimization_partition_weights():
                return self.module(*args, **kwargs)
            marked = []
            for sub in self.module.modules():
                params = sub._parameters
                if getattr(params, "_in_forward", True) is False:
                    params._in_forward = True
                    marked.append(params)
            try:
                return self.module(*args, **kwargs)
            finally:
                for params in marked:
                    params._in_forward = False

        def train(self, mode: bool = True):
            self.training = mode
            self.module.train(mode)
            return self

        def eval(self):
            return self.train(False)

        def __getattr__(self, name):
            # nn.Module's registry first (module), then the model's attributes (DeepSpeedEngine passes them
            # through too), then the shared engine's state
            try:
                return torch.nn.Module.__getattr__(self, name)
            except AttributeError:
                pass
            module = self.__dict__["_modules"].get("module")
            if module is not None:
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            engine = self.__dict__.get(_ENGINE)
            if engine is not None:
                return getattr(engine, name)
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

        def __repr__(self):
            return f"PreparedTogether({type(self.module).__name__}, one DeepSpeed engine with other models)"

    def delegate(name):
        def method(self, *args, **kwargs):
            return getattr(self.__dict__[_ENGINE], name)(*args, **kwargs)

        method.__name__ = name
        return method

    for name, value in vars(DeepSpeedEngine).items():
        if (
            callable(value)
            and not isinstance(value, (staticmethod, classmethod))
            and not name.startswith("__")
            and name not in _OWN
            and name not in vars(PreparedTogether)
        ):
            setattr(PreparedTogether, name, delegate(name))
    _CLASSES["member"] = PreparedTogether
    return PreparedTogether


def _step_classes():
    if "step" in _CLASSES:
        return _CLASSES["step"]
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper

    class StepAtOptimizerStep(DeepSpeedEngineWrapper):
        """accelerate's engine wrapper, the optimizer step left to ``optimizer.step()``."""

        def __init__(self, engine):
            super().__init__(engine)
            self.pending = False
            self.window = None  # the gradients shown between the backward and the step (shown_gradients.py)
            self.__dict__[STEPS_AT_OPTIMIZER_STEP] = []  # called after each step (the checkpoints' step boundary)

        def backward(self, loss, sync_gradients=True, **kwargs):
            if self.pending and sync_gradients:
                _warn_once(
                    "accel-npu: accelerator.backward() again without optimizer.step() after the last "
                    "one: the pending optimizer step is taken first"
                )
                self.step()
            self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
            self.engine.backward(loss, **kwargs)
            if sync_gradients:
                self.pending = True
                self.window = GradientWindow.open(self.engine.module)

        def step(self):
            if not self.pending:
                return
            window, self.window, self.pending = self.window, None, False
            if window is not None:
                window.close()
            self.engine.step()
            for after_step in list(self.__dict__[STEPS_AT_OPTIMIZER_STEP]):
                after_step()

    class OptimizerStepsEngine(DeepSpeedOptimizerWrapper):
        """accelerate's optimizer wrapper whose ``step()`` is the shared engine's step (taken in backward by
        accelerate for one model)."""

        def step(self):
            self.__dict__[_STEPPER].step()

    _CLASSES["step"] = (StepAtOptimizerStep, OptimizerStepsEngine)
    return _CLASSES["step"]


_STEPPER = "_accel_npu_steps_engine"
_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def _step_at_optimizer_step(accelerator, engine, prepared) -> bool:
    """accelerate's engine and optimizer wrappers of ``engine`` made to step at ``optimizer.step()``."""
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper

    wrapper = accelerator.deepspeed_engine_wrapped
    optimizer = next((o for o in prepared if type(o) is DeepSpeedOptimizerWrapper), None)
    if type(wrapper) is not DeepSpeedEngineWrapper or wrapper.engine is not engine or optimizer is None:
        return False
    engine_class, optimizer_class = _step_classes()
    stepper = engine_class(engine)
    accelerator.deepspeed_engine_wrapped = stepper
    optimizer.__class__ = optimizer_class
    optimizer.__dict__[_STEPPER] = stepper
    return True


def prepare_models_together(prepare, accelerator, args, kwargs):
    """``prepare(*args, **kwargs)`` (Accelerator.prepare under DeepSpeed), with two or more models and one
    optimizer over them given one engine; anything else as stock."""
    import torch

    positions = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
    if len(positions) < 2:
        return prepare(*args, **kwargs)
    models = [args[i] for i in positions]
    others = [a for a in args if not isinstance(a, torch.nn.Module)]
    why = why_not_together(models, others)
    if why is not None:
        pairs, why_not_each = pairs_of(models, others)
        if pairs is not None:
            return prepare_engine_per_model(prepare, accelerator, args, kwargs, pairs, STOCK_MESSAGE)
        raise AssertionError(
            f"{STOCK_MESSAGE} (accel-npu prepares several models as one engine with one optimizer over all their "
            f"trainable parameters, or one engine per model each with its own optimizer: {why}; {why_not_each})"
        )
    freeze_left_out(models, next(o for o in others if isinstance(o, torch.optim.Optimizer)))
    container = _container_class()(models)
    inner = [container if i == positions[0] else a for i, a in enumerate(args) if i not in positions[1:]]
    result = prepare(*inner, **kwargs)
    result = result if isinstance(result, tuple) else (result,)
    engine = result[positions[0]]
    member = _prepared_together_class()
    views = {i: member(engine, model) for i, model in zip(positions, models)}
    out, rest = [], iter(result[: positions[0]] + result[positions[0] + 1 :])
    for i in range(len(args)):
        out.append(views[i] if i in views else next(rest))
    for view in views.values():
        view._is_accelerate_prepared = True
    _step_at_optimizer_step(accelerator, engine, out)
    log.info(
        "accel-npu: %s prepared as one DeepSpeed engine (one optimizer over all their parameters; "
        "accelerate allows one model per engine)",
        ", ".join(type(m).__name__ for m in models),
    )
    return tuple(out)
