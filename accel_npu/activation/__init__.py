"""Turning accel-npu on in a process: load plugins, collect their patches, arm the ledger."""

from __future__ import annotations

import logging
import threading

from accel_npu import environment

log = logging.getLogger("accel_npu")

_lock = threading.Lock()
_activated = False
#: Plugin name -> error raised by its accel_npu_register_patches (reported by `accel-npu env`).
registration_errors: dict[str, str] = {}


def activate(strict: bool = False) -> bool:
    """Activate once per process. Returns True when active.

    ``strict=False`` (the torch entry point): every error is logged, never raised.
    """
    global _activated
    if environment.disabled():
        return False
    with _lock:
        if _activated:
            from accel_npu.patching import get_ledger

            get_ledger().arm()  # re-arm after an explicit unpatch()
            return True
        from accel_npu.activation import triggers

        # Before activating: the plugins' own imports (the npu plugin looks up torch_npu, a trigger)
        # must not re-enter here, and a later trigger import must not re-arm after unpatch().
        triggers.stop_waiting()
        try:
            _activate()
            _activated = True
        except Exception as exc:
            if strict:
                raise
            log.warning(
                "accel-npu: disabled in this process, activation failed: %s: %s "
                "(ACCEL_NPU_TRACE=1 shows the traceback)",
                type(exc).__name__,
                exc,
                exc_info=environment.flag("ACCEL_NPU_TRACE"),
            )
            return False
    return True


def _activate() -> None:
    from accel_npu.manager import get_plugin_manager, plugin_package
    from accel_npu.patching import get_ledger

    pm = get_plugin_manager()
    ledger = get_ledger()
    # Call each plugin's registration separately so the ledger knows who declared what,
    # and one plugin's broken declaration does not hide the others'.
    for impl in pm.hook.accel_npu_register_patches.get_hookimpls():
        try:
            for patch in impl.function() or ():
                ledger.register(patch, plugin=impl.plugin_name, package=plugin_package(impl.plugin))
        except Exception as exc:  # noqa: BLE001 - one plugin's broken declaration must not hide the others'
            registration_errors[impl.plugin_name] = f"{type(exc).__name__}: {exc}"
            log.warning("accel-npu: plugin %r failed to declare its patches and is skipped: %s", impl.plugin_name, exc)
    unknown = environment.disabled_patches() - {p.target for p in ledger.patches}
    if unknown:
        log.warning(
            "accel-npu: ACCEL_NPU_DISABLED_PATCHES names %s, which no plugin declares (targets are "
            "listed by `accel-npu env`)",
            ", ".join(sorted(unknown)),
        )
    ledger.arm()
    pm.hook.accel_npu_activate(backend_name=environment.forced_backend())


def is_active() -> bool:
    from accel_npu.patching import get_ledger

    return _activated and get_ledger().armed
