"""Built-in accel-npu plugins, installed as ``accel_npu.plugins`` (setup.cfg package_dir).

One package per concern (docs/developing.md). A plugin is a module or a package whose top level
declares its hook implementations and Patch objects; its implementation sits beside it. Importing
one changes nothing.
"""

if __name__ != "accel_npu.plugins":
    raise ImportError(
        f"accel-npu's built-in plugins were imported as {__name__!r}; import them as "
        "'accel_npu.plugins' (`import accel_npu.plugins` maps plugins/ from a source checkout too)."
    )
