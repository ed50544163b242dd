"""Start one process per local GPU with ``jax.distributed``.

``python -m jax_tokenweave.launch -n 2 [options] -- python my_script.py args...``; the script
calls :func:`initialize` before touching JAX. Exits 0 when every rank does, else with the first
failing rank's code. Environment, ``--cpu``, ``--timeout`` and signals: docs/PACKAGE.md#launch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import takewhile
from pathlib import Path
from types import FrameType

PROG = "python -m jax_tokenweave.launch"
ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
KILL_GRACE_S = 5.0


def initialize(env: Mapping[str, str] | None = None) -> bool:
    """Call ``jax.distributed.initialize`` from the launcher's variables; call it first.

    Returns ``True`` when it initialized (or had before), ``False`` (a no-op: a single process)
    when none of
    ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` is set. Raises
    ``RuntimeError`` when only some are set or a number does not parse.
    """
    env = os.environ if env is None else env
    present = [k for k in ENV_VARS if env.get(k)]
    if not present:
        return False
    missing = [k for k in ENV_VARS if k not in present]
    if missing:
        raise RuntimeError(
            f"jax_tokenweave.launch.initialize: {', '.join(present)} set but "
            f"{', '.join(missing)} not; set all of {', '.join(ENV_VARS)} or none "
            f"(start the script with `{PROG} -n N -- ...`)"
        )
    try:
        num_processes = int(env["JAX_NUM_PROCESSES"])
        process_id = int(env["JAX_PROCESS_ID"])
        ids = env.get("JAX_LOCAL_DEVICE_IDS", "").strip()
        local_ids = [int(x) for x in ids.split(",")] if ids else None
    except ValueError as e:
        raise RuntimeError(f"jax_tokenweave.launch.initialize: bad launcher variable: {e}") from e
    import jax
    from jax._src import distributed

    if distributed.global_state.client is not None:  # already initialized (idempotent)
        return True
    jax.distributed.initialize(
        coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_ids,
        cluster_detection_method="deactivate",
    )
    return True


def visible_gpu_count(env: Mapping[str, str] | None = None) -> int | None:
    """GPUs a child would see, without importing JAX: from ``CUDA_VISIBLE_DEVICES`` when set
    (CUDA stops at the first invalid entry), else ``nvidia-smi -L``; ``None`` if unknown."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        valid = (e.strip() for e in visible.split(","))
        return sum(1 for _ in takewhile(lambda e: e.isdigit() or e[:4] in ("GPU-", "MIG-"), valid))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def child_env(
    base_env: Mapping[str, str],
    rank: int,
    nproc: int,
    port: int,
    devices_per_process: int = 1,
    cpu: bool = False,
) -> dict[str, str]:
    """The environment of rank ``rank``: ``base_env`` plus the ``jax.distributed`` variables.
    Everything else (``XLA_FLAGS``, ``NCCL_*``, ``CUDA_VISIBLE_DEVICES``, ...) passes through."""
    env = dict(base_env)
    env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
    env["JAX_NUM_PROCESSES"] = str(nproc)
    env["JAX_PROCESS_ID"] = str(rank)
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
        env.pop("JAX_LOCAL_DEVICE_IDS", None)
    else:
        first = rank * devices_per_process
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(first + d) for d in range(devices_per_process))
    return env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser."""
    p = argparse.ArgumentParser(
        prog=PROG, description="Start one process per local GPU with jax.distributed."
    )
    p.add_argument(
        "-n",
        "--nproc",
        required=True,
        metavar="N",
        type=_int_in(1),
        help="number of processes (at most the visible GPUs / devices per process)",
    )
    p.add_argument(
        "--port",
        metavar="PORT",
        type=_int_in(1, 65535),
        help="coordinator port on 127.0.0.1 (default: a free one)",
    )
    p.add_argument(
        "--devices-per-process",
        type=_int_in(1),
        default=1,
        metavar="D",
        help="GPUs per process (default 1; ignored with --cpu)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to wait for the others after a rank fails (default 30)",
    )
    p.add_argument(
        "--cpu", action="store_true", help="test mode: JAX_PLATFORMS=cpu, no GPU assignment"
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        metavar="DIR",
        help="write rank i's output to rank<i>.out / rank<i>.err here",
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the command each rank runs (after '--' or after the options)",
    )
    return p


def parse_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Parse and check the launcher's arguments (``parser.error`` on bad ones)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error(f"no command given: {PROG} -n N [options] -- python script.py ...")
    if args.timeout < 0:
        parser.error(f"--timeout must be >= 0, got {args.timeout}")
    if not args.cpu:
        gpus = visible_gpu_count(env)
        wanted = args.nproc * args.devices_per_process
        if gpus is not None and wanted > gpus:
            parser.error(
                f"{args.nproc} processes x {args.devices_per_process} device(s) need "
                f"{wanted} GPUs, only {gpus} visible (--cpu runs on the CPU)"
            )
    return args


def _say(message: str) -> None:
    print(f"[launch] {message}", file=sys.stderr, flush=True)


def _signal_all(procs: Sequence[subprocess.Popen], sig: int) -> None:
    """Send ``sig`` to each running child's process group (the child and what it started)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)


def _describe(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    return f"was killed by signal {-code} ({signal.strsignal(-code)})"


def run(args: argparse.Namespace) -> int:
    """Start the ranks, wait for them and return the launcher's exit code."""
    port = args.port or free_port()
    procs: list[subprocess.Popen] = []
    files = []
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    received: list[int] = []

    def forward(sig: int, _frame: FrameType | None) -> None:
        received.append(sig)
        _signal_all(procs, sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(args.nproc):
            if received:
                break
            out = err = None
            if args.log_dir is not None:
                out = open(args.log_dir / f"rank{rank}.out", "wb")  # noqa: SIM115
                err = open(args.log_dir / f"rank{rank}.err", "wb")  # noqa: SIM115
                files += [out, err]
            env = child_env(os.environ, rank, args.nproc, port, args.devices_per_process, args.cpu)
            # Own process group: a terminal's Ctrl-C reaches the ranks once, through us; no stdin
            # (a background group reading the terminal would stop).
            procs.append(
                subprocess.Popen(
                    args.command,
                    env=env,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    process_group=0,
                )
            )
        code = _wait(procs, args.timeout, received)
        return code or (128 + received[0] if len(procs) < args.nproc else 0)
    except OSError as e:
        _say(f"cannot start {args.command[0]!r}: {e}")
        return 127
    finally:
        _terminate(procs)
        for s, handler in old.items():
            signal.signal(s, handler)
        for f in files:
            f.close()


def _wait(procs: Sequence[subprocess.Popen], timeout: float, received: list[int]) -> int:
    failed: tuple[int, int] | None = None
    deadline: float | None = None
    while True:
        running = []
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code is None:
                running.append(rank)
            elif code != 0 and failed is None:
                failed = (rank, code)
                _say(f"rank {rank} {_describe(code)}")
        if not running:
            break
        if deadline is None and (failed is not None or received):
            deadline = time.monotonic() + timeout
            why = "a rank failed" if failed else f"got {signal.Signals(received[0]).name}"
            _say(f"{why}; waiting up to {timeout:g} s for rank(s) {running}")
        if deadline is not None and time.monotonic() >= deadline:
            _say(f"{timeout:g} s passed: terminating rank(s) {running}")
            _terminate(procs)
            continue
        time.sleep(0.05)
    return 0 if failed is None else (128 - failed[1] if failed[1] < 0 else failed[1])


def _terminate(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM the running ranks, SIGKILL them after ``KILL_GRACE_S``, and reap them all."""
    _signal_all(procs, signal.SIGTERM)
    end = time.monotonic() + KILL_GRACE_S
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, end - time.monotonic()))
    if any(p.poll() is None for p in procs):
        _say("ranks still running after SIGTERM: sending SIGKILL")
        _signal_all(procs, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
