"""A resumed run draws the batches an uninterrupted one would have drawn.

Under more than one process ``prepare_data_loader`` gives a shuffling sampler a private generator, seeded
from the global RNG when the loader is prepared, and broadcasts rank 0's state at the start of every epoch
(accelerate/data_loader.py ``prepare_data_loader``, ``DataLoaderShard.__iter__``). ``save_state`` writes
neither that generator nor the loader's epoch counter (accelerate/checkpointing.py saves a sampler only
for an ``IterableDatasetShard`` with a ``SeedableRandomSampler``, never the case): a resumed run's loader
is prepared afresh and replays epoch 0's order (accelerate #3158, #2823, #3996, open). diffusers' scripts
resume at the epoch of the restored global step, so every resume of such a script trains on other batches
— and other noise after them — than the uninterrupted run.

Here ``save_state`` also writes, from the main process, each prepared loader's epoch counter and shuffle
generator (``accel_npu_data_order.pt``), through accelerate's own save/load pre-hooks, so into the folder
accelerate writes whatever the backend; ``load_state`` restores them. A checkpoint taken at an epoch's last
batch resumes with the next epoch's order; one taken mid-epoch restores the order the epoch began with, so a
script that skips the batches it has seen continues with the same samples. A checkpoint without the file
(written by stock accelerate) loads as stock does.

A script's own batch sampler or sampler keeps its order in itself, where accelerate saves nothing of it: diffusers'
``BucketBatchSampler`` (examples/dreambooth, 9 scripts at v0.40.0) either reorders its ``batches`` list in place
with the global ``random`` each epoch, or shuffles copies with a private ``random.Random(seed)``. Rebuilt on resume,
the first replays its initial order, the second its first epoch's. The file also holds such an object's
``random.Random`` and ``torch.Generator`` attributes and its lists of indices or of index batches, as they were when
the next epoch's order will be drawn (mid-epoch: as the epoch began; the global ``random`` is accelerate's, restored
as it was at the save).
"""

from __future__ import annotations

import logging
import os
import random
import weakref

import torch

log = logging.getLogger("accel_npu")

#: the file save_state writes beside accelerate's random_states_*.pkl (main process only: every rank's
#: generator takes rank 0's state at the start of an epoch, accelerate's synchronize_rng_states)
FILE_NAME = "accel_npu_data_order.pt"
#: instance-dict keys on a prepared loader: the generator state its current epoch's order was drawn from,
#: and that epoch's counter
_EPOCH_START = "_accel_npu_epoch_start_generator"
_EPOCH_STARTED = "_accel_npu_epoch_started"
#: the script's samplers' state as the current epoch began
_EPOCH_START_SAMPLERS = "_accel_npu_epoch_start_samplers"
#: on the Accelerator: the hooks are registered
_HOOKED = "_accel_npu_data_order_hooks"


def _generator(loader):
    return getattr(loader, "synchronized_generator", None)


def note_epoch_start(loader) -> None:
    """Called as an epoch's iterator is made: rank 0's generator state now is the one
    synchronize_rng_states broadcasts when the first batch is drawn, and the order is drawn from."""
    generator = _generator(loader)
    if generator is not None:
        loader.__dict__[_EPOCH_START] = generator.get_state()
    loader.__dict__[_EPOCH_STARTED] = getattr(loader, "iteration", 0)
    loader.__dict__[_EPOCH_START_SAMPLERS] = samplers_state(loader)


def _scripts_samplers(loader) -> dict:
    """The objects below a loader that draw its order and are the script's own, by attribute path
    (``batch_sampler.batch_sampler``: the one accelerate's BatchSamplerShard wraps). torch's and accelerate's
    samplers are walked through: their order comes from the generators accelerate and the file above keep."""
    found, pending, seen = {}, [("", loader)], {id(loader)}
    while pending:
        path, obj = pending.pop()
        for name in ("batch_sampler", "sampler"):
            child = getattr(obj, name, None)
            if child is None or id(child) in seen:  # walked already: wrappers may point back up the chain
                continue
            seen.add(id(child))
            child_path = f"{path}.{name}" if path else name
            module = type(child).__module__
            if module.startswith(("torch.", "accelerate.")):
                pending.append((child_path, child))
            else:
                found[child_path] = child
    return found


def _index_list(value) -> bool:
    """A list of indices or of index batches (a sampler's precomputed order)."""
    if not isinstance(value, list) or not value:
        return False
    if all(type(item) is int for item in value):
        return True
    return all(isinstance(item, (list, tuple)) and all(type(i) is int for i in item) for item in value)


def _copy_index_list(value: list) -> list:
    return [list(item) if isinstance(item, list) else item for item in value]  # ints and tuples are immutable


def _sampler_state(sampler) -> dict:
    state = {}
    for name, value in getattr(sampler, "__dict__", {}).items():
        if isinstance(value, random.Random):  # not the random module itself: accelerate restores that
            state[name] = ("random", value.getstate())
        elif isinstance(value, torch.Generator):
            state[name] = ("torch", value.get_state())
        elif _index_list(value):
            state[name] = ("list", _copy_index_list(value))
    return state


def samplers_state(loader) -> dict:
    """{path: {attribute: (kind, state)}} for the script's own samplers below the loader; {} for none."""
    states = {path: _sampler_state(sampler) for path, sampler in _scripts_samplers(loader).items()}
    return {path: state for path, state in states.items() if state}


def prepare_data_loader(wrapped, instance, args, kwargs):
    prepared = wrapped(*args, **kwargs)
    if not getattr(instance, _HOOKED, False):
        setattr(instance, _HOOKED, True)
        instance.register_save_state_pre_hook(AcceleratorHook(instance, save_data_order))
        instance.register_load_state_pre_hook(AcceleratorHook(instance, load_data_order))
    return prepared


def loader_position(loader) -> dict:
    """Where the loader's next epoch starts: its epoch counter and the generator state its order is drawn
    from. At an epoch's last batch (or after it) that is the next epoch, from the generator as it is now;
    mid-epoch, this epoch again, from the state it began with."""
    generator = _generator(loader)
    iteration = getattr(loader, "iteration", 0)
    started = loader.__dict__.get(_EPOCH_STARTED)
    if started is None or iteration > started:  # never iterated, or its last epoch ran to the end
        state = generator.get_state() if generator is not None else None
        return {"iteration": iteration, "generator": state, "samplers": samplers_state(loader)}
    if getattr(loader, "end_of_dataloader", False):  # the epoch's last batch was handed out
        state = generator.get_state() if generator is not None else None
        return {"iteration": iteration + 1, "generator": state, "samplers": samplers_state(loader)}
    return {
        "iteration": iteration,
        "generator": loader.__dict__.get(_EPOCH_START),
        "samplers": loader.__dict__.get(_EPOCH_START_SAMPLERS, {}),
    }


class AcceleratorHook:
    """One of an Accelerator's save/load pre-hooks: ``act(accelerator, *hook_args)``. It holds the Accelerator
    weakly, as the Accelerator holds its hooks: a closure over it would keep it alive past the script's last
    reference until a garbage collection (accelerate's tests/test_data_loader.py
    ``test_ensure_dataloader_gets_cleaned_up``). It pickles with the Accelerator, as stock's hooks-free one does
    (tests/test_accelerator.py ``test_can_pickle_dataloader``); ``act`` is a module-level function."""

    def __init__(self, accelerator, act) -> None:
        self._accelerator = weakref.ref(accelerator)
        self._act = act

    def __reduce__(self):
        # pickle memoizes the Accelerator before its hooks: this names the same object
        return type(self), (self._accelerator(), self._act)

    def __call__(self, *args) -> None:
        accelerator = self._accelerator()
        if accelerator is not None:
            self._act(accelerator, *args)


def save_data_order(accelerator, models, weights, output_dir) -> None:
    if not accelerator.is_main_process or not accelerator._dataloaders:
        return
    positions = [loader_position(loader) for loader in accelerator._dataloaders]
    torch.save({"loaders": positions}, os.path.join(output_dir, FILE_NAME))


def load_data_order(accelerator, models, input_dir) -> None:
    path = os.path.join(input_dir, FILE_NAME)
    if not os.path.isfile(path):
        return  # written without accel-npu: stock's resume
    positions = torch.load(path, map_location="cpu", weights_only=True)["loaders"]
    loaders = accelerator._dataloaders
    if len(positions) != len(loaders):
        log.warning(
            "accel-npu: %s holds %d DataLoaders' order, this run prepared %d; their order is not restored",
            path,
            len(positions),
            len(loaders),
        )
        return
    for loader, position in zip(loaders, positions):
        restore_position(loader, position)


def restore_position(loader, position: dict) -> None:
    if hasattr(loader, "iteration"):
        loader.iteration = position["iteration"]
    generator = _generator(loader)
    if generator is not None and position["generator"] is not None:
        generator.set_state(position["generator"])
    samplers = _scripts_samplers(loader)
    for path, state in position.get("samplers", {}).items():  # absent: written before samplers were kept
        sampler = samplers.get(path)
        if sampler is None:
            log.warning(
                "accel-npu: the checkpoint holds the order of a sampler at %s, this loader has none there", path
            )
            continue
        for name, (kind, value) in state.items():
            current = getattr(sampler, name, None)
            if kind == "random" and isinstance(current, random.Random):
                current.setstate(value)
            elif kind == "torch" and isinstance(current, torch.Generator):
                current.set_state(value)
            elif kind == "list" and isinstance(current, list):
                current[:] = _copy_index_list(value)  # in place: the sampler's __iter__ may hold the list
            else:
                log.warning(
                    "accel-npu: %s.%s of %s does not hold what the checkpoint saved; its order is not restored",
                    path,
                    name,
                    type(sampler).__name__,
                )
