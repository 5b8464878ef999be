"""A real two-node Ray cluster on one machine, started as docs/cluster.md starts one under SLURM (``ray start
--head``, then ``ray start --address`` on another node with its own ports and a custom resource): rollout workers
that ask for the resource are placed on the second node, and ``workers.address`` joins the running cluster."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ais_lightning.rollout.ray_workers import RayWorkers
from tests.ray.helpers import ray, tiny_parts

pytestmark = pytest.mark.slow

RAY_CLI = Path(sys.executable).parent / "ray"


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _start(args: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(
        [str(RAY_CLI), "start", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (
        f"ray start {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    )


def _stop(marker: str) -> None:
    """Kill the processes of this test's cluster only (their command lines name its temp dir)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass


def test_workers_are_placed_on_the_node_that_has_their_resource():
    temp = tempfile.mkdtemp(
        prefix="ray", dir="/tmp"
    )  # every process of this cluster names it (and Ray's unix
    # socket paths under it must stay below 108 bytes, which a pytest tmp_path does not)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    gcs, *ports = _free_ports(9)
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats", f"--temp-dir={temp}"]
    try:
        _start(
            [
                "--head",
                f"--port={gcs}",
                "--include-dashboard=false",
                '--resources={"trainer": 1}',
                f"--node-manager-port={ports[0]}",
                f"--object-manager-port={ports[1]}",
                f"--dashboard-agent-listen-port={ports[2]}",
                f"--metrics-export-port={ports[3]}",
                *common,
            ],
            env,
        )
        _start(
            [
                f"--address=127.0.0.1:{gcs}",
                '--resources={"rollout": 1}',
                f"--node-manager-port={ports[4]}",
                f"--object-manager-port={ports[5]}",
                f"--dashboard-agent-listen-port={ports[6]}",
                f"--metrics-export-port={ports[7]}",
                *common,
            ],
            env,
        )
        os.environ["RAY_AUTH_MODE"] = "disabled"
        model, factory, weights = tiny_parts()
        local = factory(model)
        workers = RayWorkers(address=f"127.0.0.1:{gcs}", resources={"rollout": 1}, threads=1, timeout_s=300)
        source = workers.build_source(local, factory, model, version=0, named_tensors=weights, bound=0)
        try:
            nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
            assert len(nodes) == 2
            assert "rollout" in nodes[source.where[0][1]] and "trainer" not in nodes[source.where[0][1]]
        finally:
            source.close()  # disconnects: the cluster it joined keeps running
        assert not ray.is_initialized()
        ray.init(address=f"127.0.0.1:{gcs}")
        try:
            assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        finally:
            ray.shutdown()
    finally:
        os.environ.pop("RAY_AUTH_MODE", None)
        _stop(temp)
        shutil.rmtree(temp, ignore_errors=True)
