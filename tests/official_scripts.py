"""Helpers the official-script tests share: a streamed ``accelerate launch``, the one-line-fixed copy
of a script (what a user writes after reading the misuse error), and LoRA tensors as DeepSpeed,
the saved file and diffusers' ``load_lora_weights`` each give them."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

from tests.launch_utils import kill_tree

FIX = "if accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:"


def line_of(path: Path, text: str, after: int = 0) -> int:
    """The 1-based number of the first line after ``after`` whose stripped text is ``text``."""
    lines = Path(path).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if i > after and line.strip() == text)


def fixed_copy(script: Path, directory: Path, name: str | None = None) -> Path:
    """``script`` with the one-line fix the misuse error gives (the ``if accelerator.is_main_process:``
    guarding its first ``accelerator.save_state`` lets every rank in under DeepSpeed) and its import,
    written to ``directory``, never into this repository."""
    lines = Path(script).read_text().splitlines(keepends=True)
    save = next(i for i, line in enumerate(lines) if line.lstrip().startswith("accelerator.save_state("))
    indent = len(lines[save]) - len(lines[save].lstrip())
    guard = next(
        i
        for i in range(save - 1, -1, -1)
        if lines[i].strip() == "if accelerator.is_main_process:" and len(lines[i]) - len(lines[i].lstrip()) < indent
    )
    assert all(
        len(line) - len(line.lstrip()) > len(lines[guard]) - len(lines[guard].lstrip())
        for line in lines[guard + 1 : save]
        if line.strip()
    ), "the save_state is not inside that if"
    lines[guard] = lines[guard][: len(lines[guard]) - len(lines[guard].lstrip())] + FIX + "\n"
    first_import = next(i for i, line in enumerate(lines) if line.startswith("from accelerate.utils import"))
    lines.insert(first_import, "from accelerate.utils import DistributedType\n")
    path = Path(directory) / (name or f"fixed_{Path(script).name}")
    path.write_text("".join(lines))
    return path


class StreamedLaunch:
    """One launch started now in a session of its own, its output read as it comes: when each step of
    ``steps`` showed in the progress bar, when accel-npu's misuse error showed, when the output closed."""

    def __init__(self, args: list[str], env: dict | None, cwd: Path, steps: int = 0, out: Path | None = None):
        self.out, self.steps = out, steps
        self.text: list[str] = []
        self.step_seen: dict[int, float] = {}
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        buf = ""
        while chunk := self.proc.stdout.read1(4096).decode(errors="replace"):
            buf += chunk
            self.text.append(chunk)
            if "CollectiveMisuseError: " in buf and not hasattr(self, "error_seen"):
                self.error_seen = time.monotonic()
            if self.steps:
                for n in map(int, re.findall(rf"\| (\d+)/{self.steps} \[", buf[-2000:])):
                    if n not in self.step_seen:
                        self.first_seen(n)
            buf = buf[-4000:]
        self.exited = time.monotonic()  # the launcher and its workers closed their output: they ended

    def first_seen(self, step: int) -> None:
        """Called once per step, when the progress bar first shows it."""
        self.step_seen[step] = time.monotonic()

    def wait(self, timeout: float = 900) -> StreamedLaunch:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self.reader.join(10)
        self.seconds = time.monotonic() - self.started
        return self

    def kill(self):
        kill_tree(self.proc.pid)  # the launcher and its ranks (each in a session of its own)
        self.proc.wait(30)

    @property
    def returncode(self):
        return self.proc.returncode

    @property
    def output(self) -> str:
        return "".join(self.text)

    def explain(self) -> str:
        return f"exit {self.proc.returncode} after {time.monotonic() - self.started:.0f} s\n{self.output[-8000:]}"


def master_lora(ckpt: Path) -> dict:
    """DeepSpeed's own reading of a checkpoint: {peft name without adapter: fp32 master weight}."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    return {k.replace(".default.", "."): v for k, v in state.items() if ".lora_" in k}


def lora_file(path: Path) -> dict:
    """A saved LoRA file (a folder's pytorch_lora_weights.safetensors, or the file) in peft names without
    the component prefix; diffusers' names (lora.down / lora.up, SDXL's hooks) read as peft's."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        path = path / "pytorch_lora_weights.safetensors"
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            name = k.split(".", 1)[1].replace(".lora.down.", ".lora_A.").replace(".lora.up.", ".lora_B.")
            out[name] = f.get_tensor(k)
    return out


def loaded_lora(pipeline_class, pipe: Path, lora_dir: Path, component: str = "transformer") -> dict:
    """The adapter as the pipeline's ``load_lora_weights`` loads it: {module.lora_X.weight: tensor} of
    the trained component."""
    import torch

    pipeline = pipeline_class.from_pretrained(str(pipe), torch_dtype=torch.float32)
    pipeline.load_lora_weights(str(lora_dir))
    out = {}
    for k, v in getattr(pipeline, component).state_dict().items():
        if ".lora_" in k:
            module, kind, _adapter, rest = k.rsplit(".", 3)
            out[f"{module}.{kind}.{rest}"] = v
    return out
