"""Async scheduling (``EngineConfig.async_scheduling``): step n+1 is scheduled and dispatched
before step n's tokens reach the host. The async engine gives the synchronous engine's token
streams (greedy and seeded sampling; staggered arrivals, stop tokens, stop strings, aborts
mid-stream, ``max_tokens``), frees every block, and never hands a block to a new request while
a dispatched step that writes it is in flight; the scheduler's bookkeeping for steps in flight."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from testutil import SMALL_ENGINE

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.serving import EngineConfig, LLMEngine, SamplingParams
from jax_tokenweave.serving.scheduling.scheduler import Request, Scheduler

CFG = SMALL_ENGINE  # the engine sizes these files share (testutil)


class CharTokenizer:
    """Token t -> one letter (``a`` + t % 26): stop strings of a few letters do occur."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.fixture(scope="module")
def model():
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    return LlamaModel(get_config("tiny"), mesh, dtype=jnp.float32, rngs=nnx.Rngs(7))


def serve(engine, workload, abort_after):
    """Run ``workload`` (``[(arrival call, prompt, params)]``) to the end; a request in
    ``abort_after`` is aborted once it has that many tokens. Returns per request its deltas
    ``(token ids, text, finish reason)`` and its final output."""
    ids, deltas, call = {}, {}, 0
    while len(ids) < len(workload) or engine.has_unfinished():
        for i, (arrival, prompt, params) in enumerate(workload):
            if arrival == call:
                ids[i] = engine.add_request(prompt, params)
                deltas[ids[i]] = []
        for d in engine.step():
            deltas[d.request_id].append((d.token_ids, d.text, d.finish_reason))
            i = next(k for k, v in ids.items() if v == d.request_id)
            made = sum(len(t) for t, _, _ in deltas[d.request_id])
            if not d.finished and abort_after.get(i) == made:
                engine.abort(d.request_id)
        call += 1
    outs = [engine.release(ids[i]) for i in range(len(workload))]
    return [deltas[ids[i]] for i in range(len(workload))], outs


def same(got, want):
    """Equal streams (token ids, text, finish reason of every delta) and final outputs."""
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1], strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        g, w = g.outputs[0], w.outputs[0]
        assert (g.token_logprobs is None) == (w.token_logprobs is None)
        for a, b in zip(g.token_logprobs or [], w.token_logprobs or [], strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-5)


def random_workload(rng, n=9):
    """``n`` requests ``(arrival call, prompt, params)``: greedy or seeded sampling, some with
    logprobs; ``max_tokens`` 1-13 for every third one (request 0: 8), else 5-13."""
    workload = []
    for i in range(n):
        hot = rng.random() < 0.5
        max_tokens = 8 if i == 0 else int(rng.integers(1 if i % 3 == 0 else 5, 14))
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.9 if hot else 0.0,
            top_p=float(rng.uniform(0.5, 1)) if hot else 1.0,
            top_k=int(rng.integers(0, 20)) if hot else 0,
            seed=int(rng.integers(1 << 20)),
            logprobs=None if rng.random() < 0.7 else int(rng.integers(0, 4)),
        )
        workload.append(
            (
                int(rng.integers(0, 8)),
                rng.integers(0, 256, int(rng.integers(1, 42))).tolist(),
                params,
            )
        )
    return workload


@pytest.mark.slow
def test_async_equals_sync(model, rng):
    """Identical streams; then again with stop tokens and stop strings taken from the first
    run's outputs and aborts after a few tokens."""
    tok = CharTokenizer()
    sync = LLMEngine(model, dataclasses.replace(CFG, async_scheduling=False), tokenizer=tok)
    eng = LLMEngine(model, CFG, tokenizer=tok)
    workload = random_workload(rng)
    want = serve(sync, workload, {})
    same(serve(eng, workload, {}), want)
    stopped = []
    for i, ((arrival, prompt, params), out) in enumerate(zip(workload, want[1], strict=True)):
        toks = out.token_ids
        if i % 3 == 1:
            params = dataclasses.replace(params, stop_token_ids=(toks[int(rng.integers(1, 3))],))
        elif i % 3 == 2:
            params = dataclasses.replace(params, stop=(out.text[2:4],))
        stopped.append((arrival, prompt, params))
    aborts = {
        0: int(rng.integers(1, 4)),
        **{int(i): int(rng.integers(1, 6)) for i in rng.choice(len(workload), 2)},
    }
    want = serve(sync, stopped, aborts)
    got = serve(eng, stopped, aborts)
    same(got, want)
    reasons = [o.finish_reason for o in got[1]]
    assert {"abort", "stop", "length"} <= set(reasons) and reasons[0] == "abort"
    for engine in (sync, eng):
        assert engine.scheduler.allocator.num_free == CFG.num_blocks
        assert not engine.scheduler.deferred and not engine.has_unfinished()


@pytest.mark.slow
def test_no_block_reused_while_a_step_writing_it_is_in_flight(model, rng):
    """Every allocation avoids the blocks of the steps dispatched and not yet taken (their
    requests' blocks when dispatched); stops and aborts make the frees wait a step. (A
    preempted request's blocks are freed at once: docs/SERVING.md#servingschedulingscheduler.)"""
    engine = LLMEngine(model, dataclasses.replace(CFG, num_blocks=24))
    in_flight: dict[int, set[int]] = {}
    dispatch, take = engine.runner.dispatch, engine._take_oldest
    allocate = engine.scheduler.allocator.allocate
    preempt, preempted = engine.scheduler._preempt, set()
    seen = {"allocations": 0, "deferred": 0}

    def watched_preempt(seq):
        preempted.update(seq.blocks)
        preempt(seq)

    def watched_dispatch(scheduled, packed, previous=None):
        step = dispatch(scheduled, packed, previous)
        in_flight[id(step)] = {b for q in scheduled.seqs for b in q.blocks}
        return step

    def watched_take():
        done = engine._inflight[0]
        deltas = take()
        del in_flight[id(done)]
        preempted.intersection_update(set().union(*in_flight.values()))
        seen["deferred"] += bool(engine.scheduler.deferred)
        return deltas

    def watched_allocate(count):
        got = allocate(count)
        busy = set().union(*in_flight.values()) - preempted
        assert not busy & set(got), (got, busy)
        seen["allocations"] += bool(busy)
        return got

    engine.runner.dispatch, engine._take_oldest = watched_dispatch, watched_take
    engine.scheduler.allocator.allocate = watched_allocate
    engine.scheduler._preempt = watched_preempt
    workload = [
        (arrival, prompt, dataclasses.replace(params, temperature=0.0))
        for arrival, prompt, params in random_workload(rng, 12)
    ]
    first = serve(LLMEngine(model, dataclasses.replace(CFG, num_blocks=24)), workload, {})[1]
    workload = [
        (
            a,
            p,
            dataclasses.replace(sp, stop_token_ids=(o.token_ids[1],))
            if len(o.token_ids) > 2
            else sp,
        )
        for (a, p, sp), o in zip(workload, first, strict=True)
    ]
    serve(engine, workload, {0: 1, 5: 2})
    assert seen["allocations"] > 0 and seen["deferred"] > 0
    assert engine.scheduler.allocator.num_free == 24 and not in_flight


def test_scheduler_steps_in_flight():
    """Two steps scheduled before the first's tokens: the second's decode takes its token from
    the first (source), positions and counters count the token in flight; a request whose
    last token is in flight is not decoded; a stop found late drops the later token and frees
    the blocks only when the later step is updated."""
    cfg = EngineConfig(
        max_num_batched_tokens=32,
        max_num_seqs=4,
        prefill_tile=8,
        block_size=4,
        num_blocks=16,
        max_model_len=40,
        key_chunk=8,
    )
    s = Scheduler(cfg)
    a = Request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2), 0, frozenset({99}))
    b = Request(
        "b", [4, 5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=9), 0, frozenset({99})
    )
    s.add(a)
    s.add(b)
    one = s.schedule()  # a and b prefill, each samples its first token
    two = s.schedule()  # both decode their in-flight first token
    assert [q.request_id for q in two.decodes] == ["a", "b"]
    assert two.sources == (0, 1) and two.positions == (3, 5) and two.counters == (1, 1)
    assert (a.num_pending, b.num_pending, a.in_flight) == (2, 2, 2)
    s.update(one, [10, 99])  # b stops at step one
    assert b.finish_reason == "stop" and b.blocks and s.deferred == {b}
    assert s.schedule().empty  # a's last token is in flight, b is done
    assert s.update(two, [11, 12]) == [a]  # b's token from step two is dropped
    assert a.output == [10, 11] and a.finish_reason == "length" and b.output == [99]
    assert not s.deferred and s.allocator.num_free == 16 and not s.has_unfinished()
