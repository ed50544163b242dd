"""The executable cache (``serving.compilation.executable_cache``): a second engine of the same
model, in this process or a new one, loads every step program from disk (no tracing, no compiling)
and makes the same tokens; anything that changes the program changes the key; a corrupt file is
ignored with a warning and recompiled; None turns the cache off. The file handling (atomic
writes, checksums, a backend that cannot serialize) is tested with a fake serializer."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from testutil import engine_in_new_process, fresh_process_jax_cache

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.serving import EngineConfig, LLMEngine, SamplingParams, count_compilations
from jax_tokenweave.serving.compilation import executable_cache as ec
from jax_tokenweave.serving.compilation import executable_key
from jax_tokenweave.weave.tuning import TuneEntry

ROOT = Path(__file__).resolve().parents[1]
CFG = EngineConfig(
    max_num_batched_tokens=32,
    max_num_seqs=4,
    prefill_tile=16,
    block_size=4,
    num_blocks=48,
    max_model_len=64,
    key_chunk=8,
    split_threshold=16,
    collective="xla",
    max_logprobs=2,
)
PROMPTS = [[1, 2, 3], list(range(5, 30))]
PARAMS = [
    SamplingParams(max_tokens=5, temperature=0.0),  # greedy
    SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=11, logprobs=2),
]


@pytest.fixture(autouse=True)
def fresh_jax(monkeypatch):
    """JAX's cache settings as a fresh process has them (``testutil``), and each test compiles
    afresh (on XLA:CPU an executable that has run cannot be serialized, and JAX's in-memory
    cache would hand back one from an earlier test)."""
    jax.clear_caches()
    yield from fresh_process_jax_cache(monkeypatch)


@pytest.fixture(scope="module")
def model():
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    return LlamaModel(get_config("tiny"), mesh, dtype=jnp.float32, rngs=nnx.Rngs(3))


def cached(tmp_path: Path, **changes) -> EngineConfig:
    return dataclasses.replace(CFG, compilation_cache_dir=str(tmp_path / "cache"), **changes)


def tokens(engine: LLMEngine) -> list[list[int]]:
    return [out.token_ids for out in engine.run_to_completion(PROMPTS, PARAMS)]


def files(tmp_path: Path) -> list[Path]:
    folder = tmp_path / "cache" / ec.SUBDIR
    return sorted(folder.glob("*.bin")) if folder.exists() else []


@pytest.mark.slow
def test_second_engine_loads_every_layout_and_makes_the_same_tokens(model, tmp_path):
    first = LLMEngine(model, cached(tmp_path))
    n = len(first.layouts())
    report = first.warmup()
    assert (report.layouts, report.loaded, report.compiled) == (n, 0, n) and n >= 4
    small = len(first.runner._samplers) + len(first.runner._slot_starts)
    assert len(files(tmp_path)) == n + small  # forwards + samplers + slot writes
    assert not list((tmp_path / "cache" / ec.SUBDIR).glob("*.tmp"))
    want = tokens(first)
    second = LLMEngine(model, cached(tmp_path))
    with count_compilations() as compiles:
        report = second.warmup(progress=True)
        got = tokens(second)
    assert (report.layouts, report.loaded, report.compiled) == (n, n, 0)
    assert compiles.count == 0 and got == want
    assert len(second.runner._executables) == n


@pytest.mark.slow
def test_a_layout_not_warmed_up_runs_through_jit(model, tmp_path):
    engine = LLMEngine(model, dataclasses.replace(CFG, compilation_cache_dir=None))
    want = tokens(engine)  # no warm-up: every step goes through jit
    assert not engine.runner._executables
    engine.warmup()
    assert tokens(engine) == want


def test_anything_that_changes_the_program_changes_the_key(model, tmp_path, monkeypatch):
    runner = LLMEngine(model, cached(tmp_path)).runner
    layout = runner.layouts()[-1]

    def key(r=runner, lay=layout) -> str:
        return r.program_key(lay, r.padding_args(lay))

    base = key()
    assert key() == base
    assert key(lay=runner.layouts()[0]) != base
    for change in (
        {"schedule": "baseline"},
        {"key_chunk": 16},
        {"attention": "xla"},
        {"collective": "auto"},
        {"tuning": TuneEntry(offset=None, num_ctas=8)},
    ):
        other = LLMEngine(model, cached(tmp_path, **change)).runner
        assert key(other, other.layouts()[-1]) != base, change
    same_shapes = LlamaModel(
        dataclasses.replace(get_config("tiny"), rms_norm_eps=1e-6),
        model.mesh,
        dtype=jnp.float32,
        rngs=nnx.Rngs(3),
    )
    assert key(LLMEngine(same_shapes, cached(tmp_path)).runner) != base
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_foo")
    assert key() != base
    monkeypatch.undo()
    monkeypatch.setattr(executable_key, "source_hash", lambda: "edited")
    assert key() != base
    monkeypatch.undo()
    # The fused kernel's communicator by id and identity (a program names it by id).
    args = runner.padding_args(layout)
    assert runner.program_key(layout, args, {"1": "tp over devices 0, 1"}) != base
    assert runner.program_key(layout, args, {"2": "tp over devices 0, 1"}) != base
    assert runner.program_key(layout, args, {}) == base
    precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "bfloat16")
    try:
        assert key() != base
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    assert key() == base


@pytest.mark.slow
def test_a_changed_config_misses_the_cache(model, tmp_path):
    LLMEngine(model, cached(tmp_path)).warmup()
    report = LLMEngine(model, cached(tmp_path, key_chunk=16)).warmup()
    assert report.loaded == 0 and report.compiled == report.layouts


@pytest.mark.slow
def test_a_corrupt_file_is_compiled_again_with_a_warning(model, tmp_path):
    first = LLMEngine(model, cached(tmp_path))
    n = first.warmup().layouts
    # a forward program's file (the key, as warm-up made it, before any step replaced the cache)
    runner, layout = first.runner, first.runner.layouts()[0]
    broken = runner.executable_cache.path(runner.program_key(layout, runner.padding_args(layout)))
    want = tokens(first)
    data = bytearray(broken.read_bytes())
    data[len(data) // 2] ^= 0xFF
    broken.write_bytes(bytes(data))
    # JAX's in-memory cache would hand back the program `first` ran, which XLA:CPU cannot
    # serialize once a sort in it has run: compile it afresh, as a new process does; and not
    # from JAX's persistent cache, whose XLA:CPU programs are never stored again (below).
    jax.clear_caches()
    for entry in (tmp_path / "cache").iterdir():
        if entry.name != ec.SUBDIR:
            entry.unlink()
    second = LLMEngine(model, cached(tmp_path))
    with pytest.warns(RuntimeWarning, match="checksum"):
        report = second.warmup()
    assert (report.loaded, report.compiled) == (n - 1, 1)
    assert tokens(second) == want
    assert LLMEngine(model, cached(tmp_path)).warmup().loaded == n  # rewritten


@pytest.mark.slow
def test_no_directory_or_jax_caching_off_writes_nothing(model, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    engine = LLMEngine(model, dataclasses.replace(CFG, compilation_cache_dir=None))
    assert not engine.runner.executable_cache.enabled
    report = engine.warmup()
    assert report.loaded == 0 and report.compiled == report.layouts
    assert not list(tmp_path.rglob("*"))
    jax.config.update("jax_enable_compilation_cache", False)
    engine = LLMEngine(model, cached(tmp_path / "off"))
    assert not engine.runner.executable_cache.enabled and engine.warmup().compiled
    assert not files(tmp_path / "off")


# -- the file handling, with a fake serializer ---------------------------------------------
class Fake:
    """``serialize`` -> the program's name; ``deserialize`` -> a ``FakeProgram``."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail

    def serialize(self, compiled):
        if self.fail is not None:
            raise self.fail
        return compiled.name.encode()

    def deserialize(self, payload, in_tree, out_tree, devices):
        if payload == b"bad":
            raise RuntimeError("cannot load")
        return FakeProgram(payload.decode(), args_info=((jax.ShapeDtypeStruct((2,), "f4"),), {}))


@dataclasses.dataclass
class FakeProgram:
    name: str
    args_info: object = None


ARGS = (np.zeros(2, np.float32),)


def test_store_and_load_round_trip_atomically(tmp_path):
    cache = ec.ExecutableCache(tmp_path, Fake())
    assert cache.load("k", ARGS, None, []) is None
    assert cache.store("k", FakeProgram("one"))
    assert cache.load("k", ARGS, None, []).name == "one"
    assert cache.store("k", FakeProgram("two"))
    assert cache.load("k", ARGS, None, []).name == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["k.bin"]  # no temporary file left


def test_an_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "x.bin"
    ec.atomic_write(path, b"old")

    def boom(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        ec.atomic_write(path, b"new")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["x.bin"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d[:-3], "checksum"),
        (lambda d: b"junk" + d, "bad magic"),
        (lambda d: b"", "bad magic"),
    ],
)
def test_a_damaged_file_warns_and_loads_nothing(tmp_path, damage, message):
    cache = ec.ExecutableCache(tmp_path, Fake())
    cache.store("k", FakeProgram("one"))
    cache.path("k").write_bytes(damage(cache.path("k").read_bytes()))
    with pytest.warns(RuntimeWarning, match=message):
        assert cache.load("k", ARGS, None, []) is None


def test_a_file_of_another_key_or_shape_or_that_fails_to_load_is_ignored(tmp_path):
    cache = ec.ExecutableCache(tmp_path, Fake())
    cache.store("a", FakeProgram("one"))
    cache.path("a").rename(cache.path("b"))
    with pytest.warns(RuntimeWarning, match="another key"):
        assert cache.load("b", ARGS, None, []) is None
    cache.store("c", FakeProgram("one"))
    with pytest.warns(RuntimeWarning, match="compiled for float32"):
        assert cache.load("c", (np.zeros(3, np.float32),), None, []) is None
    cache.store("d", FakeProgram("bad"))
    with pytest.warns(RuntimeWarning, match="cannot load"):
        assert cache.load("d", ARGS, None, []) is None


def test_a_program_jax_cannot_serialize_is_skipped_with_one_warning(tmp_path):
    cache = ec.ExecutableCache(
        tmp_path, Fake(ValueError("Compilation does not support serialization"))
    )
    with pytest.warns(RuntimeWarning, match="does not support serialization"):
        assert not cache.store("k", FakeProgram("one"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cache.store("k2", FakeProgram("two"))  # no 2nd warning
    assert cache.load("k", ARGS, None, []) is None and not list(tmp_path.iterdir())


def test_a_cpu_program_with_a_sort_that_ran_is_not_stored(tmp_path):
    """XLA:CPU: once run, a sort's comparator is a built-in that cannot be serialized; JAX's
    in-memory cache hands that executable back to the next ``compile`` of the same program."""
    f = jax.jit(lambda x: jnp.sort(x * 3.0))
    x = jnp.arange(8.0)
    f.lower(x).compile()(x)
    cache = ec.ExecutableCache(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stored = cache.store("k", f.lower(x).compile())
    if stored:  # a JAX that serializes it: then it must load and run
        program = cache.load("k", (x,), f.lower(x).compile().out_tree, jax.devices()[:1])
        np.testing.assert_array_equal(program(x), f(x))
    else:
        assert any("cannot serialize" in str(w.message) for w in caught)
    assert cache.enabled


@pytest.mark.slow
def test_a_new_process_loads_every_layout_from_disk(tmp_path):
    """The real use: a restart. JAX's in-memory caches cannot help a new process."""

    first, second = engine_in_new_process(tmp_path), engine_in_new_process(tmp_path)
    n = first["compiled"]
    assert first["loaded"] == 0 and n >= 4 and first["compilations"] >= n
    assert (second["loaded"], second["compiled"], second["compilations"]) == (n, 0, 0)
    assert second["tokens"] == first["tokens"]


def test_an_xla_cpu_program_from_jax_persistent_cache_is_not_stored(tmp_path):
    """Serialized a second time, such a program loads and then fails at its first run
    ("Function ... not found"): compile_to_store says so, and the engine does not store it."""
    from jax_tokenweave.serving.compilation.compilation_cache import use_compilation_cache

    use_compilation_cache(tmp_path / "jax")
    fn = jax.jit(lambda x: jnp.concatenate([jnp.sin(x), x[::-1]]) @ x.T)
    x = jnp.ones((2, 4))
    _, first = ec.compile_to_store(fn.lower(x), "cpu")
    assert first is None  # compiled here
    jax.clear_caches()
    compiled, second = ec.compile_to_store(fn.lower(x), "cpu")
    assert second is not None and "persistent" in second  # from JAX's cache
    np.testing.assert_allclose(np.asarray(compiled(x)), np.asarray(fn(x)))
    jax.clear_caches()
    assert ec.compile_to_store(fn.lower(x), "gpu")[1] is None  # GPU programs round-trip


def test_large_decode_steps_compile_with_split_k_off(model, tmp_path, monkeypatch):
    """Decode-only steps of at least ``UNSPLIT_K_MIN_ROWS`` rows compile with XLA's split-K
    rewrite off (and their key says so); steps with prompt chunks and smaller decode steps keep
    XLA's defaults. Either way the engine makes the same tokens."""
    from jax_tokenweave.serving.runner import runner as runner_module
    from jax_tokenweave.serving.runner import step

    assert step.xla_knows(step.UNSPLIT_K_OPTION)
    assert not step.xla_knows("xla_gpu_no_such_option")
    engine = LLMEngine(model, dataclasses.replace(CFG, compilation_cache_dir=None))
    want = tokens(engine)
    runner = engine.runner
    layouts = runner.layouts()
    keys = {lay: runner.program_key(lay, runner.padding_args(lay)) for lay in layouts}
    assert all(step.UNSPLIT_K_OPTION not in runner._forward(lay)[1] for lay in layouts)

    monkeypatch.setattr(runner_module, "UNSPLIT_K_MIN_ROWS", 4)
    decode_only = [lay for lay in layouts if lay.decode_only]
    big = [lay for lay in decode_only if lay.rows >= 4]
    assert big and len(big) < len(layouts)
    for lay in layouts:
        options = runner._forward(lay)[1]
        assert (options.get(step.UNSPLIT_K_OPTION) == 1) == (lay in big), lay
        changed = runner.program_key(lay, runner.padding_args(lay)) != keys[lay]
        assert changed == (lay in big), lay
    engine = LLMEngine(model, dataclasses.replace(CFG, compilation_cache_dir=None))
    assert tokens(engine) == want


class _Compiled:
    """A compiled program as ``unknown_communicators`` reads it: its HLO text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def as_text(self) -> str:
        return self.text


def test_a_fused_kernel_program_is_stored_only_with_its_communicators_in_the_key(monkeypatch):
    from jax_tokenweave.kernel import _extension

    monkeypatch.setattr(_extension, "import_error", lambda: None)  # as where it is built
    call = (
        'custom-call(p, r, w), custom_call_target="tokenweave_allreduce_rmsnorm", '
        "api_version=API_VERSION_TYPED_FFI, backend_config={algo = 0 : i32, comm_id = 3 : i64, "
        "eps = 9.99999997E-7 : f32, num_ctas = 16 : i32, slot = 0 : i32}"
    )
    known = {"3": "tp over devices 0, 1"}
    assert ec.unknown_communicators(_Compiled(call), known) is None
    assert "['3']" in ec.unknown_communicators(_Compiled(call), {"1": "another"})
    two = call + "\n" + call.replace("comm_id = 3", "comm_id = 12")
    assert "['12']" in ec.unknown_communicators(_Compiled(two), known)
    unnamed = call.replace("comm_id = 3 : i64, ", "")
    assert "names no communicator" in ec.unknown_communicators(_Compiled(unnamed), known)
    assert ec.unknown_communicators(_Compiled("dot(a, b)"), {}) is None  # no fused call


def test_a_communicator_identity_names_what_it_connects(cpu_mesh):
    from jax_tokenweave.kernel.comm import Communicator

    mesh = cpu_mesh(2)
    identity = Communicator(mesh, "tp").identity()
    assert repr([d.id for d in mesh.devices.flat]) in identity and "'tp'" in identity
    assert Communicator(mesh, "tp").identity() == identity
    assert Communicator(cpu_mesh(1), "tp").identity() != identity
    # No fused kernel on CPUs (nor with collective="xla", nor baseline): no communicator.
    weave = dataclasses.replace(CFG, schedule="weave", collective="auto")
    assert ec.step_communicators(mesh, "tp", weave) == {}


def test_source_hash_reads_the_whole_package(monkeypatch):
    """The key's source hash covers every module of the package, not only ``serving``'s."""
    import jax_tokenweave

    roots: list[Path] = []
    rglob = Path.rglob
    monkeypatch.setattr(
        Path, "rglob", lambda self, pattern: roots.append(self) or rglob(self, pattern)
    )
    executable_key.source_hash.__wrapped__()  # past the cache: read the files now
    assert roots == [Path(jax_tokenweave.__file__).resolve().parent]
