"""The serving engine drives every GPU of its tensor-parallel axis from one process: a mesh that
spans processes (one process per GPU, as under ``jax_tokenweave.launch``) is refused up front."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from jax_tokenweave.serving import EngineConfig, LLMEngine
from jax_tokenweave.serving.checks import MODEL_ATTRIBUTES, single_process_mesh


def _mesh_of(processes):
    devices = np.array([SimpleNamespace(process_index=i) for i in processes], dtype=object)
    return SimpleNamespace(devices=devices)


def test_a_mesh_of_several_processes_is_refused():
    """The engine, which schedules and reads results on one host, says so instead of letting
    each process schedule its own steps."""
    with pytest.raises(ValueError, match=r"spans processes \[0, 1\].*one process over all"):
        fake = SimpleNamespace(
            **{**dict.fromkeys(MODEL_ATTRIBUTES), "mesh": _mesh_of([0, 1, 1, 0])}
        )
        LLMEngine(fake, EngineConfig())


def test_a_mesh_of_this_process_passes_and_of_another_is_refused(cpu_mesh):
    single_process_mesh(cpu_mesh(2))
    single_process_mesh(_mesh_of([3, 3]), process=3)
    with pytest.raises(ValueError, match=r"belong to process 3, not to this one \(0\)"):
        single_process_mesh(_mesh_of([3, 3]))
