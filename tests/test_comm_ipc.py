"""The rules for a communicator across processes (no GPU needed): which device layouts suit
one, and which hosts and peers it accepts."""

from __future__ import annotations

from types import SimpleNamespace

from jax_tokenweave.kernel import comm_ipc


def _devs(processes: list[int], first_id: int = 0) -> list[SimpleNamespace]:
    return [SimpleNamespace(id=first_id + i, process_index=p) for i, p in enumerate(processes)]


def test_one_device_per_process_suits():
    groups = [_devs([0, 1, 2, 3])]
    assert all(comm_ipc.layout_reason(groups, p) is None for p in range(4))


def test_a_group_inside_one_process_suits_and_mixed_groups_do_not():
    # 2 processes x 2 GPUs: tp groups inside a process are fine (data x tp mesh)...
    assert comm_ipc.layout_reason([_devs([0, 0]), _devs([1, 1], 2)], 0) is None
    # ...a tp group of 4 over 2 processes with 2 GPUs each is not
    why = comm_ipc.layout_reason([_devs([0, 0, 1, 1])], 0)
    assert why is not None and "one process per GPU" in why


def test_a_process_without_devices_of_the_axis():
    assert "holds no device" in comm_ipc.layout_reason([_devs([0, 1])], 2)


def _info(hosts: dict[int, str], ordinals: dict[int, dict[int, int]]) -> dict[int, dict]:
    return {
        p: {"host": h, "ordinals": {str(k): v for k, v in ordinals[p].items()}}
        for p, h in hosts.items()
    }


def test_hosts_and_peers():
    groups = [_devs([0, 1])]
    info = _info({0: "a", 1: "a"}, {0: {0: 0}, 1: {1: 1}})
    assert comm_ipc.host_reason(groups, 0, info, lambda a, b: True) is None
    why = comm_ipc.host_reason(groups, 0, info, lambda a, b: False)
    assert "not peers" in why
    spans = comm_ipc.host_reason(
        groups, 0, _info({0: "a", 1: "b"}, {0: {0: 0}, 1: {1: 0}}), lambda a, b: True
    )
    assert "spans hosts" in spans and "NCCL" in spans


def test_groups_without_this_process_are_not_checked():
    # data x tp over two hosts, tp inside each host: process 0 only looks at its own group
    groups = [_devs([0, 1]), _devs([2, 3], 2)]
    info = _info({0: "a", 1: "a", 2: "b", 3: "b"}, {0: {0: 0}, 1: {1: 1}, 2: {2: 0}, 3: {3: 1}})
    assert comm_ipc.host_reason(groups, 0, info, lambda a, b: True) is None
    assert comm_ipc.host_reason(groups, 3, info, lambda a, b: True) is None


def test_the_same_gpu_in_two_processes_needs_no_peer_access():
    info = _info({0: "a", 1: "a"}, {0: {0: 0}, 1: {1: 0}})
    assert comm_ipc.host_reason([_devs([0, 1])], 1, info, lambda a, b: False) is None


class _Store:
    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value):
        self.kv[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.kv:
            raise TimeoutError("DEADLINE_EXCEEDED")
        return self.kv[key]


def test_exchange_namespaces_and_a_missing_process():
    store = _Store()
    a, b = comm_ipc.Exchange(store), comm_ipc.Exchange(store)
    assert a.prefix != b.prefix  # one namespace per communicator
    a.put(0, "info", {"host": "h"})
    assert a.get(0, "info", 1.0) == {"host": "h"}
    try:
        b.get(1, "info", 0.01)
    except RuntimeError as err:
        assert "process 1" in str(err) and "same order" in str(err)
    else:
        raise AssertionError("a missing process must raise")


class _BlockingStore:
    """The distributed key-value store, for threads standing in for processes."""

    def __init__(self):
        import threading

        self.kv: dict[str, str] = {}
        self.cond = threading.Condition()

    def key_value_set(self, key, value):
        with self.cond:
            self.kv[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.kv, timeout_ms / 1000):
                raise TimeoutError("DEADLINE_EXCEEDED")
            return self.kv[key]


class _FakeExt:
    """Workspaces as temporary files: exporting opens one, importing records which file the
    received descriptor refers to."""

    def __init__(self, files: dict[int, str], wanted: int):
        self.files, self.wanted, self.imported = files, wanted, {}

    def export_workspace(self, comm_id, index):
        import os

        return os.open(self.files[index], os.O_RDONLY), 1000 + index

    def import_workspace(self, comm_id, index, fd, nbytes):
        import os

        self.imported[index] = (os.fstat(fd).st_ino, nbytes)
        os.close(fd)

    def comm_ready(self, comm_id):
        return len(self.imported) == self.wanted


def test_connect_passes_workspace_descriptors_between_processes(tmp_path):
    """Three 'processes' (threads), one device each in one group: each serves its workspace on a
    Unix socket and maps the other two from the descriptors it receives."""
    import os
    import threading

    files = {}
    for i in range(3):
        files[i] = str(tmp_path / f"ws{i}")
        open(files[i], "w").close()
    groups = [_devs([0, 1, 2])]
    exchange = comm_ipc.Exchange(_BlockingStore())
    exts = {p: _FakeExt(files, wanted=2) for p in range(3)}
    errors = []

    def run(p):
        try:
            comm_ipc.connect(exts[p], 7, groups, p, exchange, timeout_s=20.0)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(p,)) for p in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for p, ext in exts.items():
        want = {i: (os.stat(files[i]).st_ino, 1000 + i) for i in range(3) if i != p}
        assert ext.imported == want, (p, ext.imported)


def test_connect_fails_in_bounded_time_when_a_peer_never_comes(tmp_path):
    open(tmp_path / "ws0", "w").close()
    ext = _FakeExt({0: str(tmp_path / "ws0")}, wanted=1)
    exchange = comm_ipc.Exchange(_BlockingStore())
    try:
        comm_ipc.connect(ext, 7, [_devs([0, 1])], 0, exchange, timeout_s=0.5)
    except RuntimeError as err:
        assert "process 1" in str(err)
    else:
        raise AssertionError("connect must fail without its peer")
