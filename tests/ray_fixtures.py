"""One local Ray cluster per test session (two 1-CPU loopback nodes), shared by the Ray tests.

Defined outside the test modules so every module that needs Ray gets the same cluster:
Ray starts once per session (docs/scaling.md; CI keeps its time budget).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest


def agent_ports() -> dict[str, int]:
    """Fixed ports for a node's agents: with them the raylet need not wait for the agents to
    write their chosen ports to files, which times out on a loaded machine."""
    names = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")
    sockets = [socket.socket() for _ in names]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return {name: s.getsockname()[1] for name, s in zip(names, sockets, strict=True)}
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """Two 1-CPU Ray nodes on this machine (2 CPUs in all), started once per session."""
    if os.environ.get("CI") == "true":
        import ray  # under CI the extra must be there: an ImportError fails the run
    else:
        ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # A loaded CI machine starts Ray's per-node agent slowly: give it time, not a crash.
    patience = {"raylet_start_wait_time_s": 180, "agent_register_timeout_ms": 180_000}
    for name, value in patience.items():
        os.environ.setdefault(f"RAY_{name}", str(value))
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "include_dashboard": False,
                "_system_config": patience,
                **agent_ports(),
            },
        )
        cluster.add_node(num_cpus=1, **agent_ports())
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
    except Exception as exc:
        if cluster is not None:
            cluster.shutdown()
        if os.environ.get("CI") == "true":  # never skipped under CI
            raise
        pytest.skip(f"a local Ray cluster could not start on this machine: {exc}")
    yield cluster
    ray.shutdown()
    cluster.shutdown()
