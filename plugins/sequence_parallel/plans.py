"""Where a diffusers transformer's sequence is split and gathered: diffusers' own ``_cp_plan`` where the model
class has one (Flux, Flux2, Qwen-Image, Wan, LTX, ...: models/transformers/*.py), a plan of ours where it has
none and its attention can be split here (CogVideoX, HunyuanVideo, SD3-family, Cosmos).

A plan names the module inputs split along their token dimension (diffusers' ``ContextParallelInput``) and the
module outputs gathered (``ContextParallelOutput``); diffusers' hooks do the splitting (hooks/context_parallel.py).
Attention is exchanged by diffusers' Ulysses attention (attention_dispatch.py ``TemplatedUlyssesAttention``),
which only runs when a processor calls ``dispatch_attention_fn`` with a parallel config: each model below gets a
processor that is upstream's own, calling it so.

- CogVideoXTransformer3DModel (models/transformers/cogvideox_transformer_3d.py): text and video tokens run side by
  side through its blocks; CogVideoXAttnProcessor2_0 (models/attention_processor.py) concatenates them, applies
  RoPE to the video part and calls ``F.scaled_dot_product_attention`` itself. Both streams are split at the first
  block, the rotary tables at every block, the video tokens gathered at ``proj_out``.
  The text (226 tokens as the official scripts pad it) and the video tokens (CogVideoX-5B at 480x720: 17550) are
  padded to a multiple of sp_size with masked tokens, the video's padding cut off the gathered output.
- SD3Transformer2DModel (models/transformers/transformer_sd3.py): joint attention of image and text tokens
  (JointAttnProcessor2_0, calling SDPA itself; SD3.5's second, image-only attention too), no RoPE (positions are
  added at the patch embedding), no mask: both streams split as they leave their embeddings (``pos_embed``,
  ``context_embedder``), the image tokens gathered at ``proj_out``. The text (77 CLIP + the T5 length, odd for any
  even T5 length) is padded to a multiple of sp_size with masked tokens.
- HunyuanVideoTransformer3DModel (models/transformers/transformer_hunyuan_video.py): its processor calls
  ``dispatch_attention_fn`` with a parallel config already; dual-stream then single-stream blocks on [video, text]
  with RoPE on the video part and a key mask over the text padding built for the whole sequence, ``[video, text]``.
  After Ulysses' exchange a rank's keys are ``[video_0, text_0, video_1, text_1, ...]``: the processor below puts
  the mask in that order. The token-replace variant (``image_condition_type="token_replace"``) modulates the first
  frame's tokens by position and is refused.
- CosmosTransformer3DModel (models/transformers/transformer_cosmos.py; Cosmos 1.0 and Predict 2.5): self-attention
  over the video tokens with RoPE, then cross-attention to the text. CosmosAttnProcessor2_0 calls
  ``dispatch_attention_fn`` without a parallel config. Only the self-attention is exchanged (its processor below);
  the cross-attention runs each rank's queries against all text tokens, which are not split. The video tokens are
  split at the first block, the per-token inputs every block takes (RoPE tables, learnable positions, and Predict
  2.5's per-frame timestep embeddings) at every block, and gathered at ``proj_out``.
"""

from __future__ import annotations

from dataclasses import dataclass

from accel_npu.errors import ConfigError


def _inputs():
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    tokens = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    rope = ContextParallelInput(split_dim=0, expected_dims=2, split_output=False)
    gather = ContextParallelOutput(gather_dim=1, expected_dims=3)
    return tokens, rope, gather


def cogvideox_plan(model) -> dict:
    tokens, rope, gather = _inputs()
    return {
        "transformer_blocks.0": {"hidden_states": tokens, "encoder_hidden_states": tokens},
        # (cos, sin) of the video tokens, passed whole to every block
        "transformer_blocks.*": {"image_rotary_emb": [rope, rope]},
        # only the video tokens leave the blocks (norm_final, norm_out, proj_out act per token)
        "proj_out": gather,
    }


def sd3_plan(model) -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput

    _tokens, _rope, gather = _inputs()
    # the embeddings' outputs, not the first block's inputs: diffusers' split hook requires a block's outputs to be
    # tensors, and a last block (context_pre_only, the first one of a one-block model) returns None for the text
    embedded = {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)}
    return {"pos_embed": embedded, "context_embedder": embedded, "proj_out": gather}


def hunyuan_video_plan(model) -> dict:
    if getattr(model.config, "image_condition_type", None) == "token_replace":
        raise ConfigError(
            "accel-npu: sequence parallelism cannot split HunyuanVideoTransformer3DModel with "
            "image_condition_type='token_replace': its blocks modulate the first frame's tokens by position, which "
            "a rank holding a slice of the tokens does not know. Launch without parallelism_config_sp_size."
        )
    tokens, rope, gather = _inputs()
    first = "transformer_blocks.0" if len(model.transformer_blocks) else "single_transformer_blocks.0"
    return {
        first: {"hidden_states": tokens, "encoder_hidden_states": tokens},
        # the dual-stream blocks name the (cos, sin) tables freqs_cis, the single-stream ones image_rotary_emb
        "transformer_blocks.*": {"freqs_cis": [rope, rope]},
        "single_transformer_blocks.*": {"image_rotary_emb": [rope, rope]},
        "proj_out": gather,
    }


def cosmos_plan(model) -> dict:
    tokens, rope, gather = _inputs()
    return {
        "transformer_blocks.0": {"hidden_states": tokens},
        # per token, passed whole to every block: [B, tokens, C] (temb / embedded_timestep only for a per-frame
        # timestep; a per-sample one is [B, C] and left whole by expected_dims)
        "transformer_blocks.*": {
            "embedded_timestep": tokens,
            "temb": tokens,
            "extra_pos_emb": tokens,
            "image_rotary_emb": [rope, rope],
        },
        # the output norm takes the per-frame timestep embeddings too
        "norm_out": {"embedded_timestep": tokens, "temb": tokens},
        "proj_out": gather,
    }


#: our plans, by model class name, for classes upstream gives no ``_cp_plan``
OUR_PLANS = {
    "CogVideoXTransformer3DModel": cogvideox_plan,
    "SD3Transformer2DModel": sd3_plan,
    "HunyuanVideoTransformer3DModel": hunyuan_video_plan,
    "CosmosTransformer3DModel": cosmos_plan,
}


def plan_for(model) -> tuple[dict, str]:
    """(plan, where it comes from) for ``model``; ConfigError naming the fix when there is none."""
    name = type(model).__name__
    if name in OUR_PLANS:
        return OUR_PLANS[name](model), "accel-npu"
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


# ------------------------------------------------------------------------------------------------
# position ids in the form the plan splits
# ------------------------------------------------------------------------------------------------
#: models whose forward takes its position ids with or without a batch dimension (and drops it), by the number
#: of dimensions their _cp_plan splits: transformer_flux.py (2: "Passing `txt_ids` 3d torch.Tensor is
#: deprecated", still what train_dreambooth_flux.py passes) and transformer_flux2.py (3)
_ID_DIMS = {"FluxTransformer2DModel": 2, "Flux2Transformer2DModel": 3}


def install_id_forms(model) -> None:
    """A forward pre-hook giving ``img_ids`` / ``txt_ids`` the dimensions the model's plan splits, as the model's
    own forward would take them: otherwise diffusers leaves them whole ("Expected input tensor to have 2
    dimensions ... split will not be applied") and the rank's RoPE covers more tokens than it holds."""
    dims = _ID_DIMS.get(type(model).__name__)
    if dims is None:
        return

    def reshape(module, args, kwargs):
        changed = {}
        for name in ("img_ids", "txt_ids"):
            ids = kwargs.get(name)
            if ids is not None and ids.dim() == dims + 1:
                changed[name] = ids[0]
            elif ids is not None and ids.dim() == dims - 1:
                changed[name] = ids.unsqueeze(0)
        return (args, {**kwargs, **changed}) if changed else None

    model.register_forward_pre_hook(reshape, with_kwargs=True)


# ------------------------------------------------------------------------------------------------
# tokens padded to a multiple of sp_size, for the models our plans cover
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Padded:
    """Where a model's token streams enter the split: (module, position among its forward's arguments, name).
    ``video`` also pads the rotary tables every block takes (``rope``: position, name) and cuts the padding off
    the gathered output at ``gather``; ``text_first``: a rank's attention puts its text before its other tokens."""

    text: tuple[str, int, str]
    text_first: bool
    video: tuple[str, int, str] | None = None
    rope: tuple[int, str] | None = None
    gather: str | None = None


_PADDED = {
    # CogVideoX-5B at 480x720: 13 latent frames x 30 x 45 = 17550 video tokens, 226 text tokens, neither a
    # multiple of 4
    "CogVideoXTransformer3DModel": _Padded(
        text=("transformer_blocks.0", 1, "encoder_hidden_states"),
        text_first=True,
        video=("transformer_blocks.0", 0, "hidden_states"),
        rope=(3, "image_rotary_emb"),
        gather="proj_out",
    ),
    # the Linear's input, padded with zero rows: it acts per token, and its output is what the plan splits
    "SD3Transformer2DModel": _Padded(text=("context_embedder", 0, "input"), text_first=False),
}


class TokenPadding:
    """The token counts of the forward in progress, as the model was given them (``*_real``) and padded to a
    multiple of sp_size (``*_padded``), set where the streams enter the split, read by the model's attention
    processors. The padding tokens are zeros (their rotary rows too), never attended to: every op but attention
    acts per token, so the real tokens compute what they compute unpadded; the text's padding leaves the model
    with the text stream, the video's is cut off the gathered output."""

    def __init__(self, sp_size: int, text_first: bool):
        self.sp_size, self.text_first = sp_size, text_first
        self.text_real = self.text_padded = self.video_real = self.video_padded = 0

    def key_mask(self, text_local: int, other_local: int, device):
        """None without padding; else the attention mask over the keys as Ulysses' exchange orders them
        (rank 0's tokens, rank 1's, ...: each rank's text and other tokens in its processor's order), True where
        a key is a real token: ``[1, 1, 1, keys]``, the same on every rank. Built here rather than as a local mask
        diffusers would all-gather (attention_dispatch.py ``TemplatedUlyssesAttention``): no collective."""
        if self.text_padded == self.text_real and self.video_padded == self.video_real:
            return None
        import torch

        parts = []
        for rank in range(self.sp_size):
            text = torch.arange(rank * text_local, (rank + 1) * text_local, device=device) < self.text_real
            other = torch.arange(rank * other_local, (rank + 1) * other_local, device=device)
            other = other < self.video_real if self.video_padded > self.video_real else torch.ones_like(other) > 0
            parts += [text, other] if self.text_first else [other, text]
        return torch.cat(parts).view(1, 1, 1, -1)


def _padded(tensor, to: int, dim: int):
    import torch

    pad = [0, 0] * (tensor.dim() - dim - 1) + [0, to - tensor.shape[dim]]
    return torch.nn.functional.pad(tensor, pad)


def install_padding(model, sp_size: int) -> TokenPadding | None:
    """Forward pre-hooks padding the streams where they enter the split (before the token-count check and
    diffusers' split, which torch runs after them), and a forward hook cutting the video's padding off the
    gathered output (after diffusers' gather, inside the hook-wrapped ``forward``); None for a model our plans do
    not pad."""
    spot = _PADDED.get(type(model).__name__)
    if spot is None:
        return None
    from diffusers.hooks.context_parallel import _get_submodule_by_name

    padding = TokenPadding(sp_size, spot.text_first)

    def replaced(args, kwargs, position, name, value):
        if name in kwargs:
            return args, {**kwargs, name: value}
        return (*args[:position], value, *args[position + 1 :]), kwargs

    def given(args, kwargs, position, name):
        return kwargs[name] if name in kwargs else args[position] if len(args) > position else None

    def pad_stream(args, kwargs, where):
        """(args, kwargs) with the stream at ``where`` padded, its real and padded token counts."""
        _, position, name = where
        tokens = given(args, kwargs, position, name)
        real = tokens.shape[1]
        padded = -(-real // sp_size) * sp_size
        if padded > real:
            args, kwargs = replaced(args, kwargs, position, name, _padded(tokens, padded, 1))
        return args, kwargs, real, padded

    def pad_streams(module, args, kwargs):
        args, kwargs, padding.text_real, padding.text_padded = pad_stream(args, kwargs, spot.text)
        if spot.video is not None:
            args, kwargs, padding.video_real, padding.video_padded = pad_stream(args, kwargs, spot.video)
        return args, kwargs

    def pad_rope(module, args, kwargs):
        position, name = spot.rope
        rope = given(args, kwargs, position, name)
        if rope is None or padding.video_padded == padding.video_real or rope[0].shape[0] != padding.video_real:
            return None
        return replaced(args, kwargs, position, name, tuple(_padded(t, padding.video_padded, 0) for t in rope))

    def cut_video(module, args, output):
        if padding.video_padded > padding.video_real and output.shape[1] == padding.video_padded:
            return output[:, : padding.video_real]
        return None

    # the streams' hook first: it reads the counts the rotary tables' hook pads to
    _get_submodule_by_name(model, spot.text[0]).register_forward_pre_hook(pad_streams, with_kwargs=True)
    if spot.rope is not None:
        for block in model.transformer_blocks:
            block.register_forward_pre_hook(pad_rope, with_kwargs=True)
    if spot.gather is not None:
        _get_submodule_by_name(model, spot.gather).register_forward_hook(cut_video)
    return padding


# ------------------------------------------------------------------------------------------------
# token counts: diffusers' EquipartitionSharder asserts divisibility deep inside the first forward
# ------------------------------------------------------------------------------------------------
#: what sets a split tensor's token count, by the input's name or the module whose output is split, for the fix
_TOKEN_SOURCES = {
    "encoder_hidden_states": ("text tokens", "the prompt's padded length: --max_sequence_length"),
    "context_embedder": ("text tokens", "the prompt's padded length: --max_sequence_length"),
}
_IMAGE_TOKENS = (
    "image or video tokens",
    "the latent's frames x height x width over the patch size: --resolution, --height/--width, --num_frames",
)


def token_count_problem(model_name: str, where: str, key: str, value, spec, sp_size: int) -> str | None:
    """The message naming the fix when ``value`` (the tensor or tuple of tensors ``spec`` splits, at ``where``)
    has a token count ``sp_size`` does not divide; None when every one divides."""
    import torch

    specs, values = (spec, value) if isinstance(spec, (list, tuple)) else ([spec], [value])
    if not isinstance(values, (list, tuple)):
        return None
    for one_spec, one in zip(specs, values):
        if not torch.is_tensor(one) or (one_spec.expected_dims is not None and one.dim() != one_spec.expected_dims):
            continue
        count = one.shape[one_spec.split_dim]
        if count % sp_size:
            what, source = _TOKEN_SOURCES.get(key, _IMAGE_TOKENS)
            return (
                f"accel-npu: sequence parallelism with sp_size {sp_size}: {model_name}'s {where} has {count} {what}, "
                f"which do not divide by {sp_size} (Ulysses gives every rank an equal share of each sample's "
                f"tokens). Choose sizes giving a multiple of {sp_size} {what} ({source}), or an sp_size dividing "
                f"{count}."
            )
    return None


def install_token_checks(model, plan: dict, sp_size: int) -> None:
    """Checks of the token counts the plan splits, before diffusers' split hooks assert them: a forward pre-hook
    for a module's inputs (torch runs it before the hook-wrapped ``forward``), and for a module's outputs a
    diffusers hook registered before ``enable_parallelism``'s (a later hook wraps an earlier one, so this one's
    ``post_forward`` sees the output first: hooks/hooks.py ``HookRegistry.register_hook``). Every rank refuses
    alike. Call before ``enable_parallelism``."""
    import inspect

    from diffusers.hooks import HookRegistry, ModelHook
    from diffusers.hooks.context_parallel import _get_submodule_by_name

    model_name = type(model).__name__

    class OutputTokenCheck(ModelHook):
        def __init__(self, module_name, specs):
            super().__init__()
            self.module_name, self.specs = module_name, specs

        def post_forward(self, module, output):
            outputs = list(output) if isinstance(output, (list, tuple)) else [output]
            for index, spec in self.specs.items():
                if index < len(outputs):
                    where = f"{self.module_name} output"
                    problem = token_count_problem(model_name, where, self.module_name, outputs[index], spec, sp_size)
                    if problem:
                        raise ConfigError(problem)
            return output

    for module_name, plan_inputs in plan.items():
        if not isinstance(plan_inputs, dict):
            continue
        modules = _get_submodule_by_name(model, module_name)
        for module in modules if isinstance(modules, list) else [modules]:
            outputs = {k: v for k, v in plan_inputs.items() if getattr(v, "split_output", False)}
            inputs = {k: v for k, v in plan_inputs.items() if k not in outputs}
            if outputs:
                registry = HookRegistry.check_if_exists_or_initialize(module)
                registry.register_hook(OutputTokenCheck(module_name, outputs), "accel_npu_token_count_check")
            if not inputs:
                continue
            parameters = list(inspect.signature(type(module).forward).parameters)[1:]

            def check(mod, args, kwargs, _specs=inputs, _params=parameters, _name=module_name):
                given = {**dict(zip(_params, args)), **kwargs}
                for key, spec in _specs.items():
                    where = f"{_name} input {key}"
                    problem = token_count_problem(model_name, where, key, given.get(key), spec, sp_size)
                    if problem:
                        raise ConfigError(problem)

            module.register_forward_pre_hook(check, with_kwargs=True)


# ------------------------------------------------------------------------------------------------
# attention processors: upstream's, with Ulysses
# ------------------------------------------------------------------------------------------------
def install_processors(model, padding: TokenPadding | None = None) -> None:
    """Our Ulysses-capable processors on the attention layers of a model our plan covers (with the model's text
    padding, where its text is padded)."""
    name = type(model).__name__
    if name == "CogVideoXTransformer3DModel":
        _set_processors(model, cogvideox_processor_class(), padding)
    elif name == "SD3Transformer2DModel":
        _set_processors(model, joint_processor_class(), padding)
    elif name == "HunyuanVideoTransformer3DModel":
        # the blocks' attention only: the token refiner's runs on the whole text before the split
        processor = hunyuan_video_processor_class()()
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.attn.set_processor(processor)
    elif name == "CosmosTransformer3DModel":
        # the self-attention only: the cross-attention's text is whole on every rank
        processor = cosmos_self_attention_processor_class()()
        for block in model.transformer_blocks:
            block.attn1.set_processor(processor)


def _set_processors(model, cls, padding: TokenPadding | None = None) -> None:
    from diffusers.models.attention_processor import Attention

    processor = cls()
    processor.token_padding = padding
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_processor(processor)


_PROCESSORS: dict = {}


def _once(builder):
    def get():
        if builder.__name__ not in _PROCESSORS:
            _PROCESSORS[builder.__name__] = builder()
        return _PROCESSORS[builder.__name__]

    get.__name__ = builder.__name__
    get.__doc__ = builder.__doc__
    return get


def _attend(processor, query, key, value, attention_mask=None):
    """diffusers' ``dispatch_attention_fn`` on (batch, tokens, heads, head_dim) with ``processor``'s backend and
    parallel config: where Ulysses exchanges heads for tokens. Each processor below is upstream's, this call in
    place of its ``F.scaled_dot_product_attention``."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=0.0,
        is_causal=False,
        backend=processor._attention_backend,
        parallel_config=processor._parallel_config,
    )


@_once
def cogvideox_processor_class():
    import torch
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

    class CogVideoXUlyssesAttnProcessor(CogVideoXAttnProcessor2_0):
        """CogVideoXAttnProcessor2_0.__call__ (diffusers 0.42.1, models/attention_processor.py), its
        ``F.scaled_dot_product_attention`` replaced by ``dispatch_attention_fn`` with this processor's
        parallel config; RoPE is applied to the video part of the rank's tokens, with the rank's rows of the
        rotary tables (the plan splits them with the video tokens)."""

        _attention_backend = None
        _parallel_config = None
        token_padding = None

        def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
            text_seq_length = encoder_hidden_states.size(1)
            padding_mask = None
            if self.token_padding is not None:
                padding_mask = self.token_padding.key_mask(text_seq_length, hidden_states.size(1), hidden_states.device)
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
            batch_size, sequence_length, _ = hidden_states.shape
            if attention_mask is not None:
                if padding_mask is not None:
                    raise ConfigError(
                        "accel-npu: sequence parallelism padded CogVideoX's tokens to a multiple of sp_size, and "
                        "an attention mask was given too (attention_kwargs), which the padding cannot be merged "
                        "into. Choose text and video lengths that divide by sp_size, or pass no attention mask."
                    )
                attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
                attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
            else:
                # upstream's model passes none: only the padding's keys are masked
                attention_mask = padding_mask

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

            # _attend takes (batch, tokens, heads, head_dim)
            hidden_states = _attend(
                self, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attention_mask
            )
            hidden_states = hidden_states.flatten(2, 3)
            hidden_states = attn.to_out[0](hidden_states)
            hidden_states = attn.to_out[1](hidden_states)
            encoder_hidden_states, hidden_states = hidden_states.split(
                [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1
            )
            return hidden_states, encoder_hidden_states

    return CogVideoXUlyssesAttnProcessor


@_once
def joint_processor_class():
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    class JointUlyssesAttnProcessor(JointAttnProcessor2_0):
        """JointAttnProcessor2_0.__call__ (diffusers 0.42.1, models/attention_processor.py: SD3's joint attention
        of image and text tokens, and SD3.5's image-only second attention), its ``F.scaled_dot_product_attention``
        replaced by ``dispatch_attention_fn`` with this processor's parallel config."""

        _attention_backend = None
        _parallel_config = None
        token_padding = None

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
            import torch

            image_tokens = hidden_states.shape[1]
            mask = None
            if encoder_hidden_states is not None and self.token_padding is not None:
                # the joint attention's keys: each rank's image tokens, then its text tokens
                mask = self.token_padding.key_mask(encoder_hidden_states.shape[1], image_tokens, hidden_states.device)
            batch_size = hidden_states.shape[0]
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
            head_dim = key.shape[-1] // attn.heads
            query, key, value = (x.view(batch_size, -1, attn.heads, head_dim) for x in (query, key, value))
            # norms act on the last (head_dim) dimension: the (batch, tokens, heads, head_dim) layout is theirs too
            if attn.norm_q is not None:
                query = attn.norm_q(query)
            if attn.norm_k is not None:
                key = attn.norm_k(key)
            if encoder_hidden_states is not None:
                context = [
                    proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim)
                    for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
                ]
                if attn.norm_added_q is not None:
                    context[0] = attn.norm_added_q(context[0])
                if attn.norm_added_k is not None:
                    context[1] = attn.norm_added_k(context[1])
                query, key, value = (torch.cat([x, c], dim=1) for x, c in zip((query, key, value), context))

            hidden_states = _attend(self, query, key, value, mask)
            hidden_states = hidden_states.reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)
            if encoder_hidden_states is not None:
                hidden_states, encoder_hidden_states = hidden_states[:, :image_tokens], hidden_states[:, image_tokens:]
                if not attn.context_pre_only:
                    encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
            hidden_states = attn.to_out[0](hidden_states)
            hidden_states = attn.to_out[1](hidden_states)
            if encoder_hidden_states is not None:
                return hidden_states, encoder_hidden_states
            return hidden_states

    return JointUlyssesAttnProcessor


@_once
def hunyuan_video_processor_class():
    import torch
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    class HunyuanVideoUlyssesAttnProcessor(HunyuanVideoAttnProcessor2_0):
        """HunyuanVideoAttnProcessor2_0 with its key mask in the order of the keys after Ulysses' exchange.

        The model builds one mask ``[B, 1, 1, video + text]`` for the whole sequence (transformer_hunyuan_video.py
        ``forward``, step 3); a rank's queries are ``[video_r, text_r]``, and after the all-to-all its keys are
        ``[video_0, text_0, video_1, text_1, ...]``: the mask is reordered so (it is whole on every rank)."""

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
            config = self._parallel_config
            if attention_mask is not None and encoder_hidden_states is not None and config is not None:
                world = config.context_parallel_config.ulysses_degree
                video, text = hidden_states.shape[1], encoder_hidden_states.shape[1]
                if attention_mask.shape[-1] == world * (video + text):
                    whole_video, whole_text = attention_mask.split([world * video, world * text], dim=-1)
                    attention_mask = torch.cat(
                        [
                            part
                            for rank in range(world)
                            for part in (
                                whole_video[..., rank * video : (rank + 1) * video],
                                whole_text[..., rank * text : (rank + 1) * text],
                            )
                        ],
                        dim=-1,
                    )
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    return HunyuanVideoUlyssesAttnProcessor


@_once
def cosmos_self_attention_processor_class():
    from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0

    class CosmosUlyssesSelfAttnProcessor(CosmosAttnProcessor2_0):
        """CosmosAttnProcessor2_0.__call__ (diffusers 0.42.1, models/transformers/transformer_cosmos.py) for the
        blocks' self-attention, its ``dispatch_attention_fn`` given this processor's backend and parallel config
        (upstream passes neither); RoPE on the rank's tokens with the rank's rows of the tables."""

        _attention_backend = None
        _parallel_config = None

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
            if encoder_hidden_states is None:
                encoder_hidden_states = hidden_states
            query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
            key = attn.to_k(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
            value = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
            query, key = attn.norm_q(query), attn.norm_k(key)
            if image_rotary_emb is not None:
                from diffusers.models.embeddings import apply_rotary_emb

                query = apply_rotary_emb(query, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
                key = apply_rotary_emb(key, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
            key = key.repeat_interleave(query.size(3) // key.size(3), dim=3)
            value = value.repeat_interleave(query.size(3) // value.size(3), dim=3)
            hidden_states = _attend(
                self, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attention_mask
            )
            hidden_states = hidden_states.flatten(2, 3).type_as(query)
            hidden_states = attn.to_out[0](hidden_states)
            return attn.to_out[1](hidden_states)

    return CosmosUlyssesSelfAttnProcessor
