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
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("accel_npu")

#: the file save_state writes beside accelerate's random_states_*.pkl (main process only: every rank's
#: generator takes rank 0's state at the start of an epoch, accelerate's synchronize_rng_states)
FILE_NAME = "accel_npu_data_order.pt"
#: instance-dict keys on a prepared loader: the generator state its current epoch's order was drawn from,
#: and that epoch's counter
_EPOCH_START = "_accel_npu_epoch_start_generator"
_EPOCH_STARTED = "_accel_npu_epoch_started"
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


def prepare_data_loader(wrapped, instance, args, kwargs):
    prepared = wrapped(*args, **kwargs)
    if not getattr(instance, _HOOKED, False):
        setattr(instance, _HOOKED, True)
        instance.register_save_state_pre_hook(_save_hook(instance))
        instance.register_load_state_pre_hook(_load_hook(instance))
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
        return {"iteration": iteration, "generator": state}
    if getattr(loader, "end_of_dataloader", False):  # the epoch's last batch was handed out
        state = generator.get_state() if generator is not None else None
        return {"iteration": iteration + 1, "generator": state}
    return {"iteration": iteration, "generator": loader.__dict__.get(_EPOCH_START)}


def _save_hook(accelerator):
    def save_data_order(models, weights, output_dir):
        if not accelerator.is_main_process or not accelerator._dataloaders:
            return
        positions = [loader_position(loader) for loader in accelerator._dataloaders]
        torch.save({"loaders": positions}, os.path.join(output_dir, FILE_NAME))

    return save_data_order


def _load_hook(accelerator):
    def load_data_order(models, input_dir):
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

    return load_data_order


def restore_position(loader, position: dict) -> None:
    if hasattr(loader, "iteration"):
        loader.iteration = position["iteration"]
    generator = _generator(loader)
    if generator is not None and position["generator"] is not None:
        generator.set_state(position["generator"])
