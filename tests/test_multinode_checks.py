"""What one machine checks of a launch across machines, before its workers start: HCCL_SOCKET_IFNAME
read with CANN's syntax against this machine's interfaces, HCCL_IF_IP against its addresses, the main
machine's rendezvous port, HCCL_CONNECT_TIMEOUT by job size, and the launch's shape from torch's
LaunchConfig. Fast: no launch (tests/contract/test_npu_contract.py and
tests/test_config_launch_configs.py launch)."""

from __future__ import annotations

import socket

import pytest

from accel_npu._torch import nodes
from accel_npu.plugins.devices.npu import multinode

#: a 910B node: two NICs named as on Atlas 800T A2 servers, a docker bridge, an unaddressed virtual device
NODE = {
    "lo": ["127.0.0.1"],
    "enp189s0f0": ["10.0.0.5"],
    "enp189s0f1": ["10.1.0.5"],
    "docker0": ["172.17.0.1"],
    "ifb0": [],
}


@pytest.mark.parametrize(
    "value,usable",
    [
        # CANN's HCCL_SOCKET_IFNAME forms (environment variable reference, envref_07_0075)
        ("enp", ["enp189s0f0", "enp189s0f1"]),
        ("enp,docker", ["enp189s0f0", "enp189s0f1", "docker0"]),
        ("=enp189s0f1", ["enp189s0f1"]),
        ("=enp189s0f", []),
        ("^enp,docker", ["lo", "ifb0"]),
        ("^=enp189s0f0", ["lo", "enp189s0f1", "docker0", "ifb0"]),
        ("eth", []),
    ],
)
def test_socket_ifname_is_read_with_cann_syntax(value, usable):
    assert nodes.usable_interfaces(value, list(NODE)) == usable
    assert (multinode.socket_ifname_problem(value, NODE) is None) == bool(usable)


def test_a_name_from_another_machine_gets_the_prefix_that_matches_both():
    # machine 0 calls it enp61s0f0, this one enp189s0f0: the exact name fails here, the prefix works on both
    problem = multinode.socket_ifname_problem("=enp61s0f0", NODE)
    assert problem.startswith("HCCL_SOCKET_IFNAME==enp61s0f0: no interface on this machine matches that exact name")
    assert "it has: lo 127.0.0.1, enp189s0f0 10.0.0.5, enp189s0f1 10.1.0.5, docker0 172.17.0.1, ifb0" in problem
    assert "e.g. HCCL_SOCKET_IFNAME=enp (enp189s0f0, enp189s0f1 here)" in problem
    # the suggested value works here and on machine 0
    assert multinode.socket_ifname_problem("enp", NODE) is None
    assert nodes.usable_interfaces("enp", ["lo", "enp61s0f0"]) == ["enp61s0f0"]
    # nothing in common: the addressed interface's stem, never the loopback or an unaddressed device
    assert "e.g. HCCL_SOCKET_IFNAME=enp)" in multinode.socket_ifname_problem(
        "ib", {"lo": ["127.0.0.1"], "ifb0": [], "enp1s0": ["10.0.0.5"]}
    )
    assert "names no interface" in multinode.socket_ifname_problem("^", NODE)
    assert "excludes every interface of this machine" in multinode.socket_ifname_problem("^enp,docker,lo,ifb", NODE)


def test_if_ip_must_be_an_address_of_this_machine():
    here = nodes.interface_addresses()
    # an independent look: the loopback is bindable, TEST-NET-3 (RFC 5737) is nobody's address
    assert nodes.is_local_address("127.0.0.1") and not nodes.is_local_address("203.0.113.7")
    assert multinode.if_ip_problem("127.0.0.1", here, nodes.is_local_address) is None
    problem = multinode.if_ip_problem("203.0.113.7", here, nodes.is_local_address)
    assert problem.startswith("HCCL_IF_IP=203.0.113.7 is not an address of this machine (it has: lo 127.0.0.1")
    assert "set it in each machine's own environment" in problem
    assert "is not an IP address" in multinode.if_ip_problem("node-a", here, nodes.is_local_address)


def test_interfaces_are_the_kernels():
    assert nodes.interface_names() == [name for _, name in socket.if_nameindex()]
    assert "127.0.0.1" in nodes.interface_addresses()["lo"]


@pytest.mark.parametrize(
    "world,seconds", [(2, 1200), (5000, 1200), (8333, 1200), (10000, 1500), (40000, 6900), (10**6, 7200)]
)
def test_connect_timeout_grows_with_the_job_past_the_default(world, seconds):
    # the HCCL test guide's two points (240 s at 3K cards, 600 s at 5K) lie on the line used
    assert multinode.connect_timeout_for(world) == seconds
    assert [240 + (n - 3000) * 360 // 2000 for n in (3000, 5000)] == [240, 600]


def test_the_main_machine_port_is_checked_only_where_the_store_is_hosted():
    from accel_npu.plugins.launch.launcher import main_port_problem

    held = socket.socket()
    held.bind(("", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        assert not nodes.port_free(port)
        main = nodes.Nodes(count=2, rank=0, world_size=2, master_addr="127.0.0.1", master_port=port)
        problem = main_port_problem(main)
        assert f"port {port} (--main_process_port, torchrun --master_port), and that port is already in use" in problem
        for fine in (
            nodes.Nodes(count=2, rank=1, world_size=2, master_port=port),  # a client only
            nodes.Nodes(count=1, rank=0, world_size=2, master_port=port),  # one machine: torch's own check
            nodes.Nodes(count=2, rank=None, world_size=2, master_port=port, rdzv_backend="c10d"),
        ):
            assert main_port_problem(fine) is None
    finally:
        held.close()
    assert nodes.port_free(port) and main_port_problem(main) is None


def test_the_launch_shape_comes_from_torchs_launch_config():
    from torch.distributed.launcher.api import LaunchConfig

    config = LaunchConfig(
        min_nodes=2,
        max_nodes=2,
        nproc_per_node=8,
        rdzv_backend="static",
        rdzv_endpoint="10.0.0.1:29500",
        rdzv_configs={"rank": 1},
    )
    assert nodes.nodes_of(config) == nodes.Nodes(
        count=2, rank=1, world_size=16, master_addr="10.0.0.1", master_port=29500, rdzv_backend="static"
    )
    elastic = LaunchConfig(
        min_nodes=1, max_nodes=4, nproc_per_node=2, rdzv_backend="c10d", rdzv_endpoint="[fd00::1]:29400"
    )
    shape = nodes.nodes_of(elastic)
    assert (shape.rank, shape.master_addr, shape.master_port, shape.hosts_the_store) == (None, "fd00::1", 29400, False)
