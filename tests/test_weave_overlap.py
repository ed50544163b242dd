"""The weave schedule with the fused kernel's start/done pair (collective="ffi") and the
compiled-HLO overlap checker.

CPU: hlo_check on synthetic HLO; collective="ffi" refused / "auto" falling back; the
overlapped schedule with pure-JAX stand-ins for the kernel (values == baseline, slot protocol,
CTA counts); the ordering by data, read from the jaxpr of the real start/done calls.
GPU (>= 2 peer GPUs): weave-ffi == baseline in bf16, and the overlap present in compiled HLO.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from testutil import GPU_CONFIG, FakeKernel, build_decoder, rel_err, run_calls

from jax_tokenweave.harness import hlo_check
from jax_tokenweave.kernel import _extension, _ffi
from jax_tokenweave.kernel.comm import Communicator
from jax_tokenweave.models.configs import get_config
from jax_tokenweave.weave import reducers, tuning
from jax_tokenweave.weave.plan import plan_batch
from jax_tokenweave.weave.schedules import configure, resolve_collective
from jax_tokenweave.weave.tuning import DEFAULT_ENTRY, TuneEntry

# ------------------------------------------------------------------------- HLO checker ---


def _start(name, slot, rows, extra=""):
    return (
        f"  %{name} = (bf16[{rows},64]{{1,0}}, bf16[4,64]{{1,0}}) custom-call(%a, %b, %w), "
        f'custom_call_target="{hlo_check.START_TARGET}", api_version=API_VERSION_TYPED_FFI, '
        f"backend_config={{algo = 1 : i32, comm_id = 3 : i64, eps = 9.99999997E-7 : f32, "
        f"num_ctas = 8 : i32, slot = {slot} : i32}}{extra}"
    )


def _done(name, slot, rows):
    return (
        f"  %{name} = (bf16[{rows},64]{{1,0}}, bf16[4,64]{{1,0}}) custom-call(%gte.1, %gte.2,"
        f' %a, %b, %w), custom_call_target="{hlo_check.DONE_TARGET}", '
        "output_to_operand_aliasing={{0}: (0, {}), {1}: (1, {})}, "
        f"api_version=API_VERSION_TYPED_FFI, backend_config={{comm_id = 3 : i64, "
        f"slot = {slot} : i32}}"
    )


SYNTHETIC = "\n".join(
    [
        "HloModule jit_f, is_scheduled=true, "
        "entry_computation_layout={(bf16[8,64]{1,0})->bf16[8,64]}",
        "",
        "%fused_dot (p0: bf16[8,64], p1: bf16[64,64]) -> bf16[8,64] {",
        "  %p0 = bf16[8,64]{1,0} parameter(0)",
        "  %p1 = bf16[64,64]{1,0} parameter(1)",
        "  ROOT %d = bf16[8,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={0}",
        "}",
        "",
        "%command_buffer (p: bf16[9,64], q: bf16[64,64]) -> (bf16[9,64], s8[16]) {",
        "  %p = bf16[9,64]{1,0} parameter(0)",
        "  %q = bf16[64,64]{1,0} parameter(1)",
        "  ROOT %cublas = (bf16[9,64]{1,0}, s8[16]{0}) custom-call(%p, %q), "
        'custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{}}',
        "}",
        "",
        "ENTRY %main (a: bf16[8,64], b: bf16[4,64], w: f32[64]) -> bf16[8,64] {",
        "  %a = bf16[8,64]{1,0} parameter(0)",
        _start("start.0", 0, 8),
        "  %call = (bf16[9,64]{1,0}, s8[16]{0}) call(%y, %q), to_apply=%command_buffer",
        _start("start.1", 1, 9),
        "  %opt-barrier.1 = (bf16[8,64]{1,0}) opt-barrier(%t)",
        _done("done.0", 0, 8),
        "  %gemm_fusion = bf16[8,64]{1,0} fusion(%a, %w), kind=kCustom, calls=%fused_dot, "
        'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
        _start("start.2", 0, 8),
        _done("done.1", 1, 9),
        _done("done.2", 0, 8),
        "  ROOT %r = bf16[8,64]{1,0} add(%a, %a)",
        "}",
    ]
)


def test_overlap_report_synthetic():
    pairs = hlo_check.overlap_report(SYNTHETIC)
    assert [(p.slot, p.rows, len(p.gemms)) for p in pairs] == [(0, 8, 1), (1, 9, 1), (0, 8, 0)]
    assert pairs[0].gemms[0].target == "__cublas$gemm" and pairs[0].gemm_dims() == {9, 64}
    assert pairs[1].gemm_dims() == {8, 64}  # the triton GEMM fusion, counted once
    assert [p.overlapped for p in pairs] == [True, True, False]
    assert "serialised" not in "".join(hlo_check.overlap_problems(SYNTHETIC))
    assert hlo_check.overlap_problems(SYNTHETIC) == []
    problems = hlo_check.overlap_problems(SYNTHETIC, allow_unoverlapped=0)
    assert len(problems) == 1 and "slot 0" in problems[0]
    assert hlo_check.count_targets(SYNTHETIC) == {"start": 3, "done": 3, "sync": 0}
    # the same module with the GEMMs scheduled after the dones: caught
    lines = SYNTHETIC.splitlines()
    moved = [ln for ln in lines if "%call =" not in ln and "%gemm_fusion =" not in ln]
    at = moved.index(next(ln for ln in moved if "ROOT %r" in ln))
    moved[at:at] = [ln for ln in lines if "%call =" in ln or "%gemm_fusion =" in ln]
    serial = "\n".join(moved)
    assert len(hlo_check.overlap_problems(serial)) == 2
    # without the leading % (pre-optimisation HLO style) the parser still works
    assert len(hlo_check.overlap_report(SYNTHETIC.replace("%", ""))) == 3


def test_overlap_report_errors():
    lines = SYNTHETIC.splitlines()
    no_start = "\n".join(ln for ln in lines if "start.0 =" not in ln)
    with pytest.raises(ValueError, match="no start"):
        hlo_check.overlap_report(no_start)
    no_done = "\n".join(ln for ln in lines if "done.2 =" not in ln)
    with pytest.raises(ValueError, match="never done"):
        hlo_check.overlap_report(no_done)
    with pytest.raises(ValueError, match="ENTRY"):
        hlo_check.overlap_report("HloModule m\n")
    assert hlo_check.overlap_problems("HloModule m\nENTRY %e () -> f32[] {\n}\n") == [
        "no allreduce_rmsnorm start/done pair in the compiled HLO"
    ]


# ------------------------------------------------------------------ the schedule on CPU ---


def test_ffi_refused_on_cpu_and_auto_falls_back(cpu_mesh, rng):
    config, mesh = get_config("tiny"), cpu_mesh(2)
    batch = plan_batch((5, 9, 3), tp=2, split=True)
    dec = build_decoder(config, mesh, jnp.float32, rng)
    hidden = jnp.zeros((batch.num_tokens, config.hidden_size), jnp.float32)
    with pytest.raises(
        RuntimeError, match=r"collective='ffi' is unavailable: half 0 .*collective='auto'"
    ):
        dec(hidden, batch, schedule="weave", collective="ffi")
    assert resolve_collective("auto", mesh, "tp", jnp.float32, batch, config.hidden_size) == "xla"
    assert resolve_collective("xla", mesh, "tp", jnp.float32, batch, config.hidden_size) == "xla"
    with pytest.raises(ValueError, match="tuning"):
        dec(hidden, batch, tuning=16)
    # baseline ignores the collective: an unavailable kernel does not matter there (traced
    # only: eagerly, shard_map would compile each of the stack's ops on its own)
    out = jax.eval_shape(lambda h: dec(h, batch, schedule="baseline", collective="ffi"), hidden)
    assert out.shape == hidden.shape


@pytest.mark.parametrize(
    ("lengths", "offset", "tp"),
    [
        ((5, 9, 3), -120, 4),  # halves 8 + 9, request 1 cut by the split
        ((3, 11, 7, 2), None, 8),  # T=23: not divisible by TP
    ],
)
def test_overlapped_schedule_matches_baseline(cpu_mesh, rng, lengths, offset, tp):
    fake = FakeKernel()
    config, mesh = get_config("tiny", num_layers=3), cpu_mesh(tp)
    batch = plan_batch(lengths, tp=tp, split=True, offset=offset)
    assert batch.is_split and batch.cut_request is not None
    dec = build_decoder(config, mesh, jnp.float32, rng)
    hidden = jnp.asarray(rng.standard_normal((batch.num_tokens, config.hidden_size)), jnp.float32)
    entry = TuneEntry(None, 12, 4)
    ffi, xla, base = run_calls(
        dec,
        batch,
        hidden,
        [
            dict(schedule="weave", collective="ffi", tuning=entry, reducer=fake.overlap),
            dict(schedule="weave", collective="xla"),
            dict(schedule="baseline"),
        ],
    )
    for out in (ffi, xla):
        np.testing.assert_allclose(np.asarray(out), np.asarray(base), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ffi), np.asarray(xla), rtol=1e-6, atol=1e-6)
    fake.check_protocol()
    n = config.num_layers
    # program order: A B | A B per layer, dones interleaved one stage behind, then the last two
    want = [("start", 0), ("start", 1), ("done", 0), ("start", 0), ("done", 1), ("start", 1)]
    for _ in range(n - 1):
        want += [("done", 0), ("start", 0), ("done", 1), ("start", 1)] * 2
    want += [("done", 0), ("done", 1)]
    assert [(op, s) for op, s, _ in fake.log] == want
    ctas = [c for op, _, c in fake.log if op == "start"]
    assert ctas == [4] + [12] * (4 * n - 1)
    # without tuning=, the default entry's CTA counts
    fake.log.clear()
    (again,) = run_calls(
        dec, batch, hidden, [dict(schedule="weave", collective="ffi", reducer=fake.overlap)]
    )
    np.testing.assert_allclose(np.asarray(again), np.asarray(ffi), rtol=1e-6, atol=1e-6)
    assert [c for op, _, c in fake.log if op == "start"] == [8] + [16] * (4 * n - 1)


def test_comm_resolution_and_configuration(cpu_mesh, monkeypatch):
    """Which reducer each (schedule, comm) configures, and ``auto``'s choice."""
    mesh, hidden = cpu_mesh(2), get_config("tiny").hidden_size
    split, whole = plan_batch((5, 9), split=True), plan_batch((5, 9), split=False)
    want = {
        ("baseline", "xla", split): (1, reducers.Psum),
        ("nocomm", "xla", split): (1, reducers.Local),
        ("weave", "local", split): (2, reducers.LocalSharded),
        ("weave", "ffi", split): (2, reducers.Overlap),
        ("weave", "xla", split): (2, reducers.Sharded),
        ("weave", "ffi-sync", split): (2, reducers.Sharded),
        ("weave", "ffi", whole): (1, reducers.Sharded),
    }
    ctx = reducers.ReduceContext("tp", mesh, 1e-6)
    for (schedule, comm, batch), (halves, cls) in want.items():
        got_halves, factory = configure(schedule, comm, batch)
        reducer = factory(ctx)
        assert len(got_halves) == halves and type(reducer) is cls, (schedule, comm)
    assert configure("weave", "ffi-sync", split)[1](ctx).impl == "ffi"
    assert configure("weave", "xla", split)[1](ctx).impl == "xla_rsag"
    with pytest.raises(ValueError, match="resolved"):
        configure("weave", "auto", split)
    assert resolve_collective("auto", mesh, "tp", jnp.float32, split, hidden) == "xla"  # CPU
    with pytest.raises(RuntimeError, match="collective='ffi-sync' is unavailable"):
        resolve_collective("ffi-sync", mesh, "tp", jnp.float32, split, hidden)
    assert resolve_collective("local", mesh, "tp", jnp.float32, split, hidden) == "local"
    monkeypatch.setattr(_ffi, "unavailable_reason", lambda *a, **k: None)
    assert resolve_collective("auto", mesh, "tp", jnp.float32, split, hidden) == "ffi"
    assert resolve_collective("ffi-sync", mesh, "tp", jnp.float32, split, hidden) == "ffi-sync"


def test_unsplit_ffi_is_synchronous(cpu_mesh, rng):
    fake = FakeKernel()
    config, mesh = get_config("tiny"), cpu_mesh(2)
    batch = plan_batch((5, 4), tp=2, split=False)
    dec = build_decoder(config, mesh, jnp.float32, rng)
    hidden = jnp.asarray(rng.standard_normal((batch.num_tokens, config.hidden_size)), jnp.float32)
    ffi, base = run_calls(
        dec,
        batch,
        hidden,
        [
            dict(schedule="weave", collective="ffi", reducer=fake.sync, tuning=DEFAULT_ENTRY),
            dict(schedule="baseline"),
        ],
    )
    np.testing.assert_allclose(np.asarray(ffi), np.asarray(base), rtol=1e-4, atol=1e-4)
    calls = 2 * config.num_layers
    assert fake.log == [("sync", 0, 8)] + [("sync", 0, 16)] * (calls - 1)
    # without tuning=, the plan's entry: here a table whose entry leaves the CTAs to the
    # kernel policy (None)
    table = tuning.TuneTable({("*", 2, 1): tuning.POLICY_ENTRY})
    batch = plan_batch((5, 4), tp=2, split=False, table=table)
    assert batch.tuning == tuning.POLICY_ENTRY
    fake.log.clear()
    run_calls(dec, batch, hidden, [dict(schedule="weave", collective="ffi", reducer=fake.sync)])
    assert fake.log == [("sync", 0, None)] * calls


# ------------------------------------------------------- ordering by data, in the jaxpr ---


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def _has_dot(jaxpr) -> bool:
    return any(
        e.primitive.name == "dot_general" or any(_has_dot(j) for j in _sub_jaxprs(e))
        for e in jaxpr.eqns
    )


def _ffi_jaxpr(jaxpr):
    """The (nested) jaxpr whose own equations hold the ffi calls."""
    if any(e.primitive.name == "ffi_call" for e in jaxpr.eqns):
        return jaxpr
    for e in jaxpr.eqns:
        for sub in _sub_jaxprs(e):
            found = _ffi_jaxpr(sub)
            if found is not None:
                return found
    return None


def data_order_report(jaxpr, start_target, done_target):
    """Per start/done pair (by slot, in program order): the output shapes of the GEMM-bearing
    equations that depend on the start and that the done depends on (ordered between them by
    data, whatever the scheduler does)."""
    eqns = jaxpr.eqns
    producer = {}
    anc = []  # bitset of ancestor equations
    for i, e in enumerate(eqns):
        bits = 0
        for v in e.invars:
            if not isinstance(v, jax.extend.core.Literal) and v in producer:
                p = producer[v]
                bits |= anc[p] | (1 << p)
        anc.append(bits)
        for v in e.outvars:
            producer[v] = i
    gemm = [
        e.primitive.name == "dot_general" or any(_has_dot(j) for j in _sub_jaxprs(e)) for e in eqns
    ]
    open_, pairs = {}, []
    for i, e in enumerate(eqns):
        if e.primitive.name != "ffi_call":
            continue
        slot = int(dict(e.params["attributes"])["slot"])
        if e.params["target_name"] == start_target:
            assert slot not in open_
            open_[slot] = i
        elif e.params["target_name"] == done_target:
            s = open_.pop(slot)
            between = [
                eqns[g].outvars[0].aval.shape
                for g in range(s + 1, i)
                if gemm[g] and anc[g] >> s & 1 and anc[i] >> g & 1
            ]
            pairs.append((slot, eqns[s].outvars[0].aval.shape[0], between))
    assert not open_
    return pairs


def test_ordering_by_data_in_jaxpr(cpu_mesh, rng, monkeypatch):
    """The real start/done calls (traced, not run): between each start and its done there is a
    GEMM of the other half that depends on the start and that the done depends on."""
    if _extension.import_error() is not None:  # the calls' attributes come from its limits
        pytest.skip(f"extension not built: {_extension.import_error()}")
    monkeypatch.setattr(_ffi, "unavailable_reason", lambda *a, **k: None)
    monkeypatch.setattr(Communicator, "unavailable_reason", lambda self, *a, **k: None)
    monkeypatch.setattr(Communicator, "comm_id", 7)  # no workspace: the calls are only traced
    monkeypatch.setattr(_ffi, "register_targets", lambda: True)
    config, mesh = get_config("tiny"), cpu_mesh(2)
    batch = plan_batch((5, 9, 3), tp=2, split=True, offset=-120)
    lens = batch.half_lengths
    assert lens == (8, 9) and batch.cut_request == 1
    dec = build_decoder(config, mesh, jnp.bfloat16, rng)
    graphdef, state = nnx.split(dec)
    hidden = jnp.zeros((batch.num_tokens, config.hidden_size), jnp.bfloat16)

    def f(state, hidden):
        return nnx.merge(graphdef, state)(hidden, batch, schedule="weave", collective="ffi")

    inner = _ffi_jaxpr(jax.make_jaxpr(f)(state, hidden).jaxpr)
    pairs = data_order_report(
        inner, _ffi.TARGETS["allreduce_rmsnorm_start"], _ffi.TARGETS["allreduce_rmsnorm_done"]
    )
    assert len(pairs) == 4 * config.num_layers
    for slot, rows, between in pairs[:-1]:
        assert rows == lens[slot]
        assert between, pairs
        assert any(shape[0] == lens[1 - slot] for shape in between), (slot, between)
    assert pairs[-1][0] == 1 and not pairs[-1][2]  # the last kernel has nothing to hide behind
    targets = [e.params["target_name"] for e in inner.eqns if e.primitive.name == "ffi_call"]
    assert _ffi.TARGETS["allreduce_rmsnorm"] not in targets


# ------------------------------------------------------------------------------------ GPU ---


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_weave_ffi_matches_baseline(ffi_mesh2, rng):
    mesh = ffi_mesh2
    config = get_config("tiny", **GPU_CONFIG)
    batch = plan_batch((300, 500, 212), tp=2, split=True, offset=-80)
    assert batch.half_lengths == (432, 580) and batch.cut_request == 1
    dec = build_decoder(config, mesh, jnp.bfloat16, rng)
    hidden = jnp.asarray(rng.standard_normal((batch.num_tokens, config.hidden_size)), jnp.bfloat16)
    ffi, xla, base = run_calls(
        dec,
        batch,
        hidden,
        [
            dict(schedule="weave", collective="ffi", tuning=TuneEntry(None, 16, 8)),
            dict(schedule="weave", collective="xla"),
            dict(schedule="baseline"),
        ],
        jit_opts=False,
    )
    assert np.isfinite(np.asarray(ffi, np.float32)).all()
    assert rel_err(ffi, base) < 2e-2
    assert rel_err(ffi, xla) < 2e-2
    # unsplit: the synchronous kernel
    whole = plan_batch(batch.request_lengths, tp=2, split=False)
    calls = [dict(schedule="weave", collective="ffi")]
    (sync,) = run_calls(dec, whole, hidden, calls, jit_opts=False)
    assert rel_err(sync, base) < 2e-2


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_compiled_hlo_overlaps(ffi_mesh2, rng):
    """In the compiled HLO of a 2-layer weave-ffi stack, a GEMM of the other half is scheduled
    between every start and its done (all but the stack's last kernel)."""
    mesh = ffi_mesh2
    config = get_config("tiny", **GPU_CONFIG)
    batch = plan_batch((300, 500, 212), tp=2, split=True, offset=-80)
    lens = batch.half_lengths
    dec = build_decoder(config, mesh, jnp.bfloat16, rng)
    graphdef, state = nnx.split(dec)
    hidden = jnp.zeros((batch.num_tokens, config.hidden_size), jnp.bfloat16)

    def f(state, hidden):
        return nnx.merge(graphdef, state)(hidden, batch, schedule="weave", collective="ffi")

    text = jax.jit(f).lower(state, hidden).compile().as_text()
    assert hlo_check.count_targets(text) == {"start": 8, "done": 8, "sync": 0}
    pairs = hlo_check.overlap_report(text)
    report = "\n".join(p.describe() for p in pairs)
    print(report)
    assert hlo_check.overlap_problems(text) == [], report
    for p in pairs[:-1]:
        assert p.rows == lens[p.slot], report
        assert lens[1 - p.slot] in p.gemm_dims(), report
