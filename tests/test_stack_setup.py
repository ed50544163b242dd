"""``schedules.stack_setup``, the one setup of ``WeaveDecoder`` and the serving step: the CTA
counts' default, weave on one device, an injected reducer, and a refused comm."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.weave import reducers
from jax_tokenweave.weave import tuning as tuning_lib
from jax_tokenweave.weave.plan import plan_batch
from jax_tokenweave.weave.schedules import stack_setup
from jax_tokenweave.weave.tuning import TuneEntry

CONFIG = get_config("tiny")


def _mesh(n: int) -> Mesh:
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    return Mesh(np.array(jax.devices()[:n]), ("tp",))


def _setup(mesh, batch, **kw):
    return stack_setup(CONFIG, mesh, "tp", np.float32, batch, **kw)


def test_default_ctas_come_from_the_tuning_table_for_both_callers():
    mesh = _mesh(2)
    batch = dataclasses.replace(plan_batch((96, 160), tp=2, split=True), tuning=None)
    want = tuning_lib.lookup(tuning_lib.model_name(CONFIG), 2, batch.num_tokens)
    assert _setup(mesh, batch, schedule="weave", collective="xla").tuning == want
    forced = TuneEntry(None, 7)
    assert _setup(mesh, batch, schedule="weave", collective="xla", tuning=forced).tuning == forced


def test_weave_auto_on_one_device_runs_as_baseline_but_explicit_comm_keeps_weave():
    mesh = _mesh(1)
    batch = plan_batch((256,), tp=1, split=True)
    auto = _setup(mesh, batch, schedule="weave", collective="auto")
    assert len(auto.halves) == 1 and auto.reducer is reducers.Psum
    xla = _setup(mesh, batch, schedule="weave", collective="xla")
    assert len(xla.halves) == 2 and xla.reducer is not reducers.Psum


def test_an_injected_reducer_keeps_the_schedules_halves():
    mesh = _mesh(2)
    batch = plan_batch((96, 160), tp=2, split=True)
    setup = _setup(mesh, batch, schedule="weave", collective="auto", reducer=reducers.Local)
    assert setup.reducer is reducers.Local and setup.halves == batch.halves


def test_ffi_refused_on_cpu_says_why():
    mesh = _mesh(2)
    batch = plan_batch((96, 160), tp=2, split=True)
    with pytest.raises(RuntimeError, match="unavailable"):
        _setup(mesh, batch, schedule="weave", collective="ffi")
