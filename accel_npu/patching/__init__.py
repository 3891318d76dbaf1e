"""Patches: declared (:class:`Patch`), applied and undone by one ledger (:func:`get_ledger`)."""

from accel_npu.patching.arguments import argument, passed, with_argument
from accel_npu.patching.imports import call_when_imported, still_importing
from accel_npu.patching.ledger import PatchLedger, get_ledger, original_of
from accel_npu.patching.patch import APPLIED, DISABLED, INACTIVE, NOT_IMPORTED, NOT_NEEDED, UNPATCHED, Patch, Wrapper
from accel_npu.patching.scope import Scope
from accel_npu.patching.versions import installed_version, parse_supports, version_satisfies

__all__ = [
    "APPLIED",
    "DISABLED",
    "INACTIVE",
    "NOT_IMPORTED",
    "NOT_NEEDED",
    "UNPATCHED",
    "Patch",
    "PatchLedger",
    "Scope",
    "Wrapper",
    "argument",
    "call_when_imported",
    "get_ledger",
    "installed_version",
    "original_of",
    "parse_supports",
    "passed",
    "still_importing",
    "version_satisfies",
    "with_argument",
]
