"""A resume draws the batches the uninterrupted run would have drawn (plugins/checkpoints/data_order.py).

accelerate gives a shuffled DataLoader prepared on several processes a private generator and saves neither it
nor the loader's epoch counter in save_state (accelerate #3158): a resumed run replays epoch 0's order. The
end-to-end test runs tests/scripts/resume_data_order.py on 2 ranks (torchrun, gloo) straight, then saved and
resumed, with accel-npu and stock (ACCEL_NPU_DISABLE=1); the witnesses are the sample indices and the noise each
rank drew per step, printed by the script. The unit tests hold where the next epoch starts.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from accel_npu.plugins.checkpoints import data_order as order
from tests.launch_utils import base_env, explain, results, run_concurrently, torchrun_launch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import upstream_samplers as upstream

SCRIPT = Path(__file__).parent / "scripts" / "resume_data_order.py"


class _Loader:
    """What loader_position reads of accelerate's DataLoaderShard: iteration, end_of_dataloader and the
    synchronized generator."""

    def __init__(self, seed=0):
        self.synchronized_generator = torch.Generator().manual_seed(seed)
        self.iteration = 0
        self.end_of_dataloader = False

    def start_epoch(self):
        order.note_epoch_start(self)
        torch.randperm(8, generator=self.synchronized_generator)  # the sampler draws the epoch's order


def test_a_loader_never_iterated_starts_where_its_generator_is():
    loader = _Loader()
    position = order.loader_position(loader)
    assert position["iteration"] == 0
    assert torch.equal(position["generator"], loader.synchronized_generator.get_state())


def test_mid_epoch_the_epoch_starts_again_from_the_state_its_order_was_drawn_from():
    loader = _Loader()
    before = loader.synchronized_generator.get_state()
    loader.start_epoch()
    position = order.loader_position(loader)
    assert position["iteration"] == 0
    assert torch.equal(position["generator"], before)
    assert not torch.equal(position["generator"], loader.synchronized_generator.get_state())


def test_at_the_epochs_last_batch_the_next_epoch_starts_from_the_generator_as_it_is():
    loader = _Loader()
    loader.start_epoch()
    loader.end_of_dataloader = True
    position = order.loader_position(loader)
    assert position["iteration"] == 1
    assert torch.equal(position["generator"], loader.synchronized_generator.get_state())


def test_after_a_finished_epoch_the_counter_is_not_counted_twice():
    loader = _Loader()
    loader.start_epoch()
    loader.end_of_dataloader = True
    loader.iteration = 1  # accelerate counts the epoch when its iterator ends
    assert order.loader_position(loader)["iteration"] == 1


def test_a_loader_without_a_synchronized_generator_keeps_its_counter_only():
    loader = _Loader()
    loader.synchronized_generator = None
    loader.iteration = 3
    assert order.loader_position(loader) == {"iteration": 3, "generator": None, "samplers": {}}
    fresh = _Loader()
    order.restore_position(fresh, {"iteration": 3, "generator": None})
    assert fresh.iteration == 3


class _Accelerator:
    is_main_process = True

    def __init__(self, loaders):
        self._dataloaders = loaders


def test_the_hooks_write_and_restore_each_loaders_position(tmp_path):
    saved = _Loader(seed=1)
    saved.start_epoch()
    saved.end_of_dataloader = True
    order.save_data_order(_Accelerator([saved]), [], [], str(tmp_path))
    assert (tmp_path / order.FILE_NAME).is_file()

    resumed = _Loader(seed=2)
    order.load_data_order(_Accelerator([resumed]), [], str(tmp_path))
    assert resumed.iteration == 1
    assert torch.equal(resumed.synchronized_generator.get_state(), saved.synchronized_generator.get_state())


def test_a_checkpoint_without_the_file_or_with_other_loaders_restores_nothing(tmp_path, caplog):
    resumed = _Loader(seed=2)
    state = resumed.synchronized_generator.get_state()
    order.load_data_order(_Accelerator([resumed]), [], str(tmp_path))  # written by stock accelerate
    assert resumed.iteration == 0 and torch.equal(resumed.synchronized_generator.get_state(), state)

    order.save_data_order(_Accelerator([_Loader(), _Loader()]), [], [], str(tmp_path))
    with caplog.at_level("WARNING", logger="accel_npu"):
        order.load_data_order(_Accelerator([resumed]), [], str(tmp_path))
    assert torch.equal(resumed.synchronized_generator.get_state(), state)
    assert "2 DataLoaders' order, this run prepared 1" in caplog.text


def _epoch(loader) -> list[int]:
    """One epoch's samples, drawn as a prepared loader's iterator draws them (its start noted first)."""
    order.note_epoch_start(loader)
    return [int(batch[0]) for batch in loader]


@pytest.mark.parametrize("make", [upstream.kontext_sampler, upstream.flux2_sampler], ids=["kontext", "flux2"])
@pytest.mark.parametrize("mid_epoch", [False, True], ids=["epoch_end", "mid_epoch"])
def test_diffusers_bucket_samplers_resume_with_the_order_the_straight_run_draws(make, mid_epoch):
    """The script's sampler is rebuilt on resume; restored, its next epoch is the straight run's. accelerate
    restores the global ``random`` as it was at the save (its random_states file), as here."""
    random.seed(0)
    straight = torch.utils.data.DataLoader(upstream.OneBucket(), batch_sampler=make())
    first = _epoch(straight)
    if mid_epoch:  # saved after the second epoch's first batch: a resume replays that epoch
        order.note_epoch_start(straight)
        batches = iter(straight)
        expected = [int(next(batches)[0])]
        state, position = random.getstate(), order.loader_position(straight)
        expected += [int(batch[0]) for batch in batches]
    else:
        straight.end_of_dataloader = True  # as accelerate's DataLoaderShard at an epoch's last batch
        state, position = random.getstate(), order.loader_position(straight)
        straight.end_of_dataloader = False
        expected = _epoch(straight)
    assert position["samplers"], "the script's sampler was not found under the loader"
    assert first != expected

    def rebuilt():
        random.seed(0)  # the resumed run's set_seed, before the script builds its sampler
        loader = torch.utils.data.DataLoader(upstream.OneBucket(), batch_sampler=make())
        random.setstate(state)  # accelerate's load_state
        return loader

    resumed = rebuilt()
    order.restore_position(resumed, position)
    if mid_epoch and make is upstream.kontext_sampler:
        # its order is drawn from the global random, which accelerate restores as it was at the save, not at the
        # epoch's start: the replayed epoch is another order of the same batches
        assert sorted(_epoch(resumed)) == sorted(expected)
        return
    assert _epoch(resumed) == expected
    assert _epoch(rebuilt()) != expected  # the negative: rebuilt and not restored, the sampler draws another order


def test_the_scripts_sampler_is_found_below_accelerates_shard_and_the_module_random_is_left_out():
    from accelerate.data_loader import BatchSamplerShard

    sampler = upstream.kontext_sampler()
    loader = torch.utils.data.DataLoader(upstream.OneBucket(), batch_sampler=BatchSamplerShard(sampler, 2, 0))
    assert set(order.samplers_state(loader)) == {"batch_sampler.batch_sampler"}
    saved = order.samplers_state(loader)["batch_sampler.batch_sampler"]
    assert set(saved) == {"batches", "bucket_indices"}  # lists of index batches and of indices; ints left out
    random.seed(0)
    unseeded = upstream.bucket_batch_sampler(upstream.FLUX2)(upstream.OneBucket(), batch_size=1)
    assert (
        "generator"
        not in order.samplers_state(torch.utils.data.DataLoader(upstream.OneBucket(), batch_sampler=unseeded))[
            "batch_sampler"
        ]
    )  # seed None: its generator is the random module, accelerate's to restore


def test_a_sampler_that_does_not_match_the_checkpoint_is_left_as_it_is(caplog):
    loader = torch.utils.data.DataLoader(upstream.OneBucket(), batch_sampler=upstream.flux2_sampler())
    generator = loader.batch_sampler.generator.getstate()
    position = {"iteration": 0, "generator": None, "samplers": {"batch_sampler": {"generator": ("list", [1, 2])}}}
    position["samplers"]["batch_sampler.batch_sampler"] = {"batches": ("list", [[0]])}
    with caplog.at_level("WARNING", logger="accel_npu"):
        order.restore_position(loader, position)
    assert loader.batch_sampler.generator.getstate() == generator
    assert "batch_sampler.generator of BucketBatchSampler does not hold what the checkpoint saved" in caplog.text
    assert "a sampler at batch_sampler.batch_sampler, this loader has none there" in caplog.text


def _launch(mode, out, **env):
    proc = torchrun_launch([str(SCRIPT), mode, str(out)], env=base_env(**env), timeout=240)
    assert proc.returncode == 0, explain(proc)
    seen = [r["seen"] for r in results(proc)]
    assert len(seen) == 2, explain(proc)
    return seen


@pytest.mark.slow
def test_resume_draws_the_uninterrupted_runs_batches_and_noise_where_stock_replays_epoch_0(tmp_path):
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    ours.mkdir()
    stock.mkdir()
    straight, _, _ = run_concurrently(
        lambda: _launch("straight", tmp_path),
        lambda: _launch("first", ours),
        lambda: _launch("first", stock, ACCEL_NPU_DISABLE="1"),
    )
    assert (ours / "checkpoint-4" / order.FILE_NAME).is_file()
    assert not (stock / "checkpoint-4" / order.FILE_NAME).exists()
    resumed_end, resumed_mid, stock_end = run_concurrently(
        lambda: _launch("resume_end", ours),
        lambda: _launch("resume_mid", ours),
        lambda: _launch("resume_end", stock, ACCEL_NPU_DISABLE="1"),
    )
    for rank in (0, 1):
        # from an epoch's last batch: every later step's sample and noise as in the straight run
        assert resumed_end[rank] == straight[rank][4:]
        # mid-epoch, skipping the epoch's first batches: the same samples (the noise differs: the DataLoader's
        # own base-seed draw at the restarted epoch takes one value of the global RNG the straight run did not)
        assert [s[:2] for s in resumed_mid[rank]] == [s[:2] for s in straight[rank][6:]]
        # diffusers' BucketBatchSamplers (Kontext's in-place list, Flux2's private Random): from an epoch's last
        # batch as straight; mid-epoch Flux2's replays its epoch's order (Kontext's draws with the global random,
        # restored by accelerate as it was at the save: unit-tested above)
        assert [s[3:] for s in resumed_end[rank]] == [s[3:] for s in straight[rank][4:]]
        assert [s[4] for s in resumed_mid[rank]] == [s[4] for s in straight[rank][6:]]
    # stock replays epoch 0's order after the resume (the same steps, other samples), the samplers' too
    for column in (1, 3, 4):
        assert [s[column] for r in stock_end for s in r] != [s[column] for r in straight for s in r[4:]]


@pytest.fixture()
def fresh_accelerate_state():
    """accelerate's shared state reset before and after: an Accelerator built here must neither inherit an earlier
    test's (a DeepSpeed plugin) nor leave its own (cpu=True) to a later test in this worker."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _prepared_accelerator():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare_data_loader(torch.utils.data.DataLoader(list(range(16)), batch_size=4))
    hooks = [*accelerator._save_model_state_pre_hook.values(), *accelerator._load_model_state_pre_hook.values()]
    assert [type(h) for h in hooks] == [order.AcceleratorHook] * 2, hooks  # else the checks below prove nothing
    return accelerator, loader


def test_an_accelerator_with_the_hooks_pickles_and_is_freed_with_its_last_reference(fresh_accelerate_state):
    """As accelerate's own tests/test_accelerator.py test_can_pickle_dataloader and tests/test_data_loader.py
    test_ensure_dataloader_gets_cleaned_up, which failed with hooks that were closures over the Accelerator."""
    import gc
    import pickle
    import weakref

    accelerator, loader = _prepared_accelerator()
    loaded = pickle.loads(pickle.dumps(accelerator))
    assert len(loaded._dataloaders) == 1
    hook = next(iter(loaded._save_model_state_pre_hook.values()))
    assert hook._accelerator() is loaded  # the copy's hooks act on the copy
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1, 2, 3]
    refs = weakref.ref(accelerator), weakref.ref(loader)
    gc.disable()  # freed by reference counting alone, as upstream's test asks
    try:
        del accelerator, loader, iterator, hook, loaded
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


def test_a_hook_holding_its_accelerator_strongly_would_keep_it_alive(fresh_accelerate_state):
    """The negative: a closure over the Accelerator, as the hooks were, outlives the script's last reference."""
    import gc
    import weakref

    accelerator, _ = _prepared_accelerator()
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir, held=accelerator: None)
    ref = weakref.ref(accelerator)
    gc.disable()
    try:
        del accelerator
        assert ref() is not None
    finally:
        gc.enable()
        gc.collect()
