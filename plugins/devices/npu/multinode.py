"""HCCL across machines, checked on this machine before its workers start: the host interface HCCL
may use (HCCL_SOCKET_IFNAME, HCCL_IF_IP), and HCCL_CONNECT_TIMEOUT for the job's size.

HCCL_SOCKET_IFNAME, as CANN's environment variable reference gives it (HCCL_SOCKET_IFNAME,
envref_07_0075, canncommercial 8.0.0 .. 9.0.0): a comma list of interface-name prefixes ("eth,enp":
any interface whose name starts with eth or enp), "=" before the list for exact names ("=eth0,enp0"),
"^" to exclude prefixes ("^eth,enp") and "^=" to exclude exact names; HCCL takes the first match, and
HCCL_IF_IP wins over it. Prefixes are how one value serves machines whose interfaces are named
differently (enp189s0f0 here, enp61s0f0 there).
"""

from __future__ import annotations

import ipaddress
import math
import os
import re

from accel_npu._torch.nodes import parse_socket_ifname, usable_interfaces

#: HCCL_CONNECT_TIMEOUT's range in CANN's environment variable reference (HCCL_CONNECT_TIMEOUT,
#: envref_07_0077): whole seconds in [120, 7200], default 120
CONNECT_TIMEOUT_RANGE = (120, 7200)
#: the npu backend's default: above the guide's line below at 8K processes (0.18 s x 8000 - 300 s = 1140 s)
CONNECT_TIMEOUT_DEFAULT = 1200
#: CANN's HCCL test guide: 240 s at 3K cards, 600 s at 5K (figures not in the HCCL_CONNECT_TIMEOUT
#: reference above, which gives only the range); the line through those two points, 0.18 s per card - 300 s
_GUIDE_POINTS = ((3000, 240), (5000, 600))


def connect_timeout_for(world_size: int) -> int:
    """HCCL_CONNECT_TIMEOUT for ``world_size`` processes: the backend's 1200 s, or more where the HCCL
    test guide's line (see :data:`_GUIDE_POINTS`, extended past 5K cards) asks for more; at most 7200."""
    (n1, t1), (n2, t2) = _GUIDE_POINTS
    scaled = math.ceil(t1 + (world_size - n1) * (t2 - t1) / (n2 - n1))
    return min(max(CONNECT_TIMEOUT_DEFAULT, scaled), CONNECT_TIMEOUT_RANGE[1])


def _prefix_hint(items: list[str], names: list[str]) -> str | None:
    """The longest prefix a requested name shares with one of this machine's interfaces (2+ chars)."""
    best = ""
    for item in items:
        for name in names:
            common = os.path.commonprefix([item, name])
            if len(common) > len(best):
                best = common
    return best if len(best) >= 2 else None


def socket_ifname_problem(value: str, addresses: dict[str, list[str]]) -> str | None:
    """Why HCCL_SOCKET_IFNAME=``value`` leaves HCCL no interface on this machine; None when it does not.
    ``addresses``: this machine's interfaces (in order) and their addresses."""
    names = list(addresses)
    exclude, exact, items = parse_socket_ifname(value)
    if not items:
        return (
            f"HCCL_SOCKET_IFNAME={value!r} names no interface. Give interface-name prefixes separated by "
            "commas (eth,enp), '=' before exact names (=eth0), '^' to exclude (CANN's HCCL_SOCKET_IFNAME)"
        )
    if usable_interfaces(value, names):
        return None
    have = ", ".join(f"{name} {'/'.join(addresses[name])}" if addresses[name] else name for name in names) or "none"
    if exclude:
        return (
            f"HCCL_SOCKET_IFNAME={value} excludes every interface of this machine ({have}). Name the one "
            "that reaches the other machines instead, as a prefix every machine's interface starts with"
        )
    # interfaces that can carry traffic to another machine: an address, not the loopback
    own = [name for name in names if addresses[name] and name != "lo"]
    hint = _prefix_hint(items, own)
    if hint:
        fix = (
            f"interface names differ between machines: a prefix matches them all, e.g. HCCL_SOCKET_IFNAME={hint} "
            f"({', '.join(n for n in own if n.startswith(hint))} here)"
        )
    else:
        stem = re.match(r"[A-Za-z]+", own[0]).group(0) if own and re.match(r"[A-Za-z]+", own[0]) else None
        fix = (
            f"name this machine's interface, as a prefix every machine's starts with (e.g. HCCL_SOCKET_IFNAME={stem})"
            if stem
            else "name one of this machine's interfaces"
        )
    kind = "exact name" if exact else "prefix"
    return f"HCCL_SOCKET_IFNAME={value}: no interface on this machine matches that {kind} (it has: {have}); {fix}"


def if_ip_problem(value: str, addresses: dict[str, list[str]], is_local) -> str | None:
    """Why HCCL_IF_IP=``value`` cannot be this machine's HCCL address; None when it can. ``is_local``
    tells whether an address belongs to this machine (a bind test)."""
    try:
        ipaddress.ip_address(value.strip())
    except ValueError:
        return f"HCCL_IF_IP={value!r} is not an IP address (HCCL_IF_IP is this machine's host address, e.g. 10.0.0.5)"
    if is_local(value.strip()):
        return None
    have = "; ".join(f"{name} {', '.join(found)}" for name, found in addresses.items() if found) or "none found"
    return (
        f"HCCL_IF_IP={value} is not an address of this machine (it has: {have}). HCCL_IF_IP differs on every "
        "machine: set it in each machine's own environment, not in a config all machines share, or use "
        "HCCL_SOCKET_IFNAME (an interface-name prefix) instead"
    )
