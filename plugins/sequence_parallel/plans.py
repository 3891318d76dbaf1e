"""Where a diffusers transformer's sequence is split and gathered: diffusers' own ``_cp_plan`` where the model
class has one (Flux, Flux2, Qwen-Image, Wan, LTX, ...: models/transformers/*.py), a plan of ours where it has
none and its attention can be split here (CogVideoX).

CogVideoXTransformer3DModel (models/transformers/cogvideox_transformer_3d.py) runs its blocks on the text
tokens and the video tokens side by side; its CogVideoXAttnProcessor2_0 (models/attention_processor.py)
concatenates them, applies RoPE to the video part, and calls ``F.scaled_dot_product_attention`` itself, not
diffusers' ``dispatch_attention_fn``, so diffusers' Ulysses attention (attention_dispatch.py
``TemplatedUlyssesAttention``) never sees it. The plan splits both token streams at the first block and the
rotary tables at every block, gathers the video tokens at ``proj_out``; the processor below is diffusers' own
with its attention call going through ``dispatch_attention_fn`` (which runs Ulysses when the processor holds a
parallel config, and plain SDPA otherwise).
"""

from __future__ import annotations

from accel_npu.errors import ConfigError


def cogvideox_plan() -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    rope = ContextParallelInput(split_dim=0, expected_dims=2, split_output=False)
    return {
        "transformer_blocks.0": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
        },
        # (cos, sin) of the video tokens, passed whole to every block
        "transformer_blocks.*": {"image_rotary_emb": [rope, rope]},
        # only the video tokens leave the blocks (norm_final, norm_out, proj_out act per token)
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


#: our plans, by model class name, for classes upstream gives no ``_cp_plan``
OUR_PLANS = {"CogVideoXTransformer3DModel": cogvideox_plan}


def plan_for(model) -> tuple[dict, str]:
    """(plan, where it comes from) for ``model``; ConfigError naming the fix when there is none."""
    name = type(model).__name__
    if name in OUR_PLANS:
        return OUR_PLANS[name](), "accel-npu"
    upstream = getattr(type(model), "_cp_plan", None)
    if upstream:
        return upstream, "diffusers"
    supported = sorted({*OUR_PLANS, *_upstream_planned()})
    raise ConfigError(
        f"accel-npu: sequence parallelism (parallelism_config sp_size > 1) cannot split {name}: diffusers gives it "
        f"no _cp_plan and accel-npu has none for it. Launch without --use_parallelism_config / "
        f"parallelism_config_sp_size (or sp_size 1), or train a model with a plan: {', '.join(supported)}."
    )


def _upstream_planned() -> list[str]:
    """The diffusers transformer classes that declare a ``_cp_plan``, read from their source files (importing
    every model class to ask would take seconds)."""
    import re
    from pathlib import Path

    import diffusers

    names = []
    for path in (Path(diffusers.__file__).parent / "models" / "transformers").glob("*.py"):
        text = path.read_text(encoding="utf-8", errors="replace")
        for cls, body in re.findall(r"^class (\w+)\(.*?\):\n(.*?)(?=^class |\Z)", text, flags=re.S | re.M):
            if re.search(r"^    _cp_plan = ", body, flags=re.M):
                names.append(cls)
    return names


def check_heads(model, sp_size: int) -> None:
    """Ulysses gives each rank heads/sp_size heads: every attention's head count must divide."""
    bad = sorted(
        {
            int(module.heads)
            for module in model.modules()
            if isinstance(getattr(module, "heads", None), int) and module.heads % sp_size
        }
    )
    if bad:
        raise ConfigError(
            f"accel-npu: sequence parallelism with sp_size {sp_size}: {type(model).__name__} has attention layers "
            f"with {bad[0]} heads, which do not divide by {sp_size} (Ulysses gives every rank an equal share of "
            f"the heads). Choose an sp_size that divides {bad[0]} (parallelism_config_sp_size)."
        )


def install_processors(model) -> None:
    """Our Ulysses-capable processor on the attention layers of a model our plan covers."""
    if type(model).__name__ != "CogVideoXTransformer3DModel":
        return
    from diffusers.models.attention_processor import Attention

    processor = cogvideox_processor_class()()
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_processor(processor)


_PROCESSOR = None


def cogvideox_processor_class():
    global _PROCESSOR
    if _PROCESSOR is not None:
        return _PROCESSOR
    import torch
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

    class CogVideoXUlyssesAttnProcessor(CogVideoXAttnProcessor2_0):
        """CogVideoXAttnProcessor2_0.__call__ (diffusers 0.42.1, models/attention_processor.py), its
        ``F.scaled_dot_product_attention`` replaced by ``dispatch_attention_fn`` with this processor's
        parallel config; RoPE is applied to the video part of the rank's tokens, with the rank's rows of the
        rotary tables (the plan splits them with the video tokens)."""

        _attention_backend = None
        _parallel_config = None

        def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
            text_seq_length = encoder_hidden_states.size(1)
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
            batch_size, sequence_length, _ = hidden_states.shape
            if attention_mask is not None:
                attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
                attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
            head_dim = key.shape[-1] // attn.heads
            query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            if attn.norm_q is not None:
                query = attn.norm_q(query)
            if attn.norm_k is not None:
                key = attn.norm_k(key)
            if image_rotary_emb is not None:
                from diffusers.models.embeddings import apply_rotary_emb

                query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
                if not attn.is_cross_attention:
                    key[:, :, text_seq_length:] = apply_rotary_emb(key[:, :, text_seq_length:], image_rotary_emb)

            # dispatch_attention_fn takes (batch, tokens, heads, head_dim)
            hidden_states = dispatch_attention_fn(
                query.transpose(1, 2),
                key.transpose(1, 2),
                value.transpose(1, 2),
                attn_mask=attention_mask,
                dropout_p=0.0,
                is_causal=False,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
            hidden_states = hidden_states.flatten(2, 3)
            hidden_states = attn.to_out[0](hidden_states)
            hidden_states = attn.to_out[1](hidden_states)
            encoder_hidden_states, hidden_states = hidden_states.split(
                [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1
            )
            return hidden_states, encoder_hidden_states

    _PROCESSOR = CogVideoXUlyssesAttnProcessor
    return _PROCESSOR
