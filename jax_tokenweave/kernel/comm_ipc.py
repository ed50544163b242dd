"""A communicator across processes: one process per GPU under ``jax.distributed``.

Workspaces are exported CUDA memory whose file descriptors travel over Unix sockets (one host).
Rules: :func:`layout_reason`, :func:`host_reason`; every process builds its communicators in the
same order. ``direct`` never crosses processes. Protocol and failures:
docs/KERNEL.md#kernelcomm_ipc.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

_sequence = itertools.count()
_sequence_lock = threading.Lock()


class _Device(Protocol):
    id: int
    process_index: int


def own_groups(groups: Sequence[Sequence[_Device]], process: int) -> list[Sequence[_Device]]:
    """The groups (devices along the axis) that hold a device of ``process``."""
    return [g for g in groups if any(d.process_index == process for d in g)]


def peers_elsewhere(groups: Sequence[Sequence[_Device]], process: int) -> list[_Device]:
    """The devices of other processes in ``process``'s groups: the workspaces it must map."""
    return [d for g in own_groups(groups, process) for d in g if d.process_index != process]


def layout_reason(groups: Sequence[Sequence[_Device]], process: int) -> str | None:
    """None where the groups (devices along the axis) suit a cross-process communicator seen
    from ``process``; else why not. Pure: no communication."""
    if not own_groups(groups, process):
        return f"process {process} holds no device of the axis"
    for g in groups:
        local = sum(d.process_index == process for d in g)
        if 1 < local < len(g):
            return (
                "a group along the axis mixes devices of this process with devices of other "
                "processes; run one process per GPU (python -m jax_tokenweave.launch) or one "
                "process for the whole group"
            )
    return None


def host_reason(
    groups: Sequence[Sequence[_Device]],
    process: int,
    info: dict[int, dict],
    can_access_peer: Callable[[int, int], bool],
) -> str | None:
    """None where every group with a device of ``process`` lies on one host, its devices peers
    of each other; else why not. ``info[p]`` is what process p published: ``host`` and
    ``ordinals`` (device id -> CUDA ordinal)."""
    for g in own_groups(groups, process):
        hosts = {info[d.process_index]["host"] for d in g}
        if len(hosts) > 1:
            return (
                f"the axis spans hosts ({', '.join(sorted(hosts))}); the fused kernel works "
                "within one host, so XLA's collectives (NCCL) carry this axis"
            )
        ords = [info[d.process_index]["ordinals"][str(d.id)] for d in g]
        for a, b in itertools.permutations(ords, 2):
            if a != b and not can_access_peer(a, b):
                return f"CUDA devices {a} and {b} are not peers (no P2P/NVLink access)"
    return None


def host_name() -> str:
    """This machine, as processes of one host agree on it (hostname and boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


class Exchange:
    """The key-value store namespace of one communicator (the n-th built in each process)."""

    def __init__(self, client: Any | None = None):
        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
        if client is None:
            raise RuntimeError(
                "jax.distributed is not initialized: call "
                "jax_tokenweave.launch.initialize() (or jax.distributed."
                "initialize()) first"
            )
        self.client = client
        with _sequence_lock:
            self.prefix = f"jax_tokenweave/comm{next(_sequence)}"

    def put(self, process: int, name: str, value: Any) -> None:
        self.client.key_value_set(f"{self.prefix}/{process}/{name}", json.dumps(value))

    def get(self, process: int, name: str, timeout_s: float) -> Any:
        try:
            raw = self.client.blocking_key_value_get(
                f"{self.prefix}/{process}/{name}", int(timeout_s * 1000)
            )
        except Exception as err:  # the store says "deadline exceeded" in its own words
            raise RuntimeError(
                f"jax-tokenweave: process {process} did not publish {name!r} "
                f"within {timeout_s} s ({err}); did every process build the "
                "same communicators in the same order?"
            ) from err
        return json.loads(raw)


def publish_and_gather(
    exchange: Exchange,
    groups: Sequence[Sequence[_Device]],
    process: int,
    local_ordinals: dict[int, int],
    timeout_s: float,
) -> dict[int, dict]:
    """Publishes this process's host and device ordinals; returns every process's (of the
    groups this process is in)."""
    exchange.put(
        process,
        "info",
        {"host": host_name(), "ordinals": {str(k): v for k, v in local_ordinals.items()}},
    )
    procs = {d.process_index for g in own_groups(groups, process) for d in g}
    return {p: exchange.get(p, "info", timeout_s) for p in sorted(procs)}


def connect(
    ext: Any,
    comm_id: int,
    groups: Sequence[Sequence[_Device]],
    process: int,
    exchange: Exchange,
    timeout_s: float,
) -> None:
    """Maps every peer's workspace into this process's comm ``comm_id``: serves this process's
    workspaces on a Unix socket (descriptors sent with SCM_RIGHTS) and fetches the peers'."""
    flat = [d for g in groups for d in g]
    index = {d.id: i for i, d in enumerate(flat)}
    wanted = peers_elsewhere(groups, process)
    served = len(wanted)  # each of those devices' processes maps this process's one in its group
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"\0jax_tokenweave-{uuid.uuid4().hex}"
    server.bind(address)
    server.listen(max(1, served))
    server.settimeout(timeout_s)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            for _ in range(served):
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(timeout_s)
                    want = int(conn.recv(64).decode())
                    fd, nbytes = ext.export_workspace(comm_id, want)
                    try:
                        socket.send_fds(conn, [str(nbytes).encode()], [fd])
                    finally:
                        os.close(fd)
        except BaseException as err:  # reported by the caller
            errors.append(err)

    thread = threading.Thread(target=serve, name="jax-tokenweave-ipc", daemon=True)
    thread.start()
    exchange.put(process, "socket", address[1:])
    try:
        for d in wanted:
            peer = "\0" + exchange.get(d.process_index, "socket", timeout_s)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(peer)
                s.sendall(str(index[d.id]).encode())
                msg, fds, _, _ = socket.recv_fds(s, 64, 1)
                if len(fds) != 1:
                    raise RuntimeError(
                        f"jax-tokenweave: process {d.process_index} sent no "
                        f"workspace for device {d.id}"
                    )
                ext.import_workspace(comm_id, index[d.id], fds[0], int(msg.decode()))
        thread.join(timeout_s)
    finally:
        server.close()
    if errors:
        raise RuntimeError(
            f"jax-tokenweave: serving this process's workspace to its peers failed: {errors[0]}"
        ) from errors[0]
    if thread.is_alive() or not ext.comm_ready(comm_id):
        raise RuntimeError(
            f"jax-tokenweave: the communicator's peers did not all connect within {timeout_s} s"
        )
