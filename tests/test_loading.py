"""Loading: truncation before reading, bad input, correct meta-init (parity with stock).

Tiny models from the real diffusers / transformers classes, random weights, saved locally.
"Stock" is the unwrapped original from the patch ledger, called in this same process.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import tiny_models as tm

from accel_npu.activation import activate
from accel_npu.errors import LoadError
from accel_npu.patching import original_of
from accel_npu.plugins.loading.diffusers import tensors_on_meta
from tests.page_cache import resident_fraction

activate()
from diffusers import QwenImageTransformer2DModel as QWEN_CLS  # noqa: E402  (a hard dependency)

DIFFUSERS_TARGET = "diffusers.models.modeling_utils:ModelMixin.from_pretrained"
TRANSFORMERS_TARGET = "transformers.modeling_utils:PreTrainedModel.from_pretrained"


def stock(target, cls):
    original = original_of(target)
    assert original is not None, f"{target} is not patched"
    return original.__get__(None, cls)


def _save(model, path: Path, dtype=None, shard="60KB"):
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(path), max_shard_size=shard)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {
        # the OOM case: a bf16 checkpoint of a deeper DiT, sharded with an index
        "qwen": _save(tm.randomize(tm.qwen()), root / "qwen", torch.bfloat16),
        "wan": _save(tm.randomize(tm.wan()), root / "wan"),
        "cosmos": _save(tm.randomize(tm.cosmos()), root / "cosmos", shard="10GB"),  # single file
        "llama": _save(tm.randomize(tm.llama()), root / "llama", shard="40KB"),
    }


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _plain_tensors(model):
    out = {}
    for mod_name, module in model.named_modules():
        for name, v in vars(module).items():
            if isinstance(v, torch.Tensor) and not name.startswith("_"):
                out[f"{mod_name}.{name}"] = v
    return out


def assert_identical(ours, ref):
    sd_o, sd_r = ours.state_dict(), ref.state_dict()
    assert list(sd_o) == list(sd_r)
    for k in sd_r:
        assert sd_o[k].dtype == sd_r[k].dtype, k
        assert torch.equal(sd_o[k], sd_r[k]), k
    bo, br = dict(ours.named_buffers()), dict(ref.named_buffers())  # incl. non-persistent
    assert list(bo) == list(br)
    for k in br:
        assert bo[k].dtype == br[k].dtype and torch.equal(bo[k], br[k]), k
    po, pr = _plain_tensors(ours), _plain_tensors(ref)
    assert list(po) == list(pr)
    for k in pr:
        assert po[k].dtype == pr[k].dtype and torch.equal(po[k], pr[k]), k
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert p.requires_grad == q.requires_grad, n
    assert ours.training == ref.training
    assert tensors_on_meta(ours) == []


# ------------------------------------------------------------------------------------------------
# 3. meta-init parity
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", ["1", "3"], ids=["1-load-thread", "3-load-threads"])
@pytest.mark.parametrize("kw", [{}, {"torch_dtype": torch.bfloat16}, {"num_layers": 2}], ids=["fp32", "bf16", "trunc"])
def test_qwen_parity_with_stock(ckpts, kw, threads, monkeypatch):
    monkeypatch.setenv("ACCEL_NPU_LOAD_THREADS", threads)  # casts ahead in a pool, or inline
    ours = QWEN_CLS.from_pretrained(ckpts["qwen"], **kw)
    ref = stock(DIFFUSERS_TARGET, QWEN_CLS)(str(ckpts["qwen"]), **kw)
    assert_identical(ours, ref)
    # QwenEmbedRope.pos_freqs / neg_freqs: plain tensor attributes, real and equal
    assert not ours.pos_embed.pos_freqs.is_meta and torch.equal(ours.pos_embed.neg_freqs, ref.pos_embed.neg_freqs)
    inputs = tm.qwen_inputs()
    dtype = kw.get("torch_dtype", torch.float32)
    for k in ("hidden_states", "encoder_hidden_states"):
        inputs[k] = inputs[k].to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(**inputs)[0], ref(**inputs)[0])


def test_wan_parity_nonpersistent_rope_buffers(ckpts):
    from diffusers import WanTransformer3DModel

    for kw in ({}, {"torch_dtype": torch.bfloat16}):
        ours = WanTransformer3DModel.from_pretrained(ckpts["wan"], **kw)
        ref = stock(DIFFUSERS_TARGET, WanTransformer3DModel)(str(ckpts["wan"]), **kw)
        assert "rope.freqs_cos" in dict(ours.named_buffers()) and "rope.freqs_cos" not in ours.state_dict()
        assert_identical(ours, ref)
        dt = kw.get("torch_dtype", torch.float32)
        x = dict(
            hidden_states=torch.randn(1, 4, 1, 4, 4).to(dt),
            timestep=torch.tensor([3]),
            encoder_hidden_states=torch.randn(1, 5, 32).to(dt),
            return_dict=False,
        )
        with torch.no_grad():
            assert torch.equal(ours(**x)[0], ref(**x)[0])


@pytest.mark.parametrize("threads", ["1", "2"])
def test_cosmos_parity_keep_in_fp32(ckpts, threads, monkeypatch):
    from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel

    monkeypatch.setenv("ACCEL_NPU_LOAD_THREADS", threads)
    ours = CosmosTransformer3DModel.from_pretrained(ckpts["cosmos"], torch_dtype=torch.bfloat16)
    ref = stock(DIFFUSERS_TARGET, CosmosTransformer3DModel)(str(ckpts["cosmos"]), torch_dtype=torch.bfloat16)
    assert_identical(ours, ref)
    assert ours.learnable_pos_embed.pos_emb_t.dtype == torch.float32  # _keep_in_fp32_modules
    assert ours.transformer_blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    x = dict(
        hidden_states=torch.randn(1, 4, 1, 8, 8, dtype=torch.bfloat16),
        timestep=torch.tensor([3.0]),
        encoder_hidden_states=torch.randn(1, 5, 32, dtype=torch.bfloat16),
        return_dict=False,
    )
    with torch.no_grad():
        assert torch.equal(ours(**x)[0], ref(**x)[0])


def test_vae_parity_deprecated_attention_blocks(tmp_path):
    """AutoencoderKL (pipelines' VAE) has attention blocks built for legacy key names."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = tm.randomize(
        AutoencoderKL(
            block_out_channels=(8, 16),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4,
            norm_num_groups=4,
            layers_per_block=1,
        )
    )
    vae.save_pretrained(str(tmp_path / "vae"))
    ours = AutoencoderKL.from_pretrained(tmp_path / "vae", torch_dtype=torch.float32)
    ref = stock(DIFFUSERS_TARGET, AutoencoderKL)(tmp_path / "vae", torch_dtype=torch.float32)
    assert_identical(ours, ref)
    assert ours.config._name_or_path == ref.config._name_or_path
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(ours(x).sample, ref(x).sample)


def test_transformers_tied_embeddings_parity_and_truncation(ckpts, monkeypatch):
    from transformers import LlamaForCausalLM

    ids = torch.tensor([[1, 5, 9, 3]])
    ours = LlamaForCausalLM.from_pretrained(ckpts["llama"])
    ref = stock(TRANSFORMERS_TARGET, LlamaForCausalLM)(str(ckpts["llama"]))
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # ties re-tied
    assert_identical(ours, ref)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)

    # ACCEL_NPU_TRUNCATE for a transformers class == stock with num_hidden_layers=2
    monkeypatch.setenv("ACCEL_NPU_TRUNCATE", "LlamaForCausalLM:2")
    short = LlamaForCausalLM.from_pretrained(ckpts["llama"])
    ref2 = stock(TRANSFORMERS_TARGET, LlamaForCausalLM)(str(ckpts["llama"]), num_hidden_layers=2)
    assert len(short.model.layers) == 2 and short.config.num_hidden_layers == 2
    assert short.lm_head.weight is short.model.embed_tokens.weight
    assert_identical(short, ref2)
    monkeypatch.delenv("ACCEL_NPU_TRUNCATE")

    # more layers than the checkpoint: stock silently initializes them randomly; we refuse
    deep = stock(TRANSFORMERS_TARGET, LlamaForCausalLM)(str(ckpts["llama"]), num_hidden_layers=5)
    assert len(deep.model.layers) == 5  # stock "works", layers 3-4 are random
    with pytest.raises(LoadError, match=r"num_hidden_layers=5: model\.layers\.3\."):
        LlamaForCausalLM.from_pretrained(ckpts["llama"], num_hidden_layers=5)


def test_transformers_truncation_opens_only_needed_shards(tmp_path, caplog):
    from transformers import LlamaForCausalLM

    intact = _save(tm.randomize(tm.llama(num_hidden_layers=6)), tmp_path / "intact", shard="40KB")
    path = _copy(intact, tmp_path / "q")
    wm = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    dropped = tuple(f"model.layers.{i}." for i in range(2, 6))
    kept_files = {f for k, f in wm.items() if not k.startswith(dropped)}
    dropped_only = sorted(set(wm.values()) - kept_files)
    assert dropped_only
    for name in dropped_only:
        (path / name).write_bytes(b"\0garbage")
    from safetensors import SafetensorError

    # stock opens every shard, the dropped layers' garbage ones too
    with pytest.raises(SafetensorError, match="Error while deserializing header"):
        stock(TRANSFORMERS_TARGET, LlamaForCausalLM)(str(path), num_hidden_layers=2)
    ref = stock(TRANSFORMERS_TARGET, LlamaForCausalLM)(str(intact), num_hidden_layers=2)
    caplog.clear()
    caplog.set_level(logging.INFO)
    ours = LlamaForCausalLM.from_pretrained(str(path), num_hidden_layers=2)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert_identical(ours, ref)
    assert ours.config._name_or_path == str(path)
    lines = [r.getMessage() for r in caplog.records if "truncated to num_hidden_layers=2" in r.getMessage()]
    assert len(lines) == 1 and f"of {len(set(wm.values()))} shard(s)" in lines[0] and "layers 2-5" in lines[0]
    assert not [r for r in caplog.records if "LOAD REPORT" in r.getMessage()]  # no per-key table


# ------------------------------------------------------------------------------------------------
# 1. truncation before reading
# ------------------------------------------------------------------------------------------------
def _shards_of(path: Path):
    index = json.loads((path / "diffusion_pytorch_model.safetensors.index.json").read_text())
    return index["weight_map"]


def test_truncation_opens_only_needed_shards(ckpts, tmp_path, caplog):
    path = _copy(ckpts["qwen"], tmp_path / "q")
    wm = _shards_of(path)
    kept_files = {f for k, f in wm.items() if not k.startswith(("transformer_blocks.2.", "transformer_blocks.3."))}
    dropped_only = sorted(set(wm.values()) - kept_files)
    assert dropped_only, "fixture should have shards that hold only blocks 2-3"
    for name in dropped_only:  # make them unreadable garbage: reading them would fail
        (path / name).write_bytes(b"\0garbage")

    # stock opens every shard, so it fails on the garbage
    with pytest.raises(OSError, match=r"Unable to load weights from checkpoint file .*-of-\d+\.safetensors"):
        stock(DIFFUSERS_TARGET, QWEN_CLS)(str(path), num_layers=2)

    caplog.set_level(logging.INFO)
    model = QWEN_CLS.from_pretrained(path, num_layers=2)
    assert len(model.transformer_blocks) == 2 and model.config.num_layers == 2
    assert tensors_on_meta(model) == []
    ours_lines = [r.getMessage() for r in caplog.records if r.name == "accel_npu"]
    summary = [m for m in ours_lines if "truncated to num_layers=2 of 4" in m]
    assert len(summary) == 1, ours_lines
    assert f"of {len(set(wm.values()))} shard(s)" in summary[0] and "layers 2-3 (not read)" in summary[0]
    # no per-key flood from diffusers
    flood = [r for r in caplog.records if "were not used when initializing" in r.getMessage()]
    assert flood == []
    # identical to the untruncated checkpoint's first two blocks
    full = QWEN_CLS.from_pretrained(ckpts["qwen"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, full.state_dict()[k]), k


def test_accel_npu_truncate_env_makes_script_slicing_a_noop(ckpts, monkeypatch):
    monkeypatch.setenv("ACCEL_NPU_TRUNCATE", "QwenImageTransformer2DModel:2, SomeOtherModel:1")
    model = QWEN_CLS.from_pretrained(ckpts["qwen"])  # the script asks for the whole model
    assert len(model.transformer_blocks) == 2
    blocks = list(model.transformer_blocks)
    model.transformer_blocks = model.transformer_blocks[:2]  # the slicing users write after loading
    assert list(model.transformer_blocks) == blocks  # same modules: a no-op
    ref = stock(DIFFUSERS_TARGET, QWEN_CLS)(str(ckpts["qwen"]), num_layers=2)
    assert_identical(model, ref)
    # the script's explicit depth wins over the environment
    assert len(QWEN_CLS.from_pretrained(ckpts["qwen"], num_layers=3).transformer_blocks) == 3


def test_accel_npu_truncate_rejects_nonsense(ckpts, monkeypatch):
    from accel_npu.errors import ConfigError

    monkeypatch.setenv("ACCEL_NPU_TRUNCATE", "QwenImageTransformer2DModel=2")
    with pytest.raises(ConfigError, match="ClassName:layers"):
        QWEN_CLS.from_pretrained(ckpts["qwen"])


def test_more_layers_than_checkpoint_is_an_error(ckpts):
    # stock: the extra block stays on meta while the warning says "newly initialized"
    ref = stock(DIFFUSERS_TARGET, QWEN_CLS)(str(ckpts["qwen"]), num_layers=5)
    assert "transformer_blocks.4.img_mod.1.weight" in tensors_on_meta(ref)
    with pytest.raises(LoadError, match=r"transformer_blocks\.4\..*num_layers=5.*has 4"):
        QWEN_CLS.from_pretrained(ckpts["qwen"], num_layers=5)


# ------------------------------------------------------------------------------------------------
# 2. bad input: one error naming file and key, nothing returned
# ------------------------------------------------------------------------------------------------
def _needed_shard(path: Path, key="transformer_blocks.0.img_mod.1.weight") -> str:
    return _shards_of(path)[key]


def test_truncated_shard_names_file_and_key(ckpts, tmp_path):
    path = _copy(ckpts["qwen"], tmp_path / "q")
    shard = path / _needed_shard(path)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])  # an interrupted download
    with pytest.raises(OSError) as stock_exc:  # stock names the file, not what is wrong or which key
        stock(DIFFUSERS_TARGET, QWEN_CLS)(str(path))
    assert "Unable to load weights" in str(stock_exc.value) and "key" not in str(stock_exc.value)
    with pytest.raises(LoadError) as exc:
        QWEN_CLS.from_pretrained(path)
    msg = str(exc.value)
    assert str(shard) in msg and "truncated" in msg and "key '" in msg


def test_corrupt_header_names_file(ckpts, tmp_path):
    path = _copy(ckpts["qwen"], tmp_path / "q")
    shard = path / _needed_shard(path)
    data = bytearray(shard.read_bytes())
    data[8:20] = b"not json at "
    shard.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=f"{shard}.*not a readable safetensors file"):
        QWEN_CLS.from_pretrained(path)


def test_missing_shard_names_file_and_key(ckpts, tmp_path):
    path = _copy(ckpts["qwen"], tmp_path / "q")
    shard = path / _needed_shard(path)
    shard.unlink()
    with pytest.raises(LoadError, match=f"shard {shard} named in .* is missing .*should hold '"):
        QWEN_CLS.from_pretrained(path)


def test_index_naming_a_key_no_shard_has(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(ckpts["qwen"], tmp_path / "q")
    key = "transformer_blocks.1.attn.to_q.weight"
    shard = path / _shards_of(path)[key]
    tensors = load_file(str(shard))
    del tensors[key]  # the index still names it
    save_file(tensors, str(shard), metadata={"format": "pt"})
    # stock: returns a model with that weight silently left on meta
    ref = stock(DIFFUSERS_TARGET, QWEN_CLS)(str(path))
    assert key in tensors_on_meta(ref)
    with pytest.raises(LoadError, match=f"key '{key}' is in {shard}.*no such tensor"):
        QWEN_CLS.from_pretrained(path)


def test_index_and_shards_that_disagree(ckpts, tmp_path):
    path = _copy(ckpts["qwen"], tmp_path / "q")
    index_file = path / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    key = "transformer_blocks.1.attn.to_q.weight"
    wrong = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][key])
    index["weight_map"][key] = wrong
    index_file.write_text(json.dumps(index))
    with pytest.raises(LoadError, match=f"key '{key}' is in {path / wrong}.*do not belong together"):
        QWEN_CLS.from_pretrained(path)


# ------------------------------------------------------------------------------------------------
# pass-through: calls we do not improve reach stock unchanged
# ------------------------------------------------------------------------------------------------
def test_unsupported_calls_go_to_stock(ckpts, tmp_path):
    # device_map is stock's business
    m = QWEN_CLS.from_pretrained(ckpts["qwen"], device_map="cpu")
    assert len(m.transformer_blocks) == 4
    # a non-existent local path: stock's own error, not ours
    with pytest.raises(OSError, match="is not the path to a directory containing a config.json file") as exc:
        QWEN_CLS.from_pretrained(str(tmp_path / "nope"), local_files_only=True)
    assert not isinstance(exc.value, LoadError)


# ------------------------------------------------------------------------------------------------
# 5. frozen towers: pipeline components load outside zero.Init (in-process half; the accelerate
#    zero3_init_context_manager half, with stock's failure, is in test_loading_acceptance.py)
# ------------------------------------------------------------------------------------------------
def test_pipeline_components_load_outside_zero_init(tmp_path, monkeypatch):
    from diffusers import DiffusionPipeline
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    class TinyPipeline(DiffusionPipeline):
        def __init__(self, transformer, text_encoder):
            super().__init__()
            self.register_modules(transformer=transformer, text_encoder=text_encoder)

    TinyPipeline(transformer=tm.randomize(tm.qwen()), text_encoder=tm.randomize(tm.llama())).save_pretrained(
        str(tmp_path / "pipe")
    )
    monkeypatch.setenv("ACCEL_NPU_TRUNCATE", "QwenImageTransformer2DModel:2")
    ds = HfDeepSpeedConfig(
        {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}
    )
    try:
        assert is_deepspeed_zero3_enabled()
        pipe = TinyPipeline.from_pretrained(tmp_path / "pipe")
        assert is_deepspeed_zero3_enabled()  # restored afterwards
    finally:
        unset_hf_deepspeed_config()
        del ds
    p = next(pipe.text_encoder.parameters())
    assert not hasattr(p, "ds_id") and p.dtype == torch.float32 and p.numel() > 0  # whole, checkpoint dtype
    assert len(pipe.transformer.transformer_blocks) == 2  # ACCEL_NPU_TRUNCATE reaches pipeline components
    assert tensors_on_meta(pipe.transformer) == [] and tensors_on_meta(pipe.text_encoder) == []


def test_load_threads_share_the_nodes_cores_among_loading_ranks(monkeypatch):
    import os

    from accel_npu.errors import ConfigError
    from accel_npu.plugins.loading.slots import load_threads

    monkeypatch.delenv("ACCEL_NPU_LOAD_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert [load_threads(n) for n in (1, 2, 3, 8, 16)] == [4, 4, 2, 1, 1]  # at most 4, at least 1
    monkeypatch.setenv("ACCEL_NPU_LOAD_THREADS", "3")
    assert load_threads(8) == 3
    monkeypatch.setenv("ACCEL_NPU_LOAD_THREADS", "many")
    with pytest.raises(ConfigError, match="ACCEL_NPU_LOAD_THREADS='many'"):
        load_threads(1)


@pytest.mark.parametrize("threads", [1, 2])
def test_each_shard_opened_once_closed_when_read_and_the_pool_crosses_shard_boundaries(ckpts, threads, monkeypatch):
    """Witness: safetensors' own safe_open, wrapped to record opens and closes. With a pool the
    next tensors are cast ahead across a shard boundary (no thread idles on a shard's last
    tensor), so two shards may be open at once, never more; each is opened once, all are closed.

    Whether the next shard opens before the last tensor of the current one is done depends on
    scheduling, so with a pool each shard's last read waits (up to 30 s) for the next shard to
    open: a pool that crossed no boundary would leave it waiting and the count of crossings short."""
    import threading

    import safetensors

    from accel_npu._torch.safetensors_io import open_checkpoint
    from accel_npu.plugins.loading.lazy import LazyTensors

    real, opened, live, peak, crossed = safetensors.safe_open, [], set(), [0], []
    ckpt = open_checkpoint(str(ckpts["qwen"]))
    keys = sorted(ckpt.weight_map)
    lazy = LazyTensors(ckpt, keys, convert=lambda k, t: t.float(), threads=threads)
    files = list(lazy.files().items())
    shards = [name for name, _ in files]
    assert len(shards) > 3 and all(len(shard_keys) > 2 * threads for _, shard_keys in files)
    # the last key of each shard but the last -> the event set when the next shard opens
    next_open = {shard_keys[-1]: threading.Event() for _, shard_keys in files[:-1]}
    opens = {ckpt.path(name): next_open[prev[-1]] for (_, prev), (name, _) in zip(files, files[1:])}
    lock = threading.Lock()

    class Recorded:
        def __init__(self, path, **kwargs):
            self.path, self.inner = path, real(path, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            with lock:
                opened.append(self.path)
                live.add(self.path)
                peak[0] = max(peak[0], len(live))
            if self.path in opens:
                opens[self.path].set()
            return self

        def __exit__(self, *exc):
            with lock:
                live.discard(self.path)
            return self.inner.__exit__(*exc)

        def get_tensor(self, key):
            if threads > 1 and key in next_open and next_open[key].wait(30):
                crossed.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Recorded)
    got = list(lazy.items())
    assert [k for k, _ in got] == lazy.order() and sorted(k for k, _ in got) == keys
    assert sorted(opened) == sorted(ckpt.path(s) for s in shards) and not live
    assert peak[0] == (2 if threads > 1 else 1)
    assert len(crossed) == (len(shards) - 1 if threads > 1 else 0)
    monkeypatch.setattr(safetensors, "safe_open", real)
    for k, t in got:
        with real(ckpt.path(ckpt.weight_map[k]), framework="pt") as f:
            assert torch.equal(t, f.get_tensor(k).float()), k


@pytest.mark.skipif(sys.platform != "linux", reason="posix_fadvise and mincore as Linux has them")
def test_readahead_requests_every_byte_of_the_window_not_one_readahead_size(tmp_path):
    """One POSIX_FADV_WILLNEED reads at most the device's readahead size (Linux mm/readahead.c,
    force_page_cache_ra); the readahead asks for the whole window. Witness: the page cache
    (mincore). A single request over the same range is the control: it leaves most pages unread
    (where it does not, the kernel has no such cap and there is nothing to tell apart)."""
    import os

    from safetensors.torch import save_file

    from accel_npu._torch.safetensors_io import DIFFUSERS_WEIGHTS as NAME
    from accel_npu._torch.safetensors_io import open_checkpoint
    from accel_npu.plugins.loading.lazy import Readahead, _readahead_bytes

    fd = os.open(tmp_path, os.O_RDONLY)
    piece = _readahead_bytes(fd)
    os.close(fd)
    if piece > (16 << 20):
        pytest.skip(f"this device reads {piece >> 20} MiB per request: too large to tell a window from one")
    nbytes = max(4 * piece, 32 << 20)
    save_file(
        {"a.weight": torch.ones(nbytes, dtype=torch.uint8), "b.weight": torch.ones(nbytes, dtype=torch.uint8)},
        str(tmp_path / NAME),
    )
    path = str(tmp_path / NAME)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)

    def drop():
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return resident_fraction(path, 0, os.path.getsize(path))

    if drop() > 0.1:
        os.close(fd)
        pytest.skip("this filesystem keeps its pages (tmpfs?): nothing to read ahead")
    ckpt = open_checkpoint(str(tmp_path))
    a_begin, a_end = ckpt.headers[NAME]["a.weight"][2:4]
    b_begin, b_end = ckpt.headers[NAME]["b.weight"][2:4]

    def settled(begin, end):  # the requests are asynchronous: wait for the reads to land
        deadline, frac = time.monotonic() + 10, 0.0
        while time.monotonic() < deadline:
            frac = resident_fraction(path, begin, end)
            if frac > 0.95:
                break
            time.sleep(0.05)
        return frac

    os.posix_fadvise(fd, a_begin, a_end - a_begin, os.POSIX_FADV_WILLNEED)  # the control
    time.sleep(0.5)
    if resident_fraction(path, a_begin, a_end) > 0.5:
        os.close(fd)
        pytest.skip("this kernel reads a whole WILLNEED range in one request: nothing to tell apart")
    drop()
    ahead = Readahead(ckpt, {NAME: ["a.weight", "b.weight"]}, window=a_end - a_begin)
    try:
        ahead.reached("a.weight")
        assert settled(a_begin, a_end) > 0.95
        assert resident_fraction(path, b_begin + piece, b_end) < 0.5  # nothing past the window
        ahead.reached("b.weight")
        assert settled(b_begin, b_end) > 0.95
        assert ahead.requested_ranges() == {NAME: [(a_begin, b_end)]}
    finally:
        ahead.close()
        os.close(fd)


@pytest.mark.parametrize(
    "casting,device_readahead,past_window",
    [
        (True, 2 << 20, False),  # a casting load on a device that reads far ahead: first window only
        (True, 128 << 10, True),  # Linux's default readahead: the faults alone would read too little ahead
        (False, 2 << 20, True),  # nothing to cast: reads bound the load, every window is requested
    ],
)
def test_a_casting_readahead_leaves_what_lies_past_its_first_window_to_the_faults(
    tmp_path, monkeypatch, casting, device_readahead, past_window
):
    """Witness: the posix_fadvise calls themselves (offset, length), recorded at the os module."""
    import os

    from safetensors.torch import save_file

    from accel_npu._torch.safetensors_io import DIFFUSERS_WEIGHTS as NAME
    from accel_npu._torch.safetensors_io import open_checkpoint
    from accel_npu.plugins.loading import lazy

    size = 1 << 20
    save_file({f"t{i}.weight": torch.ones(size, dtype=torch.uint8) for i in range(16)}, str(tmp_path / NAME))
    ckpt = open_checkpoint(str(tmp_path))
    keys = sorted(ckpt.headers[NAME], key=lambda k: ckpt.headers[NAME][k][2])
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, at, n, advice: calls.append((at, n, advice)), raising=False)
    monkeypatch.setattr(lazy, "_readahead_bytes", lambda fd: device_readahead)
    ahead = lazy.Readahead(ckpt, {NAME: keys}, window=4 * size, casting=casting)
    try:
        for k in keys:
            ahead.reached(k)
    finally:
        ahead.close()
    assert {advice for _, _, advice in calls} == {os.POSIX_FADV_WILLNEED}
    first = ckpt.headers[NAME][keys[0]][2]
    last = ckpt.headers[NAME][keys[-1]][3]
    covered = sum(n for _, n, _ in calls)
    assert min(at for at, _, _ in calls) == first
    if past_window:
        assert covered == last - first and max(at + n for at, n, _ in calls) == last
    else:
        assert covered == 4 * size and max(at + n for at, n, _ in calls) == first + 4 * size


@pytest.mark.parametrize("cast_all,casting", [(True, True), (False, False)])
def test_a_load_reads_as_a_cast_only_when_most_of_its_bytes_are_cast(tmp_path, monkeypatch, cast_all, casting):
    """bf16 weights with a small fp32-kept norm (``_keep_in_fp32_modules``) are read like a bf16
    load: the reads bound it, so the readahead keeps its rolling window."""
    from safetensors.torch import save_file

    from accel_npu._torch.safetensors_io import DIFFUSERS_WEIGHTS as NAME
    from accel_npu._torch.safetensors_io import open_checkpoint
    from accel_npu.plugins.loading import prefetch

    save_file(
        {
            "big.weight": torch.ones(1 << 20, dtype=torch.bfloat16),
            "norm.weight": torch.ones(1024, dtype=torch.bfloat16),
        },
        str(tmp_path / NAME),
    )
    ckpt = open_checkpoint(str(tmp_path))
    made = []

    class Recorded(prefetch.Readahead):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("casting", False))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(prefetch, "Readahead", Recorded)

    def target_dtype(key, stored):
        return torch.float32 if cast_all or key.startswith("norm") else torch.bfloat16

    early = prefetch.Prefetch(ckpt, list(ckpt.weight_map), target_dtype, threads=1).start("test")
    try:
        got = {k: early.future(k).result() for k in (["big.weight", "norm.weight"] if cast_all else ["norm.weight"])}
    finally:
        early.close()
    assert made == [casting]
    assert all(t.dtype == torch.float32 and torch.equal(t, torch.ones_like(t)) for t in got.values())


# ------------------------------------------------------------------------------------------------
# reading while the model is built (plugins/loading/prefetch.py)
# ------------------------------------------------------------------------------------------------
def _record_takes(monkeypatch):
    from accel_npu.plugins.loading import prefetch

    taken = {}
    real_future = prefetch.Prefetch.future

    def future(self, key):
        got = real_future(self, key)
        if got is not None:
            taken[key] = got.result()
        return got

    monkeypatch.setattr(prefetch.Prefetch, "future", future)
    return taken


def _hold_construction(monkeypatch, seconds: float):
    """Building the model on meta takes ``seconds`` longer: the prefetch runs for that long before the
    placement takes over."""
    from accel_npu.plugins.loading import diffusers as loading_diffusers

    real_build = loading_diffusers.build_on_meta

    def slow_build(*args, **kwargs):
        time.sleep(seconds)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(loading_diffusers, "build_on_meta", slow_build)


def test_prefetch_guesses_the_kept_keys_before_the_model_exists(ckpts):
    from accel_npu._torch.safetensors_io import open_checkpoint
    from accel_npu.plugins.loading.prefetch import predicted_keys

    ckpt = open_checkpoint(str(ckpts["qwen"]))
    for depth in (2, 4):
        model = QWEN_CLS.from_pretrained(ckpts["qwen"], num_layers=depth)
        kept = {k for k in model.state_dict() if k in ckpt.weight_map}
        assert set(predicted_keys(ckpt, depth, 4)) == kept, depth


@pytest.mark.parametrize("threads", ["1", "2"])
def test_prefetched_casts_are_what_the_model_holds(ckpts, threads, monkeypatch):
    # bf16 file, fp32 model: every tensor is cast, in the load threads, while the model is built
    # (construction held for 0.5 s: a tiny model's few MB are cast long before it ends)
    _hold_construction(monkeypatch, 0.5)
    monkeypatch.setenv("ACCEL_NPU_LOAD_THREADS", threads)
    taken = _record_takes(monkeypatch)
    ours = QWEN_CLS.from_pretrained(ckpts["qwen"], num_layers=2)
    sd = ours.state_dict()
    from_file = {k for k in sd if not k.startswith("pos_embed.")}
    assert set(taken) == from_file
    assert all(sd[k].data_ptr() == taken[k].data_ptr() for k in taken)  # used, not read again
    monkeypatch.undo()
    assert_identical(ours, stock(DIFFUSERS_TARGET, QWEN_CLS)(str(ckpts["qwen"]), num_layers=2))


def test_prefetch_stops_at_its_byte_bound_and_the_placement_reads_the_rest(ckpts, monkeypatch):
    # one tensor's worth of bytes: construction held for 0.5 s still ends with one prefetched cast; the
    # placement reads every other tensor itself and the model equals stock's
    from accel_npu.plugins.loading import prefetch

    _hold_construction(monkeypatch, 0.5)
    monkeypatch.setattr(prefetch, "PREFETCH_BYTES", 1)
    taken = _record_takes(monkeypatch)
    ours = QWEN_CLS.from_pretrained(ckpts["qwen"], num_layers=2)
    assert len(taken) == 1, sorted(taken)
    monkeypatch.undo()
    assert_identical(ours, stock(DIFFUSERS_TARGET, QWEN_CLS)(str(ckpts["qwen"]), num_layers=2))


def test_a_wrong_dtype_guess_is_read_again(ckpts, monkeypatch):
    # guess fp16 where the model is built in fp32: each guessed tensor is refused and read from the file
    import accel_npu.plugins.loading.prefetch as prefetch

    real_init = prefetch.Prefetch.__init__

    def guess_fp16(self, ckpt, keys, target_dtype, threads):
        real_init(self, ckpt, keys, lambda k, s: None if target_dtype(k, s) is None else torch.float16, threads)

    monkeypatch.setattr(prefetch.Prefetch, "__init__", guess_fp16)
    taken = _record_takes(monkeypatch)
    ours = QWEN_CLS.from_pretrained(ckpts["qwen"])
    assert taken and all(t.dtype == torch.float16 for t in taken.values())
    monkeypatch.undo()
    assert_identical(ours, stock(DIFFUSERS_TARGET, QWEN_CLS)(str(ckpts["qwen"])))


def test_prefetch_pieces_split_tensors_and_every_slice_lands(ckpts, monkeypatch):
    # pieces of 1 KiB: every tensor larger than that is cast slice by slice, by both threads; each one
    # the model takes is the prefetch's (one future a tensor), and the model equals stock's
    from accel_npu.plugins.loading import prefetch

    monkeypatch.setattr(prefetch, "PIECE_BYTES", 1024)
    monkeypatch.setenv("ACCEL_NPU_LOAD_THREADS", "2")
    taken = _record_takes(monkeypatch)
    ours = QWEN_CLS.from_pretrained(ckpts["qwen"], num_layers=2)
    sd = ours.state_dict()
    assert any(t.numel() * 2 > 1024 for t in taken.values())  # split across pieces
    assert all(sd[k].data_ptr() == taken[k].data_ptr() for k in taken)
    monkeypatch.undo()
    assert_identical(ours, stock(DIFFUSERS_TARGET, QWEN_CLS)(str(ckpts["qwen"]), num_layers=2))


def test_a_failed_prefetch_cast_is_read_again(ckpts, monkeypatch):
    # the prefetch's copy fails (as out of memory would): the placement reads each tensor itself and
    # the model equals stock's; no future is left for it to wait on
    real_copy = torch._foreach_copy_
    failed = []

    def failing_copy(dst, src):
        import threading

        if threading.current_thread().name.startswith("accel-npu-prefetch"):
            failed.append(len(dst))
            raise RuntimeError("out of memory (test)")
        return real_copy(dst, src)

    def failing_piece(dst, src):
        failing_copy([dst], [src])

    from accel_npu.plugins.loading import prefetch

    monkeypatch.setattr(torch, "_foreach_copy_", failing_copy)
    monkeypatch.setattr(prefetch, "copy_prefaulted", failing_piece)  # pieces copied after construction
    ours = QWEN_CLS.from_pretrained(ckpts["qwen"], num_layers=2)
    assert failed
    monkeypatch.undo()
    assert_identical(ours, stock(DIFFUSERS_TARGET, QWEN_CLS)(str(ckpts["qwen"]), num_layers=2))


def test_a_piece_that_fails_mid_tensor_fails_that_tensor_only(ckpts, monkeypatch):
    # pieces of 1 KiB, one thread; the second copy fails: the tensors it held fail (the placement reads
    # them again), the rest of a split tensor is skipped, and every other tensor is the file's, cast
    from safetensors import safe_open

    from accel_npu._torch.safetensors_io import open_checkpoint, validate
    from accel_npu.plugins.loading import prefetch
    from accel_npu.plugins.loading.lazy import Readahead, _OpenShards

    monkeypatch.setattr(prefetch, "PIECE_BYTES", 1024)
    ckpt = open_checkpoint(str(ckpts["qwen"]))
    keys = [k for k in ckpt.weight_map if not k.startswith("pos_embed.")]
    validate(ckpt, keys)
    files = prefetch.Prefetch._in_order(ckpt, keys)
    casts = [(name, k, torch.float32, math.prod(ckpt.headers[name][k][1])) for name, ks in files.items() for k in ks]
    shards, ahead = _OpenShards(ckpt), Readahead(ckpt, files)
    pieces = prefetch._Pieces(casts, shards, ahead, ckpt, threads=1)
    real_copy, calls, failed = torch._foreach_copy_, [], set()

    def copy(dst, src):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (test)")
        return real_copy(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", copy)
    try:
        while pieces.cast_next():
            pass
    finally:
        shards.close_all()
        ahead.close()
    for name, k, _, _ in casts:
        future = pieces.futures[k]
        assert future.done(), k
        if future.exception() is not None:
            failed.add(k)
            continue
        with safe_open(str(ckpts["qwen"] / name), framework="pt") as f:
            assert torch.equal(future.result(), f.get_tensor(k).float()), k
    assert failed and len(failed) < len(casts)


# ------------------------------------------------------------------------------------------------
# casts into fresh memory faulted in ahead (accel_npu/_torch/memory.py)
# ------------------------------------------------------------------------------------------------
def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_prefault_makes_fresh_pages_resident():
    # witness: the process's anonymous resident memory, before and after, with no byte written
    from accel_npu._torch.memory import prefault

    nbytes = 64 << 20
    fresh = torch.empty(nbytes, dtype=torch.uint8)  # untouched: no page resident yet
    before = _rss_anon()
    if not prefault(fresh.data_ptr(), nbytes):
        pytest.skip("no MADV_POPULATE_WRITE here (Linux before 5.14, or not glibc)")
    assert _rss_anon() - before > 0.9 * nbytes


@pytest.mark.parametrize(
    "shape, stored, wanted",
    [
        ((3000, 1000), torch.bfloat16, torch.float32),  # pieces of PREFAULT_BYTES and a short last one
        ((1001, 999), torch.float16, torch.float32),  # a size no page divides
        ((7,), torch.bfloat16, torch.float32),  # smaller than a piece: one copy
        ((2048, 1024), torch.float32, torch.bfloat16),
    ],
)
def test_to_fresh_is_to(shape, stored, wanted, monkeypatch):
    from accel_npu._torch import memory

    x = torch.randn(shape).to(stored)[1:]  # a tensor that starts off a page boundary
    for works in (None, False):  # the madvise tried, and missing (copied as is)
        monkeypatch.setattr(memory, "_prefault_works", works)
        got = memory.to_fresh(x, wanted)
        assert got.dtype == wanted and got.shape == x.shape and got.is_contiguous()
        assert torch.equal(got, x.to(wanted))
    same = torch.ones(4)
    assert memory.to_fresh(same, torch.float32) is same  # as .to(): the tensor itself
    strided = torch.randn(2000, 1000).to(torch.bfloat16).t()
    assert torch.equal(memory.to_fresh(strided, torch.float32), strided.to(torch.float32))


@pytest.mark.parametrize("threads", ["1", "2"])
def test_casts_in_prefaulted_pieces_equal_stock(ckpts, threads, monkeypatch):
    # pieces of one page: after construction the prefetch copies piece by piece, and the placement
    # casts what lies past the prefetch's bound the same way; the model equals stock's
    from accel_npu._torch import memory
    from accel_npu.plugins.loading import prefetch

    monkeypatch.setattr(memory, "PREFAULT_BYTES", 4096)
    monkeypatch.setattr(prefetch, "PREFETCH_BYTES", 64 << 10)
    monkeypatch.setenv("ACCEL_NPU_LOAD_THREADS", threads)
    real, faulted = memory.prefault, []

    def prefault(address, nbytes):
        faulted.append(nbytes)
        return real(address, nbytes)

    monkeypatch.setattr(memory, "prefault", prefault)
    ours = QWEN_CLS.from_pretrained(ckpts["qwen"], num_layers=2)
    assert faulted
    monkeypatch.undo()
    assert_identical(ours, stock(DIFFUSERS_TARGET, QWEN_CLS)(str(ckpts["qwen"]), num_layers=2))


@pytest.fixture
def gc_every_allocation():
    """The cyclic collector runs at (almost) every allocation; ``events`` records each collection."""
    import gc

    events: list[str] = []

    def record(phase, info):
        if phase == "start":
            events.append(f"gc{info['generation']}")

    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(1, 1, 1)
    gc.enable()
    gc.callbacks.append(record)
    try:
        yield events
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()


def _mark_construction(monkeypatch, events):
    import functools

    real_init = QWEN_CLS.__init__

    @functools.wraps(real_init)  # diffusers reads the config's arguments from __init__'s signature
    def init(self, *args, **kwargs):
        events.append("init>")
        real_init(self, *args, **kwargs)
        events.append("init<")

    monkeypatch.setattr(QWEN_CLS, "__init__", init)


def test_no_cyclic_collection_runs_while_the_model_is_built(ckpts, gc_every_allocation, monkeypatch):
    # a full collection walks the whole heap holding the GIL (the load threads wait): the load pauses
    # the collector; stock collects while it builds; the collector is on again after the call
    import gc

    events = gc_every_allocation
    _mark_construction(monkeypatch, events)
    ours = QWEN_CLS.from_pretrained(ckpts["qwen"])
    built = events[events.index("init>") : events.index("init<")]
    assert built == ["init>"], built[:5]
    assert gc.isenabled()
    del events[:]
    ref = stock(DIFFUSERS_TARGET, QWEN_CLS)(str(ckpts["qwen"]))
    built = events[events.index("init>") : events.index("init<")]
    assert any(e.startswith("gc") for e in built), built[:5]
    monkeypatch.undo()
    assert_identical(ours, ref)


def test_a_collector_the_user_disabled_stays_disabled_after_a_load(ckpts):
    import gc

    gc.disable()
    try:
        QWEN_CLS.from_pretrained(ckpts["qwen"], num_layers=2)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_comes_back_after_the_last_of_nested_and_concurrent_pauses():
    import gc
    import threading

    from accel_npu._torch.memory import cyclic_gc_paused

    assert gc.isenabled()
    inside, leave = threading.Event(), threading.Event()

    def other_load():
        with cyclic_gc_paused():
            inside.set()
            leave.wait(10)

    worker = threading.Thread(target=other_load)
    with cyclic_gc_paused():
        worker.start()
        inside.wait(10)
        with cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's load is still running
    leave.set()
    worker.join()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), cyclic_gc_paused():
        raise RuntimeError("a failed load")
    assert gc.isenabled()


def test_spectral_norms_computed_weight_is_no_missing_tensor(tmp_path):
    """torch's spectral_norm keeps ``weight`` as a plain attribute its forward pre-hook computes from ``weight_orig``
    and ``weight_u``/``weight_v`` before every forward: built on meta it stays meta until the first forward, with
    stock too (diffusers v0.40.0's vqgan/discriminator.py, loaded by train_vqgan.py's load hook on resume). It loads;
    a plain tensor attribute nothing computes still fails (test_loading_acceptance: tensors neither in the checkpoint
    nor created by __init__)."""
    import torch
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config

    class Critic(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, width: int = 4):
            super().__init__()
            self.conv = torch.nn.utils.spectral_norm(torch.nn.Conv2d(3, width, 3))

        def forward(self, x):
            return self.conv(x)

    torch.manual_seed(0)
    Critic().save_pretrained(str(tmp_path / "critic"))
    ref = stock(DIFFUSERS_TARGET, Critic)(str(tmp_path / "critic"))
    assert tensors_on_meta(ref) == []  # spectral norm's computed weight is not counted
    ours = Critic.from_pretrained(str(tmp_path / "critic"))
    x = torch.randn(1, 3, 8, 8)
    ref.eval(), ours.eval()
    assert torch.equal(ours(x), ref(x))  # the first forward computes the weight from the loaded tensors
    assert torch.equal(ours.conv.weight_orig, ref.conv.weight_orig)
    # a meta attribute no hook computes is still one
    ours.conv.scale = torch.empty(2, device="meta")
    assert tensors_on_meta(ours) == ["conv.scale"]
