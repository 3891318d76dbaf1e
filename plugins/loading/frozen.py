"""Loads of frozen towers, kept outside ``zero.Init`` and in their checkpoint dtype.

Inside ``DeepSpeedPlugin.zero3_init_context_manager(enable=False)`` and
``DiffusionPipeline.from_pretrained``, transformers' ``HfDeepSpeedConfig`` weakref is cleared, so
those models are built whole (accelerate #3170).
"""
from __future__ import annotations

import contextlib

from accel_npu._torch.zero import outside_zero_init, zero3_weakref_set


def pipeline_from_pretrained(wrapped, cls, args, kwargs):
    """Pipeline components are inference towers: load them outside zero.Init, keeping their dtype."""
    if not zero3_weakref_set():
        return wrapped(*args, **kwargs)
    with outside_zero_init():
        return wrapped(*args, **kwargs)


def zero3_init_context_manager(wrapped, instance, args, kwargs):
    """``zero3_init_context_manager(enable=False)`` really disables zero.Init (accelerate #3170)."""
    enable = kwargs.get("enable", args[0] if args else False)
    inner = wrapped(*args, **kwargs)
    if enable:
        return inner

    @contextlib.contextmanager
    def _disabled():
        with inner:
            with outside_zero_init():
                yield

    return _disabled()
