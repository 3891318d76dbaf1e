"""The ``torch.backends`` entry point: torch calls :func:`activate_from_torch` inside ``import torch``.

Rules: cheap, and never raises — an exception here would break ``import torch`` itself. Where
nothing accel-npu patches is in use yet, activation waits for it (:mod:`.triggers`).
"""


def activate_from_torch() -> None:
    try:
        from accel_npu import environment

        if environment.disabled():
            return
        from accel_npu.activation import activate, triggers

        if triggers.activate_now():
            activate(strict=False)
        else:
            triggers.activate_on_first_trigger(lambda: activate(strict=False))
    except BaseException as exc:  # noqa: BLE001 - must not break `import torch`, even on SystemExit
        try:
            import sys

            sys.stderr.write(f"accel-npu: disabled in this process, activation failed: {exc!r}\n")
        except BaseException:  # noqa: BLE001 - stderr itself may be gone; `import torch` must still not fail
            pass
