"""Built-in accel-npu plugins, installed as ``accel_npu.plugins`` (setup.cfg package_dir).

Each module is one concern and only declares hook implementations and Patch objects:
importing one changes nothing.
"""
if __name__ != "accel_npu.plugins":
    raise ImportError(
        f"accel-npu's built-in plugins were imported as {__name__!r}; import them as "
        "'accel_npu.plugins' (running from the repository root puts plugins/ on sys.path: "
        "install with `pip install -e .` and import accel_npu.plugins)."
    )
