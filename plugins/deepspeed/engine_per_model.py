"""Several models, each with an optimizer of its own, in one ``accelerator.prepare`` under DeepSpeed: one engine per
model, as DeepSpeed's GAN tutorial runs a generator and a discriminator.

accelerate 1.16 ``Accelerator.prepare`` refuses more than one model under DeepSpeed ("You can't use same
`Accelerator()` instance with multiple models when using DeepSpeed", accelerator.py; accelerate #2974), and
``accelerator.backward`` drives one engine (``deepspeed_engine_wrapped``). diffusers v0.40.0's
examples/vqgan/train_vqgan.py prepares ``model, discriminator, optimizer, discr_optimizer, lr_scheduler,
discr_lr_scheduler`` together and alternates, as a DDP script may: a generator step (``optimizer.zero_grad()``,
the VQModel's forward, a loss that runs through the discriminator, ``accelerator.backward``, ``optimizer.step()``)
and a discriminator step (``discr_optimizer.zero_grad()``, the generator's output detached, ``discr_optimizer.step()``).

When every optimizer in the call holds exactly the trainable parameters of one model (and every model has one), each
(model, optimizer, its scheduler) is prepared as accelerate prepares one model: one ``deepspeed.initialize`` each, the
other objects (DataLoaders) with the first. accelerate's ``_models`` lists the engines in the script's order, so
``save_state`` / ``load_state`` write and read one DeepSpeed checkpoint per engine (``pytorch_model``,
``pytorch_model_1``) and the save/load hooks get the models in that order.

``accelerator.backward(loss)`` runs the loss's backward once, through every engine on its way: DeepSpeed 0.19 takes
a backward that is not an engine's own (``loss.backward()``) from hooks on each engine's outputs (engine.py
``_backward_prologue`` / ``_backward_post_hook``, "PyTorch-style backward"), so the generator's loss reaches the
generator through the discriminator. Which engines receive gradients follows the script's
``optimizer.zero_grad()``: under DDP a step uses the gradients accumulated since its optimizer's last
``zero_grad()``, and the discriminator's gradients from the generator step are zeroed before the discriminator step
uses any (train_vqgan.py line 910). So the backward accumulates into the parameters of the engines whose optimizer
was zeroed since its last step (``torch.autograd.backward(inputs=...)``; all of them when none was), and the others
receive nothing, what the script would have zeroed. ``optimizer.step()`` steps its engine when a backward reached it
since its last step (``engine.step()``: clipping, the update, the engine's zero_grad, its scheduler); the gradient
between backward and step is shown as ``param.grad`` (shown_gradients.py).

``torch.autograd.grad`` on a parameter of an engine (the script's adaptive weight, ``grad_layer_wrt_loss(loss,
decoder.conv_out.weight)``) is autograd's own: it accumulates nothing, and under ZeRO-3 the backward hooks of the
module that uses the weight gather it (the result has the weight's whole shape).

Not supported (the call stops with accelerate's message and the reason): fp16 loss scaling (each engine scales its
own loss; one backward through two engines has one loss), gradient accumulation over more than one micro-batch (a
PyTorch-style backward divides the gradient at each engine's outputs: through a discriminator into the generator it
would be divided twice), ZeRO stage 0 (no PyTorch-style backward), ``DummyOptim`` / ``DummyScheduler`` (the
optimizer from the DeepSpeed config).
"""

from __future__ import annotations

import logging

from accel_npu._torch.markers import STEPS_AT_OPTIMIZER_STEP
from accel_npu.plugins.deepspeed.shown_gradients import GradientWindow

log = logging.getLogger("accel_npu")

_STEPPER = "_accel_npu_engine_stepper"
_CLASSES: dict = {}


def _optimizer_params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def pairs_of(models: list, others: list):
    """([(model, optimizer, scheduler or None)] in the models' order, None) when each model has an optimizer of
    its own over exactly its trainable parameters, else (None, why not)."""
    import torch

    optimizers = [o for o in others if isinstance(o, torch.optim.Optimizer)]
    if any(type(o).__name__ in ("DummyOptim", "DummyScheduler") for o in others):
        return None, "accelerate's DummyOptim / DummyScheduler (the optimizer from the DeepSpeed config)"
    if len(optimizers) != len(models):
        return None, f"{len(models)} models with {len(optimizers)} optimizers"
    held = [(o, {id(p) for p in _optimizer_params(o)}) for o in optimizers]
    pairs, seen = [], set()
    for i, model in enumerate(models):
        params = {id(p) for p in model.parameters()}
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        if not trainable:
            return None, f"model {i} ({type(model).__name__}) has no trainable parameter"
        if params & seen:
            return None, f"model {i} ({type(model).__name__}) shares parameters with another model of the call"
        seen |= params
        # every trainable parameter of the model, nothing of another (frozen ones of its own may be there too:
        # train_vqgan.py builds its optimizers over list(model.parameters()))
        optimizer = next((o for o, ids in held if trainable <= ids <= params), None)
        if optimizer is None:
            return None, f"no optimizer holds exactly the trainable parameters of model {i} ({type(model).__name__})"
        schedulers = [o for o in others if getattr(o, "optimizer", None) is optimizer and o is not optimizer]
        if len(schedulers) > 1:
            return None, f"{len(schedulers)} schedulers over the optimizer of model {i} ({type(model).__name__})"
        pairs.append((model, optimizer, schedulers[0] if schedulers else None))
    return pairs, None


def _refusal(engine) -> str | None:
    """Why a PyTorch-style backward through this engine cannot stand for its own backward, or None."""
    if not getattr(engine, "_support_torch_style_backward", False):
        return "ZeRO stage 0 (DeepSpeed takes no PyTorch-style backward there)"
    needs_scaler = getattr(engine.optimizer, "needs_scaler", None)
    if callable(needs_scaler) and needs_scaler():
        return (
            "fp16 loss scaling (each engine scales the loss of its own backward; one backward through two "
            "engines has one loss)"
        )
    if engine.gradient_accumulation_steps() != 1:
        return (
            f"gradient_accumulation_steps={engine.gradient_accumulation_steps()} (a PyTorch-style backward divides the "
            "gradient at each engine's outputs: through one engine into another it would be divided twice)"
        )
    return None


def _classes():
    if "wrappers" in _CLASSES:
        return _CLASSES["wrappers"]
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper

    class EngineStepper:
        """One engine's state between the script's calls: zeroed since its last step, reached by a backward since
        its last step, the gradients shown meanwhile."""

        def __init__(self, engine, after_step: list):
            self.engine = engine
            self.params = [p for p in engine.module.parameters() if p.requires_grad]
            self.zeroed = False  # the script called its optimizer's zero_grad() since its last step
            self.reached = False  # a backward accumulated gradients into it since its last step
            self.window = None
            self.after_step = after_step
            for param in self.params:  # one per parameter: which backward reached this engine
                param.register_post_accumulate_grad_hook(self._mark_reached)

        def _mark_reached(self, _param) -> None:
            self.reached = True

        def step(self) -> None:
            window, self.window = self.window, None
            if window is not None:
                window.close()
            if not self.reached:
                return  # as torch.optim steps no parameter whose .grad is None
            self.engine.step()
            self.reached = self.zeroed = False
            for after_step in list(self.after_step):
                after_step()

        def zero_grad(self) -> None:
            if self.reached:
                _discard(self)
            self.zeroed = True

    class EnginePerModelBackward(DeepSpeedEngineWrapper):
        """``accelerator.deepspeed_engine_wrapped`` over one engine per model: the backward of a loss runs once,
        into the engines the script zeroed (see the module docstring); each steps at its optimizer's ``step()``."""

        def __init__(self, steppers):
            super().__init__(steppers[0].engine)
            self.steppers = steppers
            self.last = steppers[0]
            self.__dict__[STEPS_AT_OPTIMIZER_STEP] = steppers[0].after_step  # shared by every engine's step

        def backward(self, loss, sync_gradients=True, **kwargs):
            import torch

            zeroed = [s for s in self.steppers if s.zeroed]
            into = zeroed if zeroed and len(zeroed) < len(self.steppers) else self.steppers
            before = {id(s): s.reached for s in into}
            for stepper in into:
                stepper.reached = False
                stepper.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
            if into is self.steppers:
                torch.autograd.backward(loss, **kwargs)
            else:
                torch.autograd.backward(loss, inputs=[p for s in into for p in s.params], **kwargs)
            for stepper in into:
                now = stepper.reached
                stepper.reached = now or before[id(stepper)]
                if now:
                    self.last = stepper
                    if sync_gradients:
                        stepper.window = GradientWindow.open(stepper.engine.module)

        def get_global_grad_norm(self):
            norm = self.last.engine.get_global_grad_norm()
            return norm.item() if hasattr(norm, "item") else norm

    class OptimizerStepsItsEngine(DeepSpeedOptimizerWrapper):
        """accelerate's optimizer wrapper whose ``step()`` steps its own engine and whose ``zero_grad()`` is the
        script's, as under DDP (accelerate's is a no-op: its engine steps and zeroes inside backward)."""

        def step(self):
            self.__dict__[_STEPPER].step()

        def zero_grad(self, set_to_none=None):
            self.__dict__[_STEPPER].zero_grad()

    _CLASSES["wrappers"] = (EngineStepper, EnginePerModelBackward, OptimizerStepsItsEngine)
    return _CLASSES["wrappers"]


def _discard(stepper) -> None:
    """``optimizer.zero_grad()`` after a backward reached the engine and before its step: the gradients DeepSpeed
    accumulated in its partitions are set to zero (``safe_set_full_grad``), as zero_grad does to ``param.grad``."""
    import torch
    from deepspeed.utils import safe_set_full_grad

    window, stepper.window = stepper.window, None
    if window is not None:
        window.close()
    for param in stepper.params:
        shape = tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)
        zeros = torch.zeros(shape, dtype=torch.float32, device=param.device)
        if hasattr(param, "ds_id"):
            import torch.distributed

            zeros = zeros.new_zeros(param.partition_numel() * torch.distributed.get_world_size(param.ds_process_group))
        safe_set_full_grad(param, zeros)
    stepper.reached = False


def prepare_engine_per_model(prepare, accelerator, args, kwargs, pairs, stock_message: str):
    """``prepare(*args, **kwargs)`` with each (model, optimizer, scheduler) of ``pairs`` prepared as its own engine;
    what cannot run so stops with ``stock_message`` (accelerate's) and the reason."""
    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

    paired = {id(x) for triple in pairs for x in triple if x is not None}
    rest = [a for a in args if id(a) not in paired]
    prepared: dict = {}
    rest_prepared: list = []
    engines = []
    for k, (model, optimizer, scheduler) in enumerate(pairs):
        call = [model, optimizer] + ([scheduler] if scheduler is not None else []) + (rest if k == 0 else [])
        if k:
            accelerator.deepspeed_engine_wrapped = None  # accelerate keeps the first and warns about the others
        result = prepare(*call, **kwargs)
        result = result if isinstance(result, tuple) else (result,)
        for original, out in zip(call[: len(call) - (len(rest) if k == 0 else 0)], result):
            prepared[id(original)] = out
        if k == 0:
            rest_prepared = list(result[len(call) - len(rest) :])
        engines.append(prepared[id(model)])
    for engine in engines:
        why = _refusal(engine)
        if why is not None:
            raise AssertionError(
                f"{stock_message} (accel-npu: not supported, because of {why}; one engine per model runs the "
                "backward of a loss once through every engine on its way)"
            )
    stepper_class, backward_class, optimizer_class = _classes()
    after_step: list = []
    steppers = [stepper_class(engine, after_step) for engine in engines]
    for (_model, optimizer, _scheduler), stepper in zip(pairs, steppers):
        wrapper = prepared[id(optimizer)]
        if type(wrapper) is DeepSpeedOptimizerWrapper:
            wrapper.__class__ = optimizer_class
            wrapper.__dict__[_STEPPER] = stepper
    accelerator.deepspeed_engine_wrapped = backward_class(steppers)
    rest_iter = iter(rest_prepared)
    out = tuple(prepared[id(a)] if id(a) in prepared else next(rest_iter) for a in args)
    log.info(
        "accel-npu: %s prepared as one DeepSpeed engine each (each with its own optimizer; accelerate allows one "
        "model per Accelerator under DeepSpeed)",
        ", ".join(type(m).__name__ for m, _o, _s in pairs),
    )
    return out
