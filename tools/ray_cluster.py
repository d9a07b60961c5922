"""A Ray cluster of separate processes on this machine: a head and worker nodes started with `ray start`, as they
are started on many machines, and a node killed or restarted at will (``LocalCluster``).

Every node gets ports of its own (picked free, below the kernel's ephemeral range), the cluster a temp dir and an
auth token of its own, so that it never meets another Ray instance on the machine; each node runs in a process group
of its own, and its raylet starts the workers (each in a session of its own) as its children, so that killing a node
is killing its group and their descendants (raylet, agents and workers at once, as a machine that fails; Linux's
/proc tells who descends from whom) and stopping the cluster touches nothing it did not start. The commands it ran
are kept (``commands``), as docs/serving.md shows them.

The nodes' processes import this checkout's specdeploy (PYTHONPATH), and Ray's HTTP proxy is told to answer the
clients of a replica that was lost (``specdeploy.serve.ray_proxy``). The GCS checks its nodes every half second and
declares one dead after three missed checks, so that a killed node is noticed within seconds, not Ray's 15 s.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdeploy.serve.ray_proxy import CALLBACK, CALLBACK_VARIABLE

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
# the GCS's checks of its nodes (Ray's defaults: every 3 s, dead after 5 missed)
HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
          "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}

LOG_LINES = 20  # of a failed `ray start`'s log, in its error (the log is removed with the cluster)
WORKER_PORTS = 64  # a node's range of ports for its worker processes (--min/max-worker-port)


@dataclass
class Node:
    """One node: its name, the `ray start` command that started it, its process group and its ports."""

    name: str
    command: list[str]
    group: int | None = None
    ports: dict[str, int] = field(default_factory=dict)


class LocalCluster:
    """A head node and workers on this machine, ``cpus`` CPUs each, under ``root`` (its temp dir, token and logs);
    ``paths``: more directories its processes import from (before this checkout); ``variables``: more environment
    variables of its processes. ``start()`` starts the head;
    ``add_worker()`` a worker; ``kill(node)`` kills one; ``stop()`` every process it started. A context manager: the
    block's end stops it, whatever happened in it."""

    def __init__(self, root: Path, cpus: float = 1, object_store_bytes: int = 80 * 2**20, paths: tuple[str, ...] = (),
                 variables: dict[str, str] | None = None):
        self.root = Path(root)
        self.cpus, self.object_store_bytes, self.paths = cpus, object_store_bytes, paths
        self.variables = dict(variables or {})
        self.nodes: list[Node] = []
        self.commands: list[str] = []  # as run, for people (docs/serving.md)
        self.port = 0  # the head's GCS port, once started

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment of every node and of a driver: token auth with this cluster's own token, no usage stats,
        this checkout's specdeploy, the proxy's answer to lost replicas, quick node health checks."""
        path = os.pathsep.join(p for p in (*self.paths, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.root / "token"),
                "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": path, CALLBACK_VARIABLE: CALLBACK, **HEALTH,
                **self.variables}

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Node:
        """Start the head node (its GCS, dashboard's API and raylet); returns it."""
        self.root.mkdir(parents=True, exist_ok=True)
        token = self.root / "token"
        if not token.exists():
            token.write_text(secrets.token_hex(32))
            token.chmod(0o600)
        ports = _free_ports("port", "node-manager-port", "object-manager-port", "dashboard-port", "dashboard-agent-listen-port",
                            "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
                            "ray-client-server-port", "min-worker-port", workers=WORKER_PORTS)
        self.port = ports["port"]
        node = self._node("head", ["--head", "--include-dashboard", "false", "--temp-dir", str(self.root / "ray")], ports)
        return self._run(node)

    def add_worker(self) -> Node:
        """Start a worker node that joins the head; returns it."""
        ports = _free_ports("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                            "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
                            "min-worker-port", workers=WORKER_PORTS)
        node = self._node(f"worker-{len(self.nodes)}", ["--address", self.address], ports)
        return self._run(node)

    def restart(self, node: Node) -> Node:
        """Start a killed node again, as it was (new ports: its old ones may linger in TIME_WAIT)."""
        self.nodes.remove(node)
        return self.add_worker() if node.name != "head" else self.start()

    def node_id(self, node: Node) -> str:
        """``node``'s Ray node id (hex), as its raylet was started with it ("" if its raylet is not running)."""
        for pid in _processes(node.group):
            try:
                arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            for argument in arguments:
                if argument.startswith(b"--node_id=") and b"raylet" in arguments[0]:
                    return argument.split(b"=", 1)[1].decode()
        return ""

    def kill(self, node: Node) -> None:
        """Kill every process of ``node`` at once (SIGKILL): the node fails, it does not stop."""
        _signal(_processes(node.group), signal.SIGKILL)
        node.group = None

    def stop(self) -> None:
        """Stop every node it started (workers first): SIGTERM to their processes, SIGKILL to those left after 5 s."""
        for node in reversed(self.nodes):
            _signal(_processes(node.group), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while any(_processes(node.group) for node in self.nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
        for node in reversed(self.nodes):
            self.kill(node)

    def _node(self, name: str, role: list[str], ports: dict[str, int]) -> Node:
        command = [RAY, "start", *role, "--node-ip-address", "127.0.0.1", "--num-cpus", f"{self.cpus:g}",
                   "--object-store-memory", str(self.object_store_bytes), "--disable-usage-stats",
                   *[part for option, port in ports.items() for part in (f"--{option}", str(port))],
                   "--max-worker-port", str(ports["min-worker-port"] + WORKER_PORTS - 1)]
        return Node(name, command, ports=ports)

    def _run(self, node: Node, timeout: float = 180) -> Node:
        """Run ``ray start`` in a new session (its daemons keep its process group) and wait until it has started."""
        log = (self.root / f"{node.name}.log").open("ab")
        process = subprocess.Popen(node.command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        node.group = process.pid
        self.nodes.append(node)
        self.commands.append(" ".join(["ray", *node.command[1:]]))
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = None
        if status != 0:  # the log goes with the cluster's files: its last lines go in the message
            path = self.root / f"{node.name}.log"
            tail = path.read_text(errors="replace").strip().splitlines()[-LOG_LINES:] if path.is_file() else []
            raise RuntimeError(f"{node.name}: `ray start` {'timed out' if status is None else f'exited {status}'}; "
                               f"its log ({path}) ends:\n" + "\n".join(tail))
        return node

    def clean(self) -> None:
        """Remove the cluster's files (temp dir, logs, token)."""
        shutil.rmtree(self.root, ignore_errors=True)


def _free_ports(*names: str, workers: int = 1) -> dict[str, int]:
    """A port free now for each name, consecutive, the last name's ``workers`` wide (Ray's worker range), from a
    random start below the kernel's ephemeral range: a port there is never handed to another process's outgoing
    connection between this probe and Ray's bind (under a parallel test run, other clients connect all the time), as a
    port the kernel chose (bind to 0) or one inside its range may be. From 20000 up: Ray's own default worker range,
    10002-19999, is every local cluster's."""
    count = len(names) - 1 + workers
    low, high = 20000, _ephemeral_start() - count
    if high <= low:
        raise RuntimeError(f"no room for {count} ports between 20000 and the ephemeral range's start "
                           f"({_ephemeral_start()}, /proc/sys/net/ipv4/ip_local_port_range)")
    for _ in range(100):
        first = low + secrets.randbelow(high - low)
        probes = []
        try:
            for port in range(first, first + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return {name: first + i for i, name in enumerate(names)}
    raise RuntimeError(f"no {count} consecutive free ports found below the ephemeral range")


def _ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _processes(group: int | None) -> list[int]:
    """The live processes of process group ``group`` and all their descendants (None: none)."""
    if group is None:
        return []
    parents: dict[int, int] = {}
    groups: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # "pid (name) state ppid pgrp ...": the name may hold spaces and parentheses
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] == "Z":
            continue  # a zombie is dead already
        parents[int(entry.name)], groups[int(entry.name)] = int(fields[1]), int(fields[2])
    found = {pid for pid, pgrp in groups.items() if pgrp == group}
    grown = True
    while grown:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grown = bool(more)
    return sorted(found)


def _signal(pids: list[int], signal_: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal_)
        except ProcessLookupError:
            pass
