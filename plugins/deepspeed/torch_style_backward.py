"""An autograd pass through a DeepSpeed engine's outputs that puts no gradient into its parameters is not that
engine's backward.

DeepSpeed 0.19 takes a backward the script runs itself (``loss.backward()``, not ``engine.backward(loss)``) from hooks
on every engine output (``register_output_backward_hooks`` in ``DeepSpeedEngine.forward``): the first gradient that
reaches an output runs ``_backward_prologue`` (it enters the optimizer's backward and queues the epilogue at the end of
the graph task) and each output's gradient is divided by ``gradient_accumulation_steps``
(``_backward_prologue_per_tensor``). Two kinds of pass reach an engine's outputs and accumulate nothing into its
parameters:

- ``torch.autograd.grad`` (diffusers v0.40.0's vqgan/train_vqgan.py: ``grad_layer_wrt_loss(perceptual_loss,
  decoder.conv_out.weight)`` for its adaptive weight, ``gradient_penalty`` through the discriminator): the epilogue
  then reduces an empty bucket ("IndexError: list index out of range", zero/stage_1_and_2.py ``reduce_ipg_grads``),
  on GPUs too, and the gradient handed back is divided by the accumulation steps, where under DDP it is not;
- a backward into other parameters only (``torch.autograd.backward(inputs=...)``: one engine per model,
  engine_per_model.py, the generator's loss through the discriminator): the same empty epilogue.

Worse, the prologue runs once per forward (``OutputBackwardHookManager.preprocess_done``, runtime/utils.py): a
``torch.autograd.grad`` first uses it up, and the backward that follows never enters the optimizer's backward (its
step then finds no gradient: "KeyError: 0", stage_1_and_2.py ``has_overflow_partitioned_grads_serial``).

And it runs once per forward, not per backward: an engine called twice before one backward (train_vqgan.py's
discriminator on the real and the reconstructed images) enters the optimizer's backward twice and leaves it once, and
a backward the script runs itself then skips the epilogue ("An interrupted engine.backward() leaves the ZeRO backward
depth active", engine.py ``_backward_post_hook``): the step finds no gradient. Here the prologue runs once per engine
and backward (graph task); every output's gradient is still divided.

For such a pass (no ``AccumulateGrad`` node of the engine's trainable parameters will run in it: torch's
``_will_engine_execute_node``, which DeepSpeed's ``count_used_parameters_in_backward`` asks too, and which refuses a
leaf inside ``autograd.grad``) the output hooks let the gradient through untouched: autograd runs as it runs without
DeepSpeed, and the next backward that accumulates gets the prologue. An engine's own ``engine.backward`` is left as it
is.
"""

from __future__ import annotations

#: engine instance-dict key: (graph task id, whether a parameter of the engine accumulates in it)
_DECIDED = "_accel_npu_accumulates_in_task"
#: engine instance-dict key: the graph task whose backward prologue the engine ran
_PROLOGUE_TASK = "_accel_npu_prologue_task"
#: engine instance-dict key: the graph task after which its modules' ZeRO-3 backward counts are put back
_KEPT_TASK = "_accel_npu_backward_counts_task"


def _accumulates(engine) -> bool:
    """Whether the running graph task accumulates a gradient into a trainable parameter of ``engine``."""
    import torch
    from torch.autograd.graph import _get_grad_fn_or_grad_acc

    task = torch._C._current_graph_task_id()
    decided = engine.__dict__.get(_DECIDED)
    if decided is not None and decided[0] == task:
        return decided[1]
    answer = False
    if task != -1:
        for param in engine.module.parameters():
            if not param.requires_grad:
                continue
            with torch.enable_grad():  # backward hooks run with grad mode off; torch's helper wants it on for leaves
                node = _get_grad_fn_or_grad_acc(param)
            if node is None:
                continue
            try:
                if torch._C._will_engine_execute_node(node):
                    answer = True
                    break
            except RuntimeError:  # "...currently running autograd.grad()": nothing accumulates
                break
    engine.__dict__[_DECIDED] = (task, answer)
    return answer


def _engine_of(manager):
    """The engine whose forward registered this hook manager: its per-output function is the engine's bound
    ``_backward_prologue_per_tensor`` (DeepSpeedEngine.forward)."""
    from deepspeed import DeepSpeedEngine

    engine = getattr(getattr(manager, "preprocess_per_tensor_fn", None), "__self__", None)
    return engine if isinstance(engine, DeepSpeedEngine) else None


def _keep_backward_counts(engine) -> None:
    """Under ZeRO-3: each submodule's backward bookkeeping as it was before this pass, put back when the pass ends.

    ZeRO-3 gathers a submodule's parameters for its backward once per forward (``applied_pre_backward_ref_cnt``,
    counted up by each forward, down by each backward through it: runtime/zero/parameter_offload.py
    ``_run_before_backward_function``) and releases them when its inputs' gradients are done
    (``ds_grads_remaining``). A ``torch.autograd.grad(..., retain_graph=True)`` through the module uses that count
    up, so the backward after it runs the module with its shape-[0] partitions ("weight should have at least three
    dimensions"), on GPUs too: train_vqgan.py asks two such gradients through the generator and the discriminator
    before its backward."""
    import torch

    task = torch._C._current_graph_task_id()
    if engine.__dict__.get(_KEPT_TASK) == task or not engine.zero_optimization_partition_weights():
        return
    engine.__dict__[_KEPT_TASK] = task
    saved = [
        (m, m.__dict__.get("applied_pre_backward_ref_cnt"), m.__dict__.get("ds_grads_remaining"))
        for m in engine.module.modules()
    ]

    def put_back():
        for module, pre, post in saved:
            if pre is not None:
                module.applied_pre_backward_ref_cnt = pre
            if post is not None:
                module.ds_grads_remaining = post

    torch.autograd.Variable._execution_engine.queue_callback(put_back)


def output_backward_hook(wrapped, instance, args, kwargs):
    """``OutputBackwardHookManager._make_backward_hook``: the hook lets a pass that accumulates nothing into the
    engine's parameters through untouched (no prologue, no division, and the manager's once-per-backward flag left
    for the backward that does)."""
    hook = wrapped(*args, **kwargs)
    engine = _engine_of(instance)
    if engine is None:
        return hook

    def backward_hook(grad):
        import torch

        if not getattr(engine, "_running_engine_backward", False) and not _accumulates(engine):
            _keep_backward_counts(engine)
            return grad
        task = torch._C._current_graph_task_id()
        if not instance.preprocess_done:
            if engine.__dict__.get(_PROLOGUE_TASK) == task:
                instance.preprocess_done = True  # another forward's outputs ran the engine's prologue in this pass
            else:
                engine.__dict__[_PROLOGUE_TASK] = task
        return hook(grad)

    return backward_hook
