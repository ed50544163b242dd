"""``python -m jax_tokenweave.launch``: arguments, each rank's environment, ``initialize()``, and
real multi-process runs on the CPU (a ``jax.distributed`` key-value exchange, a failing rank, a
forwarded signal)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jax_tokenweave import launch

LAUNCH = [sys.executable, "-m", "jax_tokenweave.launch"]
FOUR_GPUS = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}


def parse_error(capsys, argv: list[str], env: dict | None = None) -> str:
    with pytest.raises(SystemExit) as info:
        launch.parse_args(argv, env=FOUR_GPUS if env is None else env)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_defaults_and_command_after_double_dash():
    args = launch.parse_args(["-n", "2", "--", "python", "s.py", "--port", "1"], env=FOUR_GPUS)
    assert (args.nproc, args.port, args.devices_per_process, args.timeout) == (2, None, 1, 30.0)
    assert not args.cpu and args.log_dir is None
    assert args.command == ["python", "s.py", "--port", "1"]


def test_command_without_double_dash_keeps_its_own_options():
    args = launch.parse_args(
        [
            "--nproc",
            "4",
            "--port",
            "1234",
            "--timeout",
            "2.5",
            "--cpu",
            "python",
            "s.py",
            "-n",
            "7",
            "--",
            "x",
        ],
        env=FOUR_GPUS,
    )
    assert (args.nproc, args.port, args.timeout, args.cpu) == (4, 1234, 2.5, True)
    assert args.command == ["python", "s.py", "-n", "7", "--", "x"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "0", "--", "x"], "must be an integer >= 1"),
        (["-n", "two", "x"], "must be an integer >= 1"),
        (["--", "python", "s.py"], "required: -n/--nproc"),
        (["-n", "2"], "no command given"),
        (["-n", "2", "--"], "no command given"),
        (["-n", "1", "--port", "0", "x"], "--port: must be an integer from 1 to 65535"),
        (["-n", "1", "--port", "70000", "x"], "--port: must be an integer from 1 to 65535"),
        (["-n", "1", "--port", "http", "x"], "--port: must be an integer from 1 to 65535"),
        (["-n", "1", "--devices-per-process", "0", "x"], "--devices-per-process: must be"),
        (["-n", "1", "--timeout", "-1", "x"], "--timeout must be >= 0"),
        (["-n", "5", "x"], "need 5 GPUs, only 4 visible"),
        (["-n", "3", "--devices-per-process", "2", "x"], "need 6 GPUs, only 4 visible"),
    ],
)
def test_argument_errors(capsys, argv, message):
    assert message in parse_error(capsys, argv)


def test_gpu_count_is_not_checked_with_cpu_or_when_unknown(monkeypatch):
    assert launch.parse_args(["-n", "16", "--cpu", "x"], env={"CUDA_VISIBLE_DEVICES": ""}).cpu
    monkeypatch.setattr(launch, "visible_gpu_count", lambda env=None: None)
    assert launch.parse_args(["-n", "16", "x"]).nproc == 16


@pytest.mark.parametrize(
    ("visible", "count"),
    [("0,1,2", 3), ("", 0), ("3", 1), ("0,-1,2", 1), ("GPU-1a2b,MIG-3c4d", 2), (" 1, 0", 2)],
)
def test_visible_gpus_from_cuda_visible_devices(visible, count):
    assert launch.visible_gpu_count({"CUDA_VISIBLE_DEVICES": visible}) == count


def test_visible_gpus_from_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert launch.visible_gpu_count({}) is None  # no nvidia-smi: not checked
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\n"
        "echo '  MIG 1g.18gb Device 0: (UUID: MIG-b)'\necho 'GPU 1: NVIDIA H200'\n"
    )
    smi.chmod(0o755)
    assert launch.visible_gpu_count({}) == 2
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert launch.visible_gpu_count({}) is None


def test_child_env_on_gpus_passes_everything_else_through():
    base = {
        "PATH": "/bin",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "XLA_FLAGS": "--xla_dump_to=/tmp/x",
        "JAX_PROCESS_ID": "9",
    }
    env = launch.child_env(base, rank=1, nproc=2, port=4321, devices_per_process=2, cpu=False)
    assert env == {
        **base,
        "JAX_COORDINATOR_ADDRESS": "127.0.0.1:4321",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": "1",
        "JAX_LOCAL_DEVICE_IDS": "2,3",
    }
    assert base["JAX_PROCESS_ID"] == "9"  # the launcher's own environment is not changed
    assert [launch.child_env({}, r, 3, 1)["JAX_LOCAL_DEVICE_IDS"] for r in range(3)] == [
        "0",
        "1",
        "2",
    ]


def test_child_env_on_cpu():
    base = {"JAX_LOCAL_DEVICE_IDS": "5", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    env = launch.child_env(base, rank=0, nproc=2, port=1, devices_per_process=4, cpu=True)
    assert env == {
        "XLA_FLAGS": base["XLA_FLAGS"],
        "JAX_PLATFORMS": "cpu",
        "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": "0",
    }


def test_free_port_is_bindable():
    assert 0 < launch.free_port() < 65536


def test_initialize_is_a_noop_without_the_variables(monkeypatch):
    for name in launch.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    assert launch.initialize() is False
    assert launch.initialize({"JAX_LOCAL_DEVICE_IDS": "0"}) is False


@pytest.mark.parametrize(
    "env",
    [
        {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"},
        {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
    ],
)
def test_initialize_refuses_a_partial_setting(env):
    with pytest.raises(RuntimeError, match=r"set but .*JAX_.* not"):
        launch.initialize(env)


def test_initialize_passes_the_variables_to_jax(monkeypatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    env = launch.child_env({}, rank=1, nproc=2, port=77, devices_per_process=2)
    assert launch.initialize(env) is True
    assert launch.initialize(launch.child_env({}, 0, 2, 77, cpu=True)) is True
    common = {
        "coordinator_address": "127.0.0.1:77",
        "num_processes": 2,
        "cluster_detection_method": "deactivate",
    }
    assert calls == [
        {**common, "process_id": 1, "local_device_ids": [2, 3]},
        {**common, "process_id": 0, "local_device_ids": None},
    ]
    with pytest.raises(RuntimeError, match="bad launcher variable"):
        launch.initialize({**env, "JAX_NUM_PROCESSES": "two"})


def run_launcher(
    args: list[str], timeout: float = 120
) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([*LAUNCH, *args], capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - start


@pytest.mark.slow
def test_two_cpu_processes_exchange_a_value(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from jax_tokenweave.launch import initialize
        assert sys.stdin.read() == ""  # ranks read no stdin
        assert initialize() is True
        import jax
        from jax._src.distributed import global_state
        rank, count = jax.process_index(), jax.process_count()
        assert jax.devices()[0].platform == "cpu"
        assert jax.device_count() == count * jax.local_device_count()
        global_state.client.key_value_set(f"value/{rank}", f"from-{rank}")
        got = global_state.client.blocking_key_value_get(f"value/{(rank + 1) % count}", 30_000)
        print(f"rank {rank} of {count} got {got}", flush=True)
    """)
    )
    logs = tmp_path / "logs"
    result, _ = run_launcher(
        [
            "-n",
            "2",
            "--cpu",
            "--timeout",
            "10",
            "--log-dir",
            str(logs),
            "--",
            sys.executable,
            str(script),
        ]
    )
    out = {r: (logs / f"rank{r}.out").read_text() for r in range(2)}
    err = {r: (logs / f"rank{r}.err").read_text() for r in range(2)}
    assert result.returncode == 0, (result.stderr, err)
    assert out == {0: "rank 0 of 2 got from-1\n", 1: "rank 1 of 2 got from-0\n"}, err


@pytest.mark.slow
def test_a_failing_rank_stops_the_others(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, sys, time
        rank = int(os.environ["JAX_PROCESS_ID"])
        if rank == 1:
            time.sleep(0.5)
            sys.exit(3)
        def on_term(sig, frame):
            open({str(tmp_path / "terminated")!r}, "w").write(str(os.getpid()))
            sys.exit(143)
        signal.signal(signal.SIGTERM, on_term)
        time.sleep(60)
    """)
    )
    result, elapsed = run_launcher(
        ["-n", "2", "--cpu", "--timeout", "2", sys.executable, str(script)], timeout=60
    )
    assert result.returncode == 3, result.stderr
    assert "rank 1 exited with code 3" in result.stderr
    assert "terminating rank(s) [0]" in result.stderr
    assert 2 <= elapsed < 2 + launch.KILL_GRACE_S + 10
    pid = int((tmp_path / "terminated").read_text())
    with pytest.raises(ProcessLookupError):  # reaped: no zombie left
        os.kill(pid, 0)


def test_signals_are_forwarded_to_every_rank(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, sys, time
        rank = os.environ["JAX_PROCESS_ID"]
        def on_int(sig, frame):
            open(os.path.join({str(tmp_path)!r}, "got" + rank), "w").close()
            sys.exit(5)
        signal.signal(signal.SIGINT, on_int)
        open(os.path.join({str(tmp_path)!r}, "ready" + rank), "w").close()
        time.sleep(60)
    """)
    )
    proc = subprocess.Popen(
        [*LAUNCH, "-n", "2", "--cpu", "--", sys.executable, str(script)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 5, stderr
    assert (tmp_path / "got0").exists() and (tmp_path / "got1").exists()


def test_a_missing_command_fails_like_a_shell():
    result, _ = run_launcher(["-n", "2", "--cpu", "--", "jax-tokenweave-no-such-command"])
    assert result.returncode == 127
    assert "cannot start 'jax-tokenweave-no-such-command'" in result.stderr


def test_module_runs_as_documented():
    result, _ = run_launcher(["--help"])
    assert result.returncode == 0 and result.stdout.startswith(f"usage: {launch.PROG}")
    assert Path(launch.__file__).name == "launch.py"


@pytest.mark.slow
def test_the_main_job_runs_one_process_per_device(tmp_path):
    """``python -m jax_tokenweave.bench`` under the launcher: two CPU processes (XLA's
    collectives over gloo) build the same model; the first one alone prints and writes."""
    env = dict(os.environ, JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    env.pop("XLA_FLAGS", None)  # one CPU device per process, as one GPU each
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            *LAUNCH,
            "-n",
            "2",
            "--cpu",
            "--timeout",
            "10",
            "--",
            sys.executable,
            "-m",
            "jax_tokenweave.bench",
            "--model",
            "tiny",
            "--tp",
            "2",
            "--tokens",
            "64",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--no-progress",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("wrote ") == 1 and result.stdout.count("speedup = ") == 1
    report = json.loads(out.read_text())
    assert [r["tokens"] for r in report["results"]] == [64]
