"""Package hygiene: the layout (which parts sit at the top), imports that run one way between
the parts and have no cycles between modules (imports inside functions included), every
third-party import declared in ``pyproject.toml``, and importing any module changes no global
state."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jax_tokenweave"


def modules() -> dict[str, Path]:
    """``{dotted module name: file}`` of every Python module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(path: Path, known: set[str] = frozenset()) -> list[str]:
    """Every module an ``import`` / ``from ... import`` anywhere in ``path`` names
    (``from pkg import name`` is ``pkg.name`` where that is one of the ``known`` modules)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            ]
    return names


def import_graph() -> dict[str, set[str]]:
    """Edges module -> package module it imports (its own parent packages left out: Python
    imports those first anyway)."""
    mods = modules()
    return {
        name: {
            m
            for m in _imported(path, set(mods))
            if m in mods and m != name and not name.startswith(m + ".")
        }
        for name, path in mods.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert "jax_tokenweave.nn.moe" not in graph["jax_tokenweave.nn.params"]
    assert graph["jax_tokenweave.models.auto"] >= {"jax_tokenweave.models.llama"}
    assert not any(
        m.startswith("jax_tokenweave.models")
        for m in set().union(*(graph[m] for m in graph if m.startswith("jax_tokenweave.hf")))
    )
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


# The parts of the package, bottom to top: a part imports only parts of a lower rank (docs/
# ARCHITECTURE.md, "Imports run one way"). Equal ranks do not import each other.
LAYERS: dict[str, int] = {
    "config": 0,  # model shapes
    "_deprecation": 0,  # helpers that keep an old name for one release; imports nothing of ours
    "kernel": 1,  # the fused kernel and what runs it
    "weave": 2,  # plan, cost, tuning, reducers, schedules
    "nn": 3,  # the decoder: layers, attention, params, the layer loop
    "hf": 4,  # Hugging Face checkpoints
    "models": 5,  # Llama / Qwen2 / Mixtral, the registry
    "reference": 6,  # float64 references (the tests' ground truth)
    "serving": 6,  # the engine, LLM, the command lines' shared options
    "launch": 7,  # the command: one process per GPU
    "harness": 8,  # the benchmark harness: the main job, the benchmarks' helpers
    "openai_server": 8,  # the OpenAI-compatible HTTP server
    "bench": 9,  # the commands: the main job,
    "generate": 9,  # text from a checkpoint,
    "serve": 9,  # the OpenAI server
}
TOP_MODULES = {"__init__", "_deprecation", "config", "bench", "generate", "launch", "serve"}
"""The only modules at the top of the package: the rest lives in the parts' subpackages."""


def part_of(module: str) -> str:
    """``jax_tokenweave.weave.plan`` -> ``weave``."""
    return module.split(".")[1]


def test_only_the_commands_and_config_sit_at_the_top():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == TOP_MODULES, f"modules at the top of the package: {sorted(top - TOP_MODULES)}"
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert parts | TOP_MODULES - {"__init__"} == set(LAYERS), parts ^ set(LAYERS)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """The edges of ``graph`` from a part to a part of the same or a higher rank."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if a != "jax_tokenweave"
        and part_of(a) != part_of(b)
        and LAYERS[part_of(a)] <= LAYERS[part_of(b)]
    )


def test_imports_run_one_way():
    """config <- kernel <- weave <- nn <- hf <- models <- serving <- the commands (``LAYERS``)."""
    graph = import_graph()
    wrong = layer_violations(graph)
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)
    assert graph["jax_tokenweave"] == set(), "the package's __init__ loads its names lazily"
    assert graph["jax_tokenweave.weave.schedules"] >= {"jax_tokenweave.kernel._ffi"}
    assert layer_violations(
        {
            "jax_tokenweave.weave.plan": {"jax_tokenweave.nn.attention"},  # up
            "jax_tokenweave.serving.cli": {"jax_tokenweave.reference.model"},  # sideways
            "jax_tokenweave.nn.stack": {"jax_tokenweave.weave.plan", "jax_tokenweave.nn.x"},
        }
    ) == [
        "jax_tokenweave.serving.cli -> jax_tokenweave.reference.model",
        "jax_tokenweave.weave.plan -> jax_tokenweave.nn.attention",
    ]


# Inside ``serving``, its rooms (subpackages) and the modules at its top, bottom to top (docs/
# ARCHITECTURE.md, "Imports run one way"): a room imports only rooms of a lower rank; equal
# ranks do not import each other. ``serving/__init__`` gathers the public names of all of them.
SERVING_LAYERS: dict[str, int] = {
    "checks": 0,  # argument checks
    "buckets": 0,  # shape buckets
    "outputs": 0,  # RequestOutput, StreamDelta, ...: what a request gives back
    "sampling_params": 1,  # SamplingParams
    "attention": 1,  # paged attention, its backends (CUDA, cuDNN, XLA), the cache arrays
    "sampling": 2,  # sampling maths, logits processors, prompt log-probabilities
    "compilation": 2,  # the compilation and executable caches, compile counts
    "config": 3,  # EngineConfig
    "scheduling": 4,  # scheduler, request state, KV blocks, prefix cache (host side)
    "runner": 5,  # ModelRunner: the step's layout, forward and sampler programs, warm-up, memory
    "core": 6,  # LLMEngine: the step loop, its request side, deltas, stats
    "offline": 7,  # LLM, its set-up, prompt forms, generate_ids
    "cli": 8,  # what the command lines share
}
SERVING_MOVED = {
    "blocks": "scheduling.blocks",
    "compile_count": "compilation.compile_count",
    "engine": "core.engine",
    "llm": "offline.llm",
    "oneshot": "offline.oneshot",
}
"""Old paths of modules that hold public names, kept for one release (0.5.0 removes them): each
file only calls ``moved_module``."""


def room_of(module: str) -> str | None:
    """``jax_tokenweave.serving.runner.step`` -> ``runner`` (None outside ``serving`` and for
    ``serving/__init__``)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "serving" else None


def room_violations(graph: dict[str, set[str]]) -> list[str]:
    """The edges of ``graph`` between rooms of ``serving`` from one to a room of the same or a
    higher rank (:data:`SERVING_LAYERS`; the old paths above them all)."""
    ranks = SERVING_LAYERS | dict.fromkeys(SERVING_MOVED, max(SERVING_LAYERS.values()) + 1)
    wrong = []
    for a, targets in graph.items():
        for b in targets:
            ra, rb = room_of(a), room_of(b)
            if ra and rb and ra != rb and ranks[ra] <= ranks[rb]:
                wrong.append(f"{a} -> {b}")
    return sorted(wrong)


def test_serving_rooms_are_the_listed_ones():
    serving = PACKAGE / "serving"
    found = {p.stem for p in serving.glob("*.py") if p.stem != "__init__"}
    found |= {p.name for p in serving.iterdir() if (p / "__init__.py").is_file()}
    assert found == set(SERVING_LAYERS) | set(SERVING_MOVED), found ^ set(SERVING_LAYERS)
    for old, new in SERVING_MOVED.items():
        text = (serving / f"{old}.py").read_text()
        assert f'moved_module(__name__, "jax_tokenweave.serving.{new}")' in text, old
        assert (serving / f"{new.replace('.', '/')}.py").is_file(), new


def test_serving_imports_run_one_way():
    """attention, sampling_params <- sampling, compilation <- config <- scheduling <- runner <-
    core <- offline <- cli (:data:`SERVING_LAYERS`)."""
    graph = import_graph()
    wrong = room_violations(graph)
    assert not wrong, "imports against serving's rooms:\n" + "\n".join(wrong)
    assert graph["jax_tokenweave.serving.core.engine"] >= {
        "jax_tokenweave.serving.runner.runner",
        "jax_tokenweave.serving.scheduling.scheduler",
    }
    assert room_violations(
        {
            "jax_tokenweave.serving.attention.paged_cache": {"jax_tokenweave.serving.config"},
            "jax_tokenweave.serving.runner.step": {"jax_tokenweave.serving.runner.batch"},
            "jax_tokenweave.serving.sampling.sampling": {"jax_tokenweave.serving.compilation.x"},
            "jax_tokenweave.serving.core.engine": {"jax_tokenweave.serving.runner.runner"},
        }
    ) == [
        "jax_tokenweave.serving.attention.paged_cache -> jax_tokenweave.serving.config",
        "jax_tokenweave.serving.sampling.sampling -> jax_tokenweave.serving.compilation.x",
    ]


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")


# Package modules that may import an extra's packages besides the core dependencies: the HTTP
# server (its package and its command) uses the serve extra (and says to install it where it is
# missing).
EXTRA_MODULES = {"jax_tokenweave.openai_server": "serve", "jax_tokenweave.serve": "serve"}


def extras_of(module: str) -> set[str]:
    """The extras ``module`` may import from (:data:`EXTRA_MODULES`)."""
    return {
        extra
        for prefix, extra in EXTRA_MODULES.items()
        if module == prefix or module.startswith(prefix + ".")
    }


def test_every_third_party_import_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    plot = {_requirement_name(r) for r in extras["plot"]}
    test = {_requirement_name(r) for r in extras["test"]}
    dists = importlib.metadata.packages_distributions()
    for name, path in modules().items():
        allowed_extras = {_requirement_name(r) for extra in extras_of(name) for r in extras[extra]}
        # the tests import every module: the test extra must bring what the extras' modules use
        assert allowed_extras <= test, f"{name}: test extra lacks {allowed_extras - test}"
        for imported in _imported(path):
            top = imported.split(".")[0]
            if top in sys.stdlib_module_names or top == "jax_tokenweave" or top == "__future__":
                continue
            declared = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
            allowed = core | allowed_extras | (plot if top == "matplotlib" else set())
            assert declared & allowed, f"{name} imports {top}, not declared in pyproject.toml"


def test_extra_modules_are_confined():
    """Only the modules of :data:`EXTRA_MODULES` get an extra's packages: the serving engine
    itself imports none of them."""
    assert extras_of("jax_tokenweave.openai_server.app") == {"serve"}
    assert extras_of("jax_tokenweave.serving.offline.llm") == set()
    assert extras_of("jax_tokenweave.server") == set()


def test_importing_any_module_changes_no_global_state():
    """In a fresh interpreter: importing every module leaves ``os.environ`` and JAX's config as
    they were, and initialises no JAX backend."""
    script = """
import importlib, json, os, sys
import jax
from jax._src import xla_bridge
env, cpus = dict(os.environ), jax.config.jax_num_cpu_devices
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
print(json.dumps({"changed": changed, "cpus": [cpus, jax.config.jax_num_cpu_devices],
                  "backends": xla_bridge.backends_are_initialized()}))
"""
    names = sorted(modules())
    assert "jax_tokenweave.harness.job" in names and "jax_tokenweave.harness.benchmarking" in names
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(names)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["changed"] == [], f"importing changed environment variables {report['changed']}"
    assert report["cpus"][0] == report["cpus"][1]
    assert not report["backends"], "importing the package initialised a JAX backend"


def test_both_build_files_list_every_extension_source():
    """ffi/CMakeLists.txt (the package) and BUILD (Bazel users) name every kernel and host
    source of ffi/'s parts (collective/, attention/, common/); BUILD also every header. The
    nanobind module (module.{h,cc}, each part's bindings.cc) is CMake's only."""
    ffi = ROOT / "ffi"
    cmake, bazel = (ffi / "CMakeLists.txt").read_text(), (ROOT / "BUILD").read_text()
    parts = {p.parent.name for p in ffi.rglob("*") if p.suffix in (".cc", ".cu", ".h", ".cuh")}
    assert parts == {"ffi", "collective", "attention", "common"}, parts
    nanobind = {"module.cc", "module.h", "bindings.cc"}
    for src in sorted([*ffi.rglob("*.cc"), *ffi.rglob("*.cu")]):
        rel = src.relative_to(ffi).as_posix()
        assert re.search(rf"(^|\s){re.escape(rel)}(\s|\))", cmake), f"{rel} missing from CMake"
        if src.name not in nanobind:
            assert f'"ffi/{rel}"' in bazel, f"{rel} missing from BUILD"
    for hdr in sorted([*ffi.rglob("*.h"), *ffi.rglob("*.cuh")]):
        rel = hdr.relative_to(ffi).as_posix()
        if hdr.name not in nanobind:
            assert f'"ffi/{rel}"' in bazel, f"{rel} missing from BUILD"
