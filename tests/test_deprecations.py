"""Old names keep working for one release (``jax_tokenweave._legacy``): every old module path,
renamed name and renamed keyword warns with a ``DeprecationWarning`` naming the new one and gives
the same object; the package, its tests and ``benchmarks/`` use none of them."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

import jax_tokenweave
from jax_tokenweave._legacy import MOVED

ROOT = Path(__file__).resolve().parents[1]

SCHEDULES, DECODER = "jax_tokenweave.weave.schedules", "jax_tokenweave.nn.decoder"
SCHEDULER, REQUESTS = "jax_tokenweave.serving.scheduler", "jax_tokenweave.serving.requests"
ONESHOT = "jax_tokenweave.serving.oneshot"
# (module, old name, module of the new name, new name)
RENAMED = [
    (SCHEDULES, "COMMS", SCHEDULES, "COLLECTIVES"),
    (SCHEDULES, "ALL_COMMS", SCHEDULES, "ALL_COLLECTIVES"),
    (SCHEDULES, "Comm", SCHEDULES, "Collective"),
    (SCHEDULES, "resolve_comm", SCHEDULES, "resolve_collective"),
    (SCHEDULES, "ffi_unavailable", SCHEDULES, "unavailable_reason"),
    (DECODER, "COMMS", SCHEDULES, "COLLECTIVES"),
    (DECODER, "ALL_COMMS", SCHEDULES, "ALL_COLLECTIVES"),
    (DECODER, "SCHEDULES", SCHEDULES, "SCHEDULES"),
    (DECODER, "ffi_unavailable", SCHEDULES, "unavailable_reason"),
    (DECODER, "resolve_comm", SCHEDULES, "resolve_collective"),
    (DECODER, "own_rows", "jax_tokenweave.weave.reducers", "own_rows"),
    ("jax_tokenweave.bench.benchmarking", "COMMS", SCHEDULES, "COLLECTIVES"),
    ("jax_tokenweave.bench", "main", "jax_tokenweave.bench.job", "main"),
    ("jax_tokenweave.bench", "build_parser", "jax_tokenweave.bench.job", "build_parser"),
    ("jax_tokenweave.bench", "format_table", "jax_tokenweave.bench.report", "format_table"),
    (SCHEDULER, "Sequence", SCHEDULER, "Request"),
    (REQUESTS, "Request", REQUESTS, "EngineRequest"),
    ("jax_tokenweave.serving", "generate", ONESHOT, "generate_ids"),
    (ONESHOT, "generate", ONESHOT, "generate_ids"),
]


def _forget(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next import of ``name`` run its shim again (this test's changes undone after)."""
    monkeypatch.delitem(sys.modules, name, raising=False)
    parent, _, leaf = name.rpartition(".")
    monkeypatch.delattr(sys.modules[parent], leaf, raising=False)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_warns_and_is_the_new_module(old, monkeypatch):
    new = importlib.import_module(MOVED[old])
    _forget(old, monkeypatch)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} is deprecated: it moved to")):
        module = importlib.import_module(old)
    assert module is new and sys.modules[old] is new


def test_old_paths_work_in_import_statements(monkeypatch):
    from jax_tokenweave.nn.decoder import WeaveDecoder
    from jax_tokenweave.weave.plan import plan_batch

    for old in ("jax_tokenweave.layers", "jax_tokenweave.split", "jax_tokenweave.ops"):
        _forget(old, monkeypatch)
    with pytest.warns(DeprecationWarning, match="jax_tokenweave.layers is deprecated"):
        from jax_tokenweave.layers import WeaveDecoder as old_decoder
    with pytest.warns(DeprecationWarning, match="jax_tokenweave.split is deprecated"):
        from jax_tokenweave import split
    with pytest.warns(DeprecationWarning, match="jax_tokenweave.ops is deprecated"):
        import jax_tokenweave.ops
    assert old_decoder is WeaveDecoder and split.plan_batch is plan_batch
    assert jax_tokenweave.ops.allreduce_rmsnorm is jax_tokenweave.kernel.ops.allreduce_rmsnorm


def test_importing_the_package_registers_no_import_hook():
    """The old paths come from the package's ``__path__`` (its ``_legacy/`` folder), not from
    a finder in ``sys.meta_path`` or ``sys.path_hooks``: in a fresh interpreter, importing the
    package and an old path leaves both as they were."""
    script = (
        "import sys, warnings; warnings.simplefilter('ignore')\n"
        "hooks = (list(sys.meta_path), list(sys.path_hooks))\n"
        "import jax_tokenweave, jax_tokenweave.util\n"
        "print(hooks == (list(sys.meta_path), list(sys.path_hooks)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.split() == ["True"], proc.stdout + proc.stderr
    assert jax_tokenweave.__path__[-1].endswith("_legacy")


@pytest.mark.parametrize(("module", "old", "new_module", "new"), RENAMED)
def test_renamed_name_warns_and_is_the_new_one(module, old, new_module, new):
    want = getattr(importlib.import_module(new_module), new)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{module}.{old} is deprecated")):
        got = getattr(importlib.import_module(module), old)
    assert got is want


def test_unknown_names_still_raise_attribute_error():
    from jax_tokenweave import bench
    from jax_tokenweave.weave import schedules

    for module in (bench, schedules):
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            module.nope  # noqa: B018


def test_batch_plan_split_is_is_split():
    from jax_tokenweave.weave.plan import plan_batch

    plan = plan_batch([4, 4], split=True)
    with pytest.warns(DeprecationWarning, match=r"BatchPlan.split is deprecated: use .*is_split"):
        assert plan.split is plan.is_split is True


def test_comm_keyword_is_collective(cpu_mesh):
    from jax_tokenweave.models.configs import get_config
    from jax_tokenweave.models.llama import LlamaModel
    from jax_tokenweave.nn.decoder import WeaveDecoder
    from jax_tokenweave.weave.plan import plan_batch
    from jax_tokenweave.weave.schedules import stack_setup

    config, mesh = get_config("tiny", num_layers=1), cpu_mesh(2)
    plan = plan_batch([4, 4], tp=2, split=True)
    with pytest.warns(DeprecationWarning, match=r"stack_setup\(comm=...\) is deprecated"):
        old = stack_setup(config, mesh, "tp", jnp.float32, plan, schedule="weave", comm="local")
    new = stack_setup(config, mesh, "tp", jnp.float32, plan, schedule="weave", collective="local")
    assert old.reducer is new.reducer and old.halves == new.halves
    decoder = WeaveDecoder(config, mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    hidden = jnp.zeros((plan.num_tokens, config.hidden_size), jnp.float32)
    with (
        pytest.warns(DeprecationWarning, match=r"WeaveDecoder.__call__\(comm=...\) is deprecated"),
        pytest.raises(ValueError, match="collective must be one of"),
    ):
        decoder(hidden, plan, comm="nccl")
    model = LlamaModel(config, mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    with (
        pytest.warns(DeprecationWarning, match=r"LlamaModel.__call__\(comm=...\) is deprecated"),
        pytest.raises(ValueError, match="collective must be one of"),
    ):
        model(jnp.zeros(plan.num_tokens, jnp.int32), plan, comm="nccl")


def test_engine_config_comm_is_collective():
    from jax_tokenweave.serving import LLM, EngineConfig

    with pytest.warns(DeprecationWarning, match=r"EngineConfig\(comm=...\) is deprecated"):
        config = EngineConfig(comm="xla")
    assert config == EngineConfig(collective="xla")
    with pytest.warns(DeprecationWarning, match="EngineConfig.comm is deprecated"):
        assert config.comm == "xla"
    with (
        pytest.warns(DeprecationWarning, match=r"LLM\(comm=...\) is deprecated"),
        pytest.raises(AttributeError),  # the bad model, after the keyword was taken
    ):
        LLM(object(), comm="xla", use_tqdm=False)


def test_mode_comm_and_engine_generate():
    from jax_tokenweave.bench.modes import Mode
    from jax_tokenweave.serving import LLMEngine

    with pytest.warns(DeprecationWarning, match="Mode.comm is deprecated"):
        assert Mode("weave", "xla").comm == "xla"

    class Engine:
        def run_to_completion(self, prompts, params=None):
            return ["ran", prompts, params]

    with pytest.warns(DeprecationWarning, match="LLMEngine.generate is deprecated"):
        assert LLMEngine.generate(Engine(), [[1]], None) == ["ran", [[1]], None]  # type: ignore[arg-type]


def test_benchmarking_ffi_unavailable_is_unavailable_reason(cpu_mesh):
    from jax_tokenweave.bench import benchmarking as bm
    from jax_tokenweave.kernel import unavailable_reason

    mesh = cpu_mesh(2)
    want = unavailable_reason(mesh, "tp", jnp.bfloat16, (64, 64))
    with pytest.warns(DeprecationWarning, match="ffi_unavailable is deprecated"):
        assert bm.ffi_unavailable(mesh, jnp.bfloat16, (64, 64)) == want


# ------------------------------------------------------------------ nothing uses old names ---


def _python_files() -> list[Path]:
    files = [*ROOT.joinpath("jax_tokenweave").rglob("*.py"), *ROOT.joinpath("tests").glob("*.py")]
    files += ROOT.joinpath("benchmarks").glob("*.py")
    return [f for f in sorted(files) if "_legacy" not in f.parts and f.name != Path(__file__).name]


def _deprecated_names() -> dict[str, set[str]]:
    """``{module: names}`` each module's ``__getattr__`` serves with a warning."""
    out: dict[str, set[str]] = {}
    for module, old, _, _ in RENAMED:
        out.setdefault(module, set()).add(old)
    for module in {m for m, *_ in RENAMED}:
        out[module] |= set(getattr(importlib.import_module(module), "_RENAMED", {}))
    return out


def test_nothing_imports_an_old_path_or_name():
    """The package, the tests and ``benchmarks/`` import new paths and names only (the tests
    also turn the package's DeprecationWarnings into errors: ``pyproject.toml``)."""
    deprecated = _deprecated_names()
    found = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if f"{node.module}.{a.name}" in MOVED
                    or a.name in deprecated.get(node.module, ())
                ]
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                for name in names
                if name in MOVED
                or any(name.startswith(old + ".") for old in MOVED)
                or name.rpartition(".")[2] in deprecated.get(name.rpartition(".")[0], ())
            ]
    assert not found, "old paths or names:\n" + "\n".join(found)


def test_comm_option_is_collective(capsys):
    """The command lines' ``--comm`` is ``--collective``, with a note on stderr."""
    from jax_tokenweave.bench import job

    assert job.build_parser().parse_args(["--collective", "xla"]).collective == "xla"
    assert capsys.readouterr().err == ""
    assert job.build_parser().parse_args(["--comm", "xla"]).collective == "xla"
    assert "--comm is deprecated: use --collective" in capsys.readouterr().err
