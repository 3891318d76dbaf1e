"""Frozen towers kept out of the DeepSpeed engine: selection and hiding, in-process (no DeepSpeed).

The real 2-rank ZeRO-2/ZeRO-3 runs are in tests/test_checkpoints_dit4dit.py (one launch proves
the frozen towers and the checkpoints together)."""

import copy

import pytest
import torch

from accel_npu.errors import AccelNpuError, ConfigError
from accel_npu.plugins.frozen_towers import rematerialize, towers


class Tower(torch.nn.Module):  # what from_pretrained returns: a model with a config
    def __init__(self, inner):
        super().__init__()
        self.config = {"kind": type(inner).__name__}
        self.inner = inner
        self.requires_grad_(False)


class Backbone(torch.nn.Module):  # a plain container, like DiT4DiT's cosmos backbone holder
    def __init__(self):
        super().__init__()
        self.transformer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.vae = Tower(torch.nn.Conv2d(3, 4, 3))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.text_encoder = Tower(torch.nn.Embedding(10, 4))
        self.frozen_pos = torch.nn.Embedding(3, 4).requires_grad_(False)  # plain layer: stays in
        self.head = torch.nn.Linear(4, 2)
        # a frozen piece inside the trained transformer: must stay in the engine
        self.backbone.transformer[1].requires_grad_(False)


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("ACCEL_NPU_FROZEN_MODULES", raising=False)


def test_auto_detect_takes_frozen_children_not_frozen_leaves_of_trained_models(no_env):
    m = Model()
    assert towers.select_towers(m) == ["backbone.vae", "text_encoder"]


def test_a_frozen_plain_wrapper_around_a_model_is_a_tower(no_env):
    m = Model()
    m.vae_wrapper = torch.nn.Sequential(Tower(torch.nn.Linear(2, 2)))  # e.g. a repo's VAE wrapper class
    assert towers.select_towers(m) == ["backbone.vae", "text_encoder", "vae_wrapper"]


def test_model_like_children_are_not_searched(no_env):
    m = Model()
    m.backbone.config = {"hidden_size": 4}  # a model of its own: its frozen parts run in its dtype
    assert towers.select_towers(m) == ["text_encoder"]


def test_a_frozen_part_holding_the_models_own_config_is_not_a_tower(no_env):
    """transformers' CLIPTextModel: its frozen encoder holds the model's config object; textual_inversion.py
    trains the embeddings through it, so it runs in the engine's dtype (kept out, it met bf16 activations in
    fp32: 'mat1 and mat2 must have the same dtype')."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    model = CLIPTextModel(config)
    model.requires_grad_(False)
    model.get_input_embeddings().requires_grad_(True)
    assert model.encoder.config is model.config
    assert towers.select_towers(model) == []
    model.encoder.config = CLIPTextConfig(**config.to_dict())  # a separate model's config: a tower again
    assert towers.select_towers(model) == ["encoder"]


def test_nothing_hidden_when_nothing_would_train(no_env):
    m = Model()
    m.requires_grad_(False)
    assert towers.select_towers(m) == []


def test_env_override_and_its_errors(monkeypatch):
    m = Model()
    monkeypatch.setenv("ACCEL_NPU_FROZEN_MODULES", "text_encoder, frozen_pos")
    assert towers.select_towers(m) == ["text_encoder", "frozen_pos"]
    monkeypatch.setenv("ACCEL_NPU_FROZEN_MODULES", "none")
    assert towers.select_towers(m) == []
    monkeypatch.setenv("ACCEL_NPU_FROZEN_MODULES", "vea")
    with pytest.raises(ConfigError, match=r"'vea'.*children: backbone, text_encoder, frozen_pos, head"):
        towers.select_towers(m)
    monkeypatch.setenv("ACCEL_NPU_FROZEN_MODULES", "head")
    with pytest.raises(ConfigError, match="trainable parameters.*requires_grad_"):
        towers.select_towers(m)


def test_hidden_towers_reachable_out_of_parameters_and_reached_by_train_eval(no_env):
    m = Model()
    vae, te = m.backbone.vae, m.text_encoder
    hidden = towers.hide(m, towers.select_towers(m), device="cpu")
    assert hidden == {"backbone.vae": vae, "text_encoder": te}
    assert m.backbone.vae is vae and m.text_encoder is te
    ids = {id(p) for p in m.parameters()}
    assert not any(id(p) in ids for p in [*vae.parameters(), *te.parameters()])
    assert "text_encoder.inner.weight" not in m.state_dict()
    assert set(towers.tower_state_dict(m)) == {
        "backbone.vae.inner.weight",
        "backbone.vae.inner.bias",
        "text_encoder.inner.weight",
    }
    assert isinstance(m, Model) and type(m).__name__ == "Model"
    m.eval()
    assert not vae.training and not te.training and not m.head.training
    m.train()
    assert vae.training and te.training
    # the engine calls .to() on its module: hidden towers keep their dtype
    m.to(torch.bfloat16)
    assert vae.inner.weight.dtype == torch.float32 and m.head.weight.dtype == torch.bfloat16
    # deepcopy keeps them hidden
    c = copy.deepcopy(m)
    assert "text_encoder" not in c._modules and isinstance(c.text_encoder, Tower)


def test_reassigning_a_tower_keeps_it_out_of_the_engine(no_env):
    m = Model()
    towers.hide(m, towers.select_towers(m))
    new = Tower(torch.nn.Embedding(10, 4))
    m.text_encoder = new
    assert m.text_encoder is new and "text_encoder" not in m._modules
    assert not any(p is new.inner.weight for p in m.parameters())
    m.eval()
    assert not new.training
    with pytest.raises(AccelNpuError, match="trainable parameters"):
        m.text_encoder = torch.nn.Embedding(10, 4)
    # ordinary attributes are untouched
    m.head = torch.nn.Linear(4, 3)
    assert "head" in m._modules


def test_restore_puts_towers_back(no_env):
    m = Model()
    before = [n for n, _ in m.named_parameters()]
    towers.hide(m, towers.select_towers(m))
    towers.restore(m)
    assert [n for n, _ in m.named_parameters()] == before
    assert type(m) is Model


def test_source_dir_finds_the_subfolder_transformers_did_not_record(tmp_path):
    """transformers keeps `config._name_or_path` = the path given, not the subfolder: the files a
    zero.Init tower is re-materialized from are found by matching parameter names and shapes."""
    from transformers import T5Config, T5EncoderModel

    small = T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, decoder_start_token_id=0)
    T5EncoderModel(small).save_pretrained(tmp_path / "repo" / "text_encoder")
    other = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2, decoder_start_token_id=0)
    T5EncoderModel(other).save_pretrained(tmp_path / "repo" / "a_decoy")  # same keys, other shapes
    model = T5EncoderModel.from_pretrained(tmp_path / "repo", subfolder="text_encoder")
    assert model.config._name_or_path == str(tmp_path / "repo")
    assert rematerialize.source_dir(model, "t5") == str(tmp_path / "repo" / "text_encoder")
    assert rematerialize.source_dir(model, "text_encoder") == str(tmp_path / "repo" / "text_encoder")
