"""Build hooks only; the package is configured in setup.cfg.

They ship ``accel_npu_startup.pth`` to site-packages in every install shape: a wheel and
``pip install .`` (build_py writes it to the root of build_lib, which becomes site-packages) and
``pip install -e .`` (setuptools' editable wheel: written beside the editable finder's own .pth).
Its one line imports ``_accel_npu_startup`` (see that module for why). Written here rather than
kept as a file so that every sdist carries it without a MANIFEST.in. Its name sorts after
``__editable__.*.pth``: site runs .pth files in name order, and in an editable install that finder
is what finds ``_accel_npu_startup``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "accel_npu_startup.pth"
# site runs a .pth line that starts with "import"; the try keeps a checkout that has lost the
# module (an editable install after switching branches) from printing a traceback at every start.
PTH_LINE = 'import sys; exec("try: import _accel_npu_startup\\nexcept ImportError: pass")\n'


def write_pth(directory) -> str:
    path = Path(directory, PTH_NAME)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PTH_LINE, encoding="utf-8")
    return str(path)


class BuildPyWithStartupHook(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:  # an editable wheel does not ship build_lib; see below
            write_pth(self.build_lib)

    def get_outputs(self, include_bytecode=True):
        outputs = list(super().get_outputs(include_bytecode))
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib, PTH_NAME))]


class EditableWheelWithStartupHook(editable_wheel):
    # setuptools (>= 64) builds an editable wheel from the directory handed to _run_build_commands
    # as `unpacked_wheel`: what is written there is installed to site-packages.
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        write_pth(unpacked_wheel)
        return result


setup(cmdclass={"build_py": BuildPyWithStartupHook, "editable_wheel": EditableWheelWithStartupHook})
