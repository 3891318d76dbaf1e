"""Launchers (torchrun, accelerate launch): checks before workers start, and worker environment.

Both launchers end in ``torch.distributed.launcher.api.launch_agent``; workers inherit the
agent's environment. Before they start we (1) let plugins refuse an impossible launch, (2) add
plugins' environment defaults where the user set nothing, and (3) put accel-npu's bootstrap on
PYTHONPATH so workers activate even when a script imports torch_npu before torch (which turns
torch's entry points off for that process).
"""

from __future__ import annotations

import logging
import os

from accel_npu._torch.nodes import SINGLE, Nodes, nodes_of, port_free
from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch, argument

log = logging.getLogger("accel_npu")


def bootstrap_dir() -> str:
    import accel_npu.activation._bootstrap as bootstrap

    return os.path.dirname(os.path.abspath(bootstrap.__file__))


def worker_script_dir(entrypoint, cmd_args) -> str | None:
    """The directory a worker puts first on sys.path: the script's (``python script.py``), the
    working directory (``python -m module``), or the entrypoint's own when it is the script."""
    if not isinstance(entrypoint, str):
        return None
    if not os.path.basename(entrypoint).startswith("python"):
        return os.path.dirname(os.path.abspath(entrypoint))
    args = [str(a) for a in cmd_args]
    if "-m" in args:
        return os.getcwd()
    script = next((a for a in args if not a.startswith("-")), None)
    return os.path.dirname(os.path.abspath(script)) if script else None


def main_port_problem(nodes: Nodes) -> str | None:
    """Why the main machine cannot host the rendezvous: its port is taken here (another job, or a
    launch of this one still running). Stock, torch's TCPStore fails with EADDRINUSE, a traceback."""
    if not (nodes.multi and nodes.hosts_the_store and nodes.master_port):
        return None
    if port_free(nodes.master_port):
        return None
    return (
        f"accel-npu: refusing to start workers: this is machine rank 0, which hosts the rendezvous on port "
        f"{nodes.master_port} (--main_process_port, torchrun --master_port), and that port is already in use "
        f"on this machine (another job, or an earlier launch still running: `ss -ltnp 'sport = :{nodes.master_port}'` "
        f"names it). Pick a free port and pass the same --main_process_port to every machine."
    )


def prepare_worker_environment(
    num_processes: int, environ=None, script_dir: str | None = None, nodes: Nodes = SINGLE
) -> dict[str, str]:
    """Run launch checks and apply environment defaults to ``environ`` (os.environ by default).

    ``nodes``: the launch's shape (machines, this machine's rank, the rendezvous endpoint).
    Returns the variables it set. Raises LaunchError when a plugin refuses the launch, when the
    main machine's rendezvous port is taken, or when the workers would import a copy of accel_npu
    that cannot activate them.
    """
    from accel_npu import install
    from accel_npu.backend import current_backend
    from accel_npu.errors import LaunchError
    from accel_npu.manager import get_plugin_manager

    environ = os.environ if environ is None else environ
    problem = install.worker_import_problem(environ.get("PYTHONPATH", ""), script_dir)
    if problem:
        raise LaunchError(f"accel-npu: refusing to start workers: {problem}.")
    problem = main_port_problem(nodes)
    if problem:
        raise LaunchError(problem)
    pm = get_plugin_manager()
    backend = current_backend()
    pm.hook.accel_npu_check_launch(backend=backend, num_processes=num_processes, env=dict(environ), nodes=nodes)
    added: dict[str, str] = {}
    for defaults in pm.hook.accel_npu_launch_env(backend=backend, env=dict(environ), nodes=nodes, launching=True):
        for key, value in (defaults or {}).items():
            if key not in environ and key not in added:
                added[key] = str(value)
    environ.update(added)
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if bootstrap_dir() not in paths:
        environ["PYTHONPATH"] = os.pathsep.join([bootstrap_dir(), *paths])
    _warn_patches_outside_their_range()
    _warn_undeclared_torch_needs()
    if added:
        log.info("accel-npu: worker environment defaults: %s", ", ".join(f"{k}={v}" for k, v in sorted(added.items())))
    return added


def _warn_patches_outside_their_range() -> None:
    """One warning per launch naming every patch the installed versions switch off, with what each
    fixes: a library newer than accel-npu knows runs stock there, and its users must hear it before
    step 1 (without the rank-0 save_state cooperation, for one, the hangs come back)."""
    from accel_npu.patching import get_ledger

    off = get_ledger().outside_their_range()
    if not off:
        return
    versions = sorted({p.installed_outside_range() for p in off})
    log.warning(
        "accel-npu: %d patch(es) are off for %s, so these fixes are not active in this launch "
        "(install versions inside the ranges, or an accel-npu release that supports yours; "
        "`accel-npu env` lists them): %s",
        len(off),
        ", ".join(versions),
        "; ".join(f"{p.target} ({p.supports}): {p.reason}" for p in off),
    )


def _warn_undeclared_torch_needs() -> None:
    """A library release that needs a newer torch than installed (accel_npu.compat): every rank would fail far
    from the cause, so the launch says it once, with the pip fix, before any worker starts."""
    from accel_npu.compat import undeclared_torch_mismatches

    for line in undeclared_torch_mismatches():
        log.warning("accel-npu: %s", line)


def _launch_agent(wrapped, instance, args, kwargs):
    config = argument(args, kwargs, 0, "config")
    entrypoint = argument(args, kwargs, 1, "entrypoint")
    cmd_args = argument(args, kwargs, 2, "args", ())
    nproc = getattr(config, "nproc_per_node", 1) or 1
    from accel_npu.errors import LaunchError

    try:
        prepare_worker_environment(
            int(nproc), script_dir=worker_script_dir(entrypoint, cmd_args or ()), nodes=nodes_of(config)
        )
    except LaunchError as exc:
        # One clear error, not a traceback through accelerate's and torch's launchers.
        raise SystemExit(f"{type(exc).__name__}: {exc}") from None
    return wrapped(*args, **kwargs)


def _validate_launch_command(wrapped, instance, args, kwargs):
    from accel_npu.backend import current_backend
    from accel_npu.manager import get_plugin_manager

    hook = get_plugin_manager().hook.accel_npu_launch_args
    backend = current_backend()
    hook(backend=backend, launch_args=argument(args, kwargs, 0, "args"), resolved=False)
    result = wrapped(*args, **kwargs)
    hook(backend=backend, launch_args=result[0], resolved=True)
    return result


VALIDATE_LAUNCH_COMMAND = Patch(
    target="accelerate.commands.launch:_validate_launch_command",
    supports="accelerate>=1.10.1,<1.17",
    # devices.cpu: N gloo workers with torchrun; sequence_parallel: --use_parallelism_config beside DeepSpeed
    reason="accelerate refuses or narrows launches a plugin makes work; the accel_npu_launch_args hook adjusts "
    "them around its validation.",
    remove_when="no plugin implements accel_npu_launch_args",
    wrapper=".launcher:_validate_launch_command",
)


LAUNCH_AGENT = Patch(
    target="torch.distributed.launcher.api:launch_agent",
    supports="torch>=2.5.1,<2.16",
    reason="Workers must inherit accel-npu's activation and the backend's environment defaults, and "
    "a launch that cannot work must be refused before they start.",
    remove_when="never: this is how accel-npu reaches launched workers",
    wrapper=".launcher:_launch_agent",
)


@hookimpl
def accel_npu_register_patches():
    return [LAUNCH_AGENT, VALIDATE_LAUNCH_COMMAND]
