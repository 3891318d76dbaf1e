"""Version ranges of patches ("accelerate>=1.10,<1.16"), checked cheaply inside ``import torch``."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
import sys

# Version ranges are checked inside `import torch`, so this avoids packaging.specifiers (whose
# regexes cost ~10-20 ms to compile) and compares with packaging.version.Version directly.
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)")
_CLAUSE = re.compile(r"\s*(~=|==|!=|>=|<=|>|<)\s*([0-9][0-9A-Za-z.+!-]*)\s*")
_COMPARE = {
    "==": lambda v, r: v == r,
    "!=": lambda v, r: v != r,
    ">=": lambda v, r: v >= r,
    "<=": lambda v, r: v <= r,
    ">": lambda v, r: v > r,
    "<": lambda v, r: v < r,
}


def parse_supports(supports: str) -> tuple[str, list[tuple[str, str]]]:
    """ "accelerate>=1.10,<1.16" -> ("accelerate", [(">=", "1.10"), ("<", "1.16")])."""
    match = _NAME.fullmatch(supports)
    if not match or not match.group(2).strip():
        raise ValueError("expected 'distribution<op>version[,<op>version...]'")
    clauses = []
    for part in match.group(2).split(","):
        clause = _CLAUSE.fullmatch(part)
        if not clause:
            raise ValueError(f"cannot read the clause {part.strip()!r}")
        clauses.append((clause.group(1), clause.group(2)))
    return match.group(1), clauses


def version_satisfies(installed: str, clauses: list[tuple[str, str]]) -> bool:
    # Inside `import torch` torch's vendored copy of packaging.version is already loaded: the same
    # code, without a second import.
    vendored = sys.modules.get("torch._vendor.packaging.version")
    Version = vendored.Version if vendored is not None else importlib.import_module("packaging.version").Version

    # Local labels ("2.13.0+cpu") do not change which release it is.
    v = Version(Version(installed).public)
    for op, ref in clauses:
        r = Version(ref)
        if op == "~=":  # compatible release: >= ref, same prefix but the last component
            prefix = r.release[:-1] or r.release
            if not (v >= r and v.release[: len(prefix)] == prefix):
                return False
        elif not _COMPARE[op](v, r):
            return False
    return True


@functools.cache
def installed_version(dist: str) -> str | None:
    if dist == "python":  # the interpreter itself, for patches of the standard library
        import platform

        return platform.python_version()
    # A patch is checked when its module is imported, so the distribution's package usually is too:
    # its __version__ is the metadata's version without a scan of every site-packages directory. Not
    # where it carries a local label: torch's CUDA wheels say 2.9.1+cu128 there and 2.9.1 in their
    # metadata, and a status must read the same in every process, whatever it imported.
    module = sys.modules.get(dist.replace("-", "_"))
    version = getattr(module, "__version__", None)
    if isinstance(version, str) and version[:1].isdigit() and "+" not in version:
        return version
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
