"""The questions of `accel-npu config`, asked in a terminal like `accelerate config` does.

Every question shows its default in [brackets] (detected on this machine, or taken from a
template); Enter accepts it. Choices take their number or their name. A question whose answer
was given as a flag is not asked. Invalid answers are explained and asked again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

from accel_npu.cli.config import settings as wizard
from accel_npu.cli.config.settings import Machine, Settings
from accel_npu.errors import ConfigError


class Aborted(Exception):
    """The user pressed Ctrl-C / Ctrl-D: nothing is written."""


class Prompter:
    def __init__(self, out=None, read: Callable[[str], str] | None = None) -> None:
        self.out = out or sys.stdout
        self._read = read or input

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _input(self, prompt: str) -> str:
        try:
            return self._read(prompt).strip()
        except EOFError:
            raise Aborted("input ended; in scripts use --non-interactive with flags") from None
        except KeyboardInterrupt:
            raise Aborted("interrupted") from None

    def ask(self, question: str, default, convert: Callable[[str], object] = str):
        shown = "" if default is None or default == "" else f" [{default}]"
        prompt = f"{question}{shown}: "
        while True:
            answer = self._input(prompt)
            if not answer:
                if default is None or default == "":
                    if convert is _optional:
                        return ""
                    self.say("  ! an answer is needed here")
                    continue
                answer = str(default)
            try:
                return convert(answer)
            except (ValueError, ConfigError) as exc:
                self.say(f"  ! {exc}")

    def choose(self, question: str, options: Sequence[tuple[str, str]], default: str, note: str = "") -> str:
        self.say(question + (f" ({note})" if note else ""))
        width = max(len(name) for name, _ in options)
        for i, (name, text) in enumerate(options, 1):
            self.say(f"  {i}) {name.ljust(width)}  {text}")
        index = [name for name, _ in options].index(default) + 1
        names = [name for name, _ in options]

        def convert(answer: str) -> str:
            if answer.isdigit() and 1 <= int(answer) <= len(options):
                return names[int(answer) - 1]
            if answer.lower() in names:
                return answer.lower()
            raise ValueError(f"type a number from 1 to {len(options)} or one of: {', '.join(names)}")

        return self.ask("Your choice", f"{index}", convert)

    def confirm(self, question: str, default: bool) -> bool:
        def convert(answer: str) -> bool:
            a = answer.lower()
            if a in ("y", "yes"):
                return True
            if a in ("n", "no"):
                return False
            raise ValueError("answer yes or no")

        return self.ask(question, "yes" if default else "no", convert)


def _optional(answer: str) -> str:
    return answer


def _int_between(low: int, high: int | None, what: str) -> Callable[[str], int]:
    def convert(answer: str) -> int:
        try:
            value = int(answer)
        except ValueError:
            raise ValueError(f"{what} must be a whole number") from None
        if value < low or (high is not None and value > high):
            rng = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise ValueError(f"{what} must be {rng} (got {value})")
        return value

    return convert


def _checked(check: Callable[[str], str | None], keep_words: bool = False) -> Callable[[str], str]:
    def convert(answer: str) -> str:
        value = answer if keep_words or answer.lower() not in ("none", "auto", "-") else ""
        problem = check(value)
        if problem:
            raise ValueError(problem)
        return value

    return convert


def _sp_size(total: int, strategy: str) -> Callable[[str], int]:
    def convert(answer: str) -> int:
        value = _int_between(1, total, "the sequence-parallel size")(answer)
        problem = wizard.sp_size_problem(value, total, strategy)
        if problem:
            raise ValueError(problem)
        return value

    return convert


def _auto_int(what: str) -> Callable[[str], str]:
    def convert(answer: str) -> str:
        problem = wizard.check_auto_int(answer, what)
        if problem:
            raise ValueError(problem)
        return "auto" if answer.lower() == "auto" else str(int(answer))

    return convert


_BACKEND_TEXT = {
    "npu": "Ascend NPU (torch_npu, HCCL)",
    "cuda": "NVIDIA GPU (NCCL)",
    "cpu": "CPU processes over gloo: debug the same config on any machine",
}
_STRATEGY_TEXT = {
    "ddp": "DDP: every process holds the whole model and optimizer",
    "zero2": "DeepSpeed ZeRO-2: optimizer states and gradients sharded (simplest ZeRO)",
    "zero3": "DeepSpeed ZeRO-3: parameters sharded too (largest models and batches)",
}
_OFFLOAD_TEXT = {
    "none": "keep everything on the devices",
    "optimizer": "optimizer states in host memory (slower steps, much less device memory)",
    "all": "optimizer states and parameters in host memory (ZeRO-3 only)",
}
_PRECISION_TEXT = {
    "bf16": "bfloat16 mixed precision",
    "fp16": "float16 mixed precision with loss scaling",
    "no": "full fp32",
}


def interview(p: Prompter, machine: Machine, base: Settings, given: set[str]) -> Settings:
    """Ask every question not answered by a flag; returns the answers (not yet validated as a whole)."""
    s = replace(base, npu_env=dict(base.npu_env))
    found = (
        f"{machine.device_count} {wizard.device_word(machine.backend)}(s) visible"
        if machine.backend != "cpu"
        else "no accelerator found"
    )
    p.say(f"This machine: backend {machine.backend} ({found}).")
    p.say("Press Enter to accept the value in [brackets]; choices take a number or a name.")
    p.say()

    if "backend" not in given:
        chosen = p.choose(
            "Which device backend will you train on?",
            [(b, _BACKEND_TEXT[b] + ("  <- detected" if b == machine.backend else "")) for b in wizard.BACKENDS],
            s.backend,
        )
        if chosen != s.backend:
            d = wizard.default_settings(machine, chosen)
            s.backend, s.processes_per_machine, s.npu_env = chosen, d.processes_per_machine, d.npu_env
            if s.mixed_precision not in wizard.precision_choices(chosen, machine):
                s.mixed_precision = d.mixed_precision
            if chosen == "cpu":
                s.offload = "none"

    if "num_machines" not in given:
        s.num_machines = p.ask(
            "How many machines (nodes) will train together?",
            s.num_machines,
            _int_between(1, None, "the number of machines"),
        )
    if s.num_machines > 1:
        if "machine_rank" not in given:
            s.machine_rank = p.ask(
                f"Rank of THIS machine (0 = the main machine, up to {s.num_machines - 1})?",
                s.machine_rank,
                _int_between(0, s.num_machines - 1, "the machine rank"),
            )
        if "main_process_ip" not in given:
            s.main_process_ip = p.ask("IP address of the main machine (rank 0)?", s.main_process_ip, str)
        if "main_process_port" not in given:
            s.main_process_port = p.ask(
                "Port on the main machine?", s.main_process_port, _int_between(1, 65535, "the port")
            )
        tuning = wizard.worker_tuning(s.backend)
        if tuning is not None and tuning.interface and "hccl_socket_ifname" not in given:
            default = s.hccl_socket_ifname or tuning.suggest_interface(s.main_process_ip) or "none"
            name, meaning = tuning.interface
            s.hccl_socket_ifname = p.ask(
                f"{name} ({meaning}; none = {tuning.interface_unset})?",
                default,
                _checked(tuning.interface_problem),
            )

    if "processes_per_machine" not in given:
        limit = wizard.device_limit(s.backend, machine)
        if limit is not None:
            note = f"one per device; {limit} {wizard.device_word(s.backend)}(s) visible here"
        elif s.backend == "cpu":
            note = "CPU ranks; 2 are enough to debug a distributed config"
        else:
            note = f"one per device; no {wizard.device_word(s.backend)} here to check against"
        s.processes_per_machine = p.ask(
            f"How many training processes on each machine? ({note})",
            min(s.processes_per_machine, limit) if limit else s.processes_per_machine,
            _int_between(1, limit, "the number of processes" + (" (one per visible device)" if limit else "")),
        )

    total = s.num_processes
    if "strategy" not in given:
        if total < 2:
            p.say("One process in total: no data parallelism and no ZeRO (ZeRO shards across processes).")
            s.strategy = "ddp"
        else:
            s.strategy = p.choose(
                "How should the processes share the training state?",
                [(k, _STRATEGY_TEXT[k]) for k in wizard.STRATEGIES],
                s.strategy if s.strategy in wizard.STRATEGIES else "zero2",
            )
    if not s.uses_deepspeed:
        s.offload = "none"
    elif "offload" not in given:
        if s.backend == "cpu":
            s.offload = "none"
        else:
            offers = ["none", "optimizer"] + (["all"] if s.strategy == "zero3" else [])
            s.offload = p.choose(
                "Offload to host (CPU) memory?",
                [(k, _OFFLOAD_TEXT[k]) for k in offers],
                s.offload if s.offload in offers else "none",
            )
    if s.strategy == "zero3" and "zero3_init" not in given:
        s.zero3_init = p.confirm(
            "ZeRO-3: build models under deepspeed.zero.Init (each rank materializes only its shard)?", s.zero3_init
        )

    if "sp_size" not in given:
        if s.strategy in wizard.SEQUENCE_PARALLEL_STRATEGIES and total > 1:
            video = p.confirm(
                "Is the model you train a video DiT with long token sequences (CogVideoX, Wan, HunyuanVideo, LTX, "
                "...)?",
                s.sp_size > 1,
            )
            s.sp_size = (
                p.ask(
                    f"Sequence-parallel size: ranks splitting one sample's tokens (Ulysses; it divides the {total} "
                    "processes and the model's attention heads)?",
                    s.sp_size if s.sp_size > 1 else (2 if total % 2 == 0 else 1),
                    _sp_size(total, s.strategy),
                )
                if video
                else 1
            )
        else:
            s.sp_size = 1  # a template's answer, once a strategy without sequence parallelism is chosen

    if "mixed_precision" not in given:
        choices = wizard.precision_choices(s.backend, machine)
        default = s.mixed_precision if s.mixed_precision in choices else choices[0]
        where = "the DeepSpeed JSON" if s.uses_deepspeed else "the accelerate YAML"
        s.mixed_precision = p.choose(
            f"Mixed precision? (declared once, in {where})", [(k, _PRECISION_TEXT[k]) for k in choices], default
        )

    if s.uses_deepspeed and "micro_batch_size" not in given:
        s.micro_batch_size = p.ask(
            "Micro batch size per device (auto = the batch size of your DataLoader)?",
            s.micro_batch_size,
            _auto_int("the micro batch size"),
        )
    if "gradient_accumulation_steps" not in given:
        s.gradient_accumulation_steps = p.ask(
            "Gradient accumulation steps (auto = what your script passes to Accelerator)?",
            s.gradient_accumulation_steps,
            _auto_int("gradient accumulation steps"),
        )

    tuning = wizard.worker_tuning(s.backend)
    if tuning is not None and tuning.variables and "npu_env" not in given:
        current = ", ".join(f"{k}={v}" for k, v in s.npu_env.items())
        if not p.confirm(f"Use these {tuning.title}? {current}", True):
            for name, meaning in tuning.variables:
                s.npu_env[name] = p.ask(
                    f"{name} ({meaning})?",
                    s.npu_env.get(name, ""),
                    _checked(lambda v, n=name: tuning.problem(n, v), keep_words=True),
                )

    if s.uses_deepspeed and "frozen_modules" not in given:
        s.frozen_modules = p.ask(
            "Frozen sub-models (VAE, text encoder) kept out of DeepSpeed: 'auto' detects children "
            "whose parameters are all frozen, or list child names (e.g. vae,text_encoder)?",
            s.frozen_modules or "auto",
            _checked(wizard.check_frozen),
        )
    if "load_slots" not in given:
        s.load_slots = p.ask(
            "How many ranks per machine may load model weights at the same time (auto = from free host memory)?",
            s.load_slots or "auto",
            _checked(lambda v: wizard.check_auto_int(v or "auto", "load slots")),
        )
    if "truncate" not in given:
        s.truncate = p.ask(
            "Truncate models while loading: Class:layers pairs, e.g. "
            "QwenImageTransformer2DModel:2 (none = load every layer)?",
            s.truncate or "none",
            _checked(wizard.check_truncate),
        )
    if s.uses_deepspeed and "async_checkpoint" not in given:
        s.async_checkpoint = p.confirm(
            "Write checkpoints in the background (save_state returns once each rank's state is in host memory; "
            "the checkpoint is published when every rank's files are durable)?",
            s.async_checkpoint,
        )
    elif not s.uses_deepspeed and "async_checkpoint" not in given:
        s.async_checkpoint = True  # a ZeRO template's answer, once DDP is chosen: nothing to write
    return s
