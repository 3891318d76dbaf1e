"""One node's view of a launch across machines: the launch's shape, this node's network interfaces
and addresses, and whether a port is free here. What a launcher can check on its own node before
any worker starts; nothing here talks to another node."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Nodes:
    """The launch as this node's launcher sees it (torch.distributed.launcher.api.LaunchConfig).

    count:         machines in the job (``--num_machines``, torchrun ``--nnodes``).
    rank:          this machine's rank under a static rendezvous (``--machine_rank``); None when the
                   rendezvous assigns it (c10d, etcd).
    world_size:    processes in the whole job (every machine runs the same number).
    master_addr:   the rendezvous endpoint's host (``--main_process_ip``).
    master_port:   its port (``--main_process_port``), None when not known.
    rdzv_backend:  torch's rendezvous backend: "static" (accelerate's default), "c10d", ...
    """

    count: int = 1
    rank: int | None = 0
    world_size: int = 1
    master_addr: str = ""
    master_port: int | None = None
    rdzv_backend: str = "static"

    @property
    def multi(self) -> bool:
        return self.count > 1

    @property
    def hosts_the_store(self) -> bool:
        """This node creates the rendezvous store on ``master_port``: rank 0 of a static rendezvous
        (torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py: ``is_host = rank == 0``)."""
        return self.rdzv_backend == "static" and self.rank == 0


SINGLE = Nodes()


def nodes_of(config) -> Nodes:
    """The launch's shape from torch's LaunchConfig (torch/distributed/run.py ``config_from_args``:
    ``rdzv_configs["rank"]`` is ``--node_rank`` for the static backend, the endpoint is
    ``master_addr:master_port``)."""
    count = int(getattr(config, "max_nodes", 1) or 1)
    nproc = int(getattr(config, "nproc_per_node", 1) or 1)
    backend = str(getattr(config, "rdzv_backend", "static") or "static")
    rank = (getattr(config, "rdzv_configs", None) or {}).get("rank") if backend == "static" else None
    host, _, port = str(getattr(config, "rdzv_endpoint", "") or "").rpartition(":")
    return Nodes(
        count=count,
        rank=None if rank is None else int(rank),
        world_size=count * nproc,
        master_addr=host.strip("[]"),
        master_port=int(port) if port.isdigit() else None,
        rdzv_backend=backend,
    )


def parse_socket_ifname(value: str) -> tuple[bool, bool, list[str]]:
    """(exclude, exact, names) of an HCCL_SOCKET_IFNAME value, in CANN's syntax (environment variable
    reference, HCCL_SOCKET_IFNAME, envref_07_0075): a comma list of name prefixes, "=" before it for
    exact names, "^" to exclude ("^eth,enp", "^=eth0")."""
    exclude = value.startswith("^")
    rest = value[1:] if exclude else value
    exact = rest.startswith("=")
    rest = rest[1:] if exact else rest
    return exclude, exact, [item.strip() for item in rest.split(",") if item.strip()]


def usable_interfaces(value: str, names: list[str]) -> list[str]:
    """The interfaces of ``names`` HCCL may pick under HCCL_SOCKET_IFNAME=``value``, in order."""
    exclude, exact, items = parse_socket_ifname(value)

    def listed(name: str) -> bool:
        return any(name == item if exact else name.startswith(item) for item in items)

    return [name for name in names if listed(name) != exclude]


def route_interface(address: str) -> str | None:
    """The interface of this node that traffic to ``address`` leaves by (a UDP connect sends
    nothing; the kernel picks the source address), or None when there is no route or no such name."""
    try:
        ip = ipaddress.ip_address(address)
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            local = sock.getsockname()[0]
    except (OSError, ValueError):
        return None
    return next((name for name, found in interface_addresses().items() if local in found), None)


def interface_names() -> list[str]:
    """This node's network interfaces, in the kernel's order (what /sys/class/net lists)."""
    return [name for _, name in socket.if_nameindex()]


def interface_addresses() -> dict[str, list[str]]:
    """This node's IPv4 and IPv6 addresses by interface (Linux: SIOCGIFADDR, /proc/net/if_inet6)."""
    import fcntl
    import struct

    out: dict[str, list[str]] = {name: [] for name in interface_names()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in out:
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                out[name].append(socket.inet_ntoa(packed[20:24]))
            except OSError:  # no IPv4 address on it
                pass
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6 and fields[5] in out:
                    out[fields[5]].append(str(ipaddress.IPv6Address(int(fields[0], 16))))
    except OSError:  # no IPv6 here
        pass
    return out


def is_local_address(address: str) -> bool:
    """``address`` belongs to this node: a socket can bind to it (EADDRNOTAVAIL otherwise)."""
    ip = ipaddress.ip_address(address)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def port_free(port: int) -> bool:
    """A TCP server can listen on ``port`` here, as torch's TCPStore binds it (every address,
    SO_REUSEADDR: a port in TIME_WAIT counts as free; one another process listens on does not)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True
