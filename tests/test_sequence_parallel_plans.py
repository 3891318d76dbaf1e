"""accel-npu's sequence-parallel plans for the diffusers transformers upstream gives no ``_cp_plan``
(plugins/sequence_parallel/plans.py, docs/sequence-parallel.md): HunyuanVideo, SD3-family, Cosmos (1.0 and
Predict 2.5), and CogVideoX and SD3 with token counts that do not divide (padded with masked tokens).

The split model against the same model unsplit, on a 2-process gloo group spawned here (Ulysses degree 2): the
output equal within 1e-5 (fp32), and the gradients of every parameter, summed over the two ranks (what ZeRO's
reduction does with an SP group), equal within 1e-5 of the unsplit model's. Witnesses independent of accel-npu:
torch's SDPA sees half the heads and all the tokens on each rank, and the functional all_to_all is called.
In-process: a token count that does not divide by sp_size is refused at the first forward, before the split,
naming the fix; the processors are upstream's without a parallel config.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accel_npu.errors import ConfigError

# (batch 1) HunyuanVideo: 2 frames x 2 x 2 latent = 8 video tokens, 6 text tokens of which the last 2 padding;
# SD3: 4 x 4 = 16 image tokens, 6 text tokens (7 in sd35_odd_text); Cosmos: 2 frames x (8/2) x (8/2) = 32 video
# tokens; CogVideoX: 3 frames x (6/2) x (2/2) = 9 video tokens with RoPE, 5 text tokens
HUNYUAN = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=8,
    num_layers=1,
    num_single_layers=1,
    num_refiner_layers=1,
    patch_size=1,
    patch_size_t=1,
    guidance_embeds=False,
    text_embed_dim=16,
    pooled_projection_dim=8,
    rope_axes_dim=(2, 2, 4),
)
SD35 = dict(
    sample_size=8,
    patch_size=1,
    in_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    caption_projection_dim=16,
    joint_attention_dim=16,
    pooled_projection_dim=16,
    out_channels=4,
    qk_norm="rms_norm",
    dual_attention_layers=(0,),
)
COSMOS = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    mlp_ratio=2.0,
    text_embed_dim=32,
    adaln_lora_dim=8,
    max_size=(4, 16, 16),
    patch_size=(1, 2, 2),
    rope_scale=(1.0, 1.0, 1.0),
    concat_padding_mask=False,
    extra_pos_embed_type="learnable",
)
COGVIDEOX = dict(
    num_attention_heads=2,
    attention_head_dim=16,  # CogVideoX's 3D RoPE splits it 1/4, 3/8, 3/8 into even parts
    in_channels=4,
    out_channels=4,
    time_embed_dim=16,
    text_embed_dim=16,
    num_layers=2,
    sample_width=2,
    sample_height=6,
    sample_frames=9,
    max_text_seq_length=5,
    use_rotary_positional_embeddings=True,
)
# Predict 2.5's shape (tests/scripts/tiny_dits.py COSMOS25_TRANSFORMER, without the padding-mask channel, which
# needs torchvision): a condition-mask channel and a per-frame timestep [B, 1, T, 1, 1]
COSMOS25 = {**COSMOS, "in_channels": 4 + 1, "rope_scale": (2.0, 1.0, 1.0)}


def _model_and_inputs(name: str):
    import torch

    torch.manual_seed(0)
    if name == "hunyuan_video":
        from diffusers import HunyuanVideoTransformer3DModel

        model = HunyuanVideoTransformer3DModel(**HUNYUAN)
        mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
        inputs = dict(
            hidden_states=torch.randn(1, 4, 2, 2, 2),
            timestep=torch.tensor([500]),
            encoder_hidden_states=torch.randn(1, 6, 16),
            encoder_attention_mask=mask,
            pooled_projections=torch.randn(1, 8),
        )
    elif name in ("sd35", "sd35_odd_text"):
        from diffusers import SD3Transformer2DModel

        model = SD3Transformer2DModel(**SD35)
        inputs = dict(
            hidden_states=torch.randn(1, 4, 4, 4),
            encoder_hidden_states=torch.randn(1, 6 if name == "sd35" else 7, 16),
            pooled_projections=torch.randn(1, 16),
            timestep=torch.tensor([500]),
        )
    elif name == "cogvideox":
        from diffusers import CogVideoXTransformer3DModel
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        model = CogVideoXTransformer3DModel(**COGVIDEOX)
        inputs = dict(
            hidden_states=torch.randn(1, 3, 4, 6, 2),
            encoder_hidden_states=torch.randn(1, 5, 16),
            timestep=torch.tensor([500]),
            image_rotary_emb=get_3d_rotary_pos_embed(16, ((0, 0), (3, 1)), (3, 1), 3, use_real=True),
        )
    elif name == "cosmos":
        from diffusers import CosmosTransformer3DModel

        model = CosmosTransformer3DModel(**COSMOS)
        inputs = dict(
            hidden_states=torch.randn(1, 4, 2, 8, 8),
            timestep=torch.tensor([0.5]),
            encoder_hidden_states=torch.randn(1, 6, 32),
            fps=24,
        )
    elif name in ("flux", "flux_3d_ids"):  # diffusers' own _cp_plan: split at the model's inputs (16 image, 6 text)
        from diffusers import FluxTransformer2DModel

        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8],
        )
        inputs = dict(
            hidden_states=torch.randn(1, 16, 4),
            encoder_hidden_states=torch.randn(1, 6, 32),
            pooled_projections=torch.randn(1, 32),
            timestep=torch.tensor([0.5]),
            img_ids=torch.zeros(16, 3),
            # train_dreambooth_flux.py passes text ids with a batch dimension (Flux's forward drops it)
            txt_ids=torch.zeros(6, 3) if name == "flux" else torch.zeros(1, 6, 3),
        )
    else:  # cosmos25
        from diffusers import CosmosTransformer3DModel

        model = CosmosTransformer3DModel(**COSMOS25)
        condition = torch.zeros(1, 1, 2, 8, 8)
        condition[:, :, 0] = 1
        inputs = dict(
            hidden_states=torch.randn(1, 4, 2, 8, 8),
            timestep=torch.tensor([0.0, 0.7]).view(1, 1, 2, 1, 1),
            encoder_hidden_states=torch.randn(1, 6, 32),
            condition_mask=condition,
        )
    if name.startswith("cosmos"):
        # zeros at init: their normalisation divides by eps there, gradients of 1e6 (a pretrained model's are not)
        for param in model.learnable_pos_embed.parameters():
            torch.nn.init.normal_(param)
    return model, inputs


MODELS = ("hunyuan_video", "sd35", "cosmos", "cosmos25", "sd35_odd_text", "cogvideox", "flux_3d_ids")


def _split_equals_unsplit(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: every model unsplit, then split over the 2 ranks; the differences to ``rank<r>.json``."""
    import copy
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F
    from diffusers.models._modeling_parallel import ContextParallelConfig
    from diffusers.models.modeling_utils import ModelMixin
    from torch.distributed.device_mesh import init_device_mesh

    from accel_npu.plugins.sequence_parallel import plans, prepare

    dist.init_process_group("gloo", rank=rank, world_size=world)
    upstream_resolve = ModelMixin._resolve_parallel_config

    def resolve(self, config):
        return prepare.resolve_parallel_config(lambda c: upstream_resolve(self, c), self, (config,), {})

    ModelMixin._resolve_parallel_config = resolve  # the CPU ranks' fix the plugin patches in
    seen = {"sdpa": [], "all_to_all": 0}
    sdpa, a2a = F.scaled_dot_product_attention, funcol.all_to_all_single

    def counting_sdpa(query, *args, **kwargs):
        seen["sdpa"].append(list(query.shape))
        return sdpa(query, *args, **kwargs)

    def counting_a2a(*args, **kwargs):
        seen["all_to_all"] += 1
        return a2a(*args, **kwargs)

    F.scaled_dot_product_attention = counting_sdpa
    funcol.all_to_all_single = counting_a2a
    mesh = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("dp", "ring", "ulysses"))
    results = {"random": _shared_random_draws(rank, world, mesh)}
    for name in MODELS:
        model, inputs = _model_and_inputs(name)
        unsplit = copy.deepcopy(model)
        torch.manual_seed(1)
        out_unsplit = unsplit(**inputs, return_dict=False)[0]
        weights = torch.randn_like(out_unsplit)
        (out_unsplit * weights).sum().backward()

        plan, source = plans.plan_for(model)
        # as plugins/sequence_parallel/prepare.py installs them
        plans.install_id_forms(model)
        padding = plans.install_padding(model, world)
        plans.install_processors(model, padding)
        plans.install_token_checks(model, plan, world)
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world, mesh=mesh), cp_plan=plan)
        seen["sdpa"].clear()
        seen["all_to_all"] = 0
        out = model(**inputs, return_dict=False)[0]
        (out * weights).sum().backward()

        grads, grad_diff, worst, missing = dict(model.named_parameters()), 0.0, None, []
        for key, param in unsplit.named_parameters():
            mine = grads[key].grad
            if param.grad is None:
                continue
            if mine is None:
                missing.append(key)
                mine = torch.zeros_like(param)
            summed = mine.detach().clone()
            dist.all_reduce(summed)
            diff = (summed - param.grad).abs().max().item()
            if diff > grad_diff:
                grad_diff, worst = diff, key
        results[name] = {
            "source": source,
            "out_diff": (out - out_unsplit).abs().max().item(),
            "out_scale": out_unsplit.abs().max().item(),
            "grad_diff": grad_diff,
            "worst": worst,
            "grads": sum(p.grad is not None for p in unsplit.parameters()),
            "missing": missing,
            "sdpa": sorted({(shape[1], shape[2]) for shape in seen["sdpa"]}),
            "all_to_all": seen["all_to_all"],
        }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _shared_random_draws(rank: int, world: int, mesh) -> dict:
    """Draws from torch's, Python's and NumPy's global generators seeded per rank, before and after
    groups.share_random_state over the 2 ranks (one SP group)."""
    import random
    from types import SimpleNamespace

    import numpy as np
    import torch
    import torch.distributed as dist

    from accel_npu.plugins.sequence_parallel import groups

    def draws():
        return [torch.rand(2).tolist(), random.random(), float(np.random.rand())]

    torch.manual_seed(rank), random.seed(rank), np.random.seed(rank)
    before = draws()
    mpu = SimpleNamespace(get_sequence_parallel_group=lambda: dist.group.WORLD)
    groups.share_random_state(SimpleNamespace(mpu=mpu, rank=rank, sp_size=world, mesh=mesh))
    return {"before": before, "after": draws()}


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    import torch.multiprocessing as mp

    from tests.launch_utils import free_port

    out = tmp_path_factory.mktemp("sp_plans")
    mp.spawn(_split_equals_unsplit, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


# (video or image tokens, text tokens in the joint attention: 0 where the text is not in it)
# (padded to a multiple of 2 where our plan pads them: SD3's 7 text tokens to 8, CogVideoX's 9 video to 10 and 5
# text to 6)
TOKENS = {
    "hunyuan_video": (8, 6),
    "sd35": (16, 6),
    "cosmos": (32, 0),
    "cosmos25": (32, 0),
    "sd35_odd_text": (16, 8),
    "cogvideox": (10, 6),
    "flux_3d_ids": (16, 6),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", MODELS)
def test_the_split_model_computes_the_unsplit_forward_and_backward(split_runs, name):
    for rank in split_runs:
        result = rank[name]
        assert result["source"] == ("diffusers" if name.startswith("flux") else "accel-npu")
        assert result["out_scale"] > 0.01
        assert result["out_diff"] <= 1e-5, result
        assert result["grads"] > 10 and result["missing"] == [], result
        assert result["grad_diff"] <= 1e-5, result
        # the exchange happened: every rank's attention over all tokens with 1 of the 2 heads (the unsplit
        # attentions, HunyuanVideo's text refiner and Cosmos' cross-attention, see fewer tokens with both)
        tokens = sum(TOKENS[name])
        assert [1, tokens] in result["sdpa"] and [2, tokens] not in result["sdpa"], result
        assert result["all_to_all"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_ranks_of_an_sp_group_continue_from_one_random_state(split_runs):
    first, second = (rank["random"] for rank in split_runs)
    assert first["after"] == second["after"]
    for a, b in zip(first["before"], second["before"]):
        assert a != b  # the negative: seeded per rank, they drew differently before


# ------------------------------------------------------------------------------------------------
# in-process: refusals and the processors without a parallel config
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("sd35", {"hidden_states": (1, 4, 3, 3)}, "pos_embed output has 9 image or video tokens, which do not"),
        ("sd35", {"encoder_hidden_states": (1, 7, 16)}, "context_embedder output has 7 text tokens"),
        ("hunyuan_video", {"hidden_states": (1, 4, 3, 1, 1)}, "transformer_blocks.0 input hidden_states has 3"),
        ("hunyuan_video", {"encoder_hidden_states": (1, 5, 16)}, "input encoder_hidden_states has 5 text tokens"),
        ("cosmos", {"hidden_states": (1, 4, 1, 2, 6)}, "has 3 image or video tokens"),
        ("flux", {"hidden_states": (1, 15, 4), "img_ids": (15, 3)}, "input hidden_states has 15 image or video"),
    ],
)
def test_a_token_count_that_does_not_divide_is_refused_at_the_first_forward_naming_the_fix(name, change, message):
    import torch

    from accel_npu.plugins.sequence_parallel import plans

    model, inputs = _model_and_inputs(name)
    plan, _ = plans.plan_for(model)
    plans.install_token_checks(model, plan, 2)
    with torch.no_grad():
        model(**inputs)  # divisible: runs (no split installed here, only the checks)
        for key, shape in change.items():
            inputs[key] = torch.randn(shape)
        if inputs.get("encoder_attention_mask") is not None:
            inputs["encoder_attention_mask"] = torch.ones(1, inputs["encoder_hidden_states"].shape[1])
        with pytest.raises(ConfigError, match=message) as err:
            model(**inputs)
    assert "Choose sizes giving a multiple of 2" in str(err.value)


@pytest.mark.parametrize("name", ["sd35_odd_text", "cogvideox"])
def test_tokens_that_do_not_divide_are_padded_before_the_token_count_check(name):
    """In prepare.py's order (the padding's pre-hooks, then the checks), SD3's 7 text tokens and CogVideoX's 5
    text and 9 video tokens at sp_size 2 reach the split padded to 8, 6 and 10, and CogVideoX's output has the
    unpadded shape (its padding cut after the gather); the checks alone (the negative) refuse them."""
    import torch

    from accel_npu.plugins.sequence_parallel import plans

    model, inputs = _model_and_inputs(name)
    plan, _ = plans.plan_for(model)
    unpadded = _model_and_inputs(name)[0]
    plans.install_token_checks(unpadded, plans.plan_for(unpadded)[0], 2)
    with torch.no_grad(), pytest.raises(ConfigError, match="tokens, which do not divide by 2"):
        unpadded(**inputs)

    padding = plans.install_padding(model, 2)
    plans.install_token_checks(model, plan, 2)
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]  # no split installed here: the padded streams run whole
    assert out.shape == inputs["hidden_states"].shape
    text = inputs["encoder_hidden_states"].shape[1]
    assert (padding.text_real, padding.text_padded) == (text, text + 1)
    if name == "cogvideox":
        assert (padding.video_real, padding.video_padded) == (9, 10)


def test_the_padding_mask_follows_the_keys_as_ulysses_orders_them():
    """After Ulysses' exchange the keys are rank 0's tokens, then rank 1's, ...: each rank's text then video
    (CogVideoX) or image then text (SD3); a stream's padding, its last tokens, is on the last ranks."""
    from accel_npu.plugins.sequence_parallel.plans import TokenPadding

    T, F = True, False
    padding = TokenPadding(2, text_first=True)
    padding.text_real, padding.text_padded = 5, 6
    assert padding.key_mask(3, 2, "cpu").flatten().tolist() == [T, T, T, T, T, T, T, F, T, T]
    padding.video_real, padding.video_padded = 3, 4  # and the video's: rank 1's last video token
    assert padding.key_mask(3, 2, "cpu").flatten().tolist() == [T, T, T, T, T, T, T, F, T, F]
    padding = TokenPadding(2, text_first=False)
    padding.text_real, padding.text_padded = 5, 6
    assert padding.key_mask(3, 2, "cpu").flatten().tolist() == [T, T, T, T, T, T, T, T, T, F]
    padding = TokenPadding(4, text_first=True)  # 226 -> 228: the last rank's last 2 text tokens
    padding.text_real, padding.text_padded = 226, 228
    mask = padding.key_mask(57, 1, "cpu").flatten().tolist()
    assert len(mask) == 4 * 58 and mask.count(False) == 2 and mask[3 * 58 + 55 : 3 * 58 + 57] == [F, F]
    padding.text_real = 228  # divisible: no mask
    assert padding.key_mask(57, 1, "cpu") is None


def test_hunyuan_video_token_replace_is_refused():
    from diffusers import HunyuanVideoTransformer3DModel

    from accel_npu.plugins.sequence_parallel.plans import plan_for

    model = HunyuanVideoTransformer3DModel(**{**HUNYUAN, "image_condition_type": "token_replace"})
    with pytest.raises(ConfigError, match="image_condition_type='token_replace'"):
        plan_for(model)


@pytest.mark.parametrize("name", [m for m in MODELS if not m.startswith("flux")])  # Flux: upstream's processors
def test_our_processors_are_upstreams_without_a_parallel_config(name):
    """With no parallel config, every model with our processors computes what it computes with upstream's."""
    import copy

    import torch

    from accel_npu.plugins.sequence_parallel import plans

    model, inputs = _model_and_inputs(name)
    ours = copy.deepcopy(model)
    plans.install_processors(ours)
    assert any(type(getattr(m, "processor", None)).__module__ == plans.__name__ for m in ours.modules())
    outs = []
    for m in (model, ours):
        out = m(**inputs, return_dict=False)[0]
        out.square().sum().backward()
        outs.append((out, next(p for p in m.parameters() if p.grad is not None).grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
