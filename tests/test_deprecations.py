"""Deprecating a name in place (``jax_tokenweave._deprecation``): an old module path, attribute or
keyword warns at its user with a ``DeprecationWarning`` naming the new one and gives the same
object. The names deprecated in 0.3.0 are gone in 0.4.0, with the ``_legacy`` package."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

import jax_tokenweave
from jax_tokenweave import _deprecation


def test_renamed_attribute_warns_at_the_user_and_gives_the_new_object(monkeypatch):
    module = types.ModuleType("jax_tokenweave_fake")
    module.new_name = object()  # type: ignore[attr-defined]
    renamed = {"old_name": "new_name", "plan": "jax_tokenweave.weave.plan:plan_batch"}
    module.__getattr__ = lambda name: _deprecation.renamed_attribute(  # type: ignore[method-assign]
        module.__name__, name, renamed
    )
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.warns(DeprecationWarning, match="fake.old_name is deprecated: use .*new_name") as w:
        assert module.old_name is module.new_name  # type: ignore[attr-defined]
    assert w[0].filename == __file__
    from jax_tokenweave.weave.plan import plan_batch

    with pytest.warns(DeprecationWarning, match=r"use jax_tokenweave\.weave\.plan\.plan_batch"):
        assert module.plan is plan_batch  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        module.nope  # type: ignore[attr-defined]  # noqa: B018


def test_renamed_keyword_takes_the_old_value_with_a_warning():
    def call(*, collective: str = "auto", comm: str | None = None) -> str:
        return _deprecation.renamed_keyword("call", "comm", comm, "collective", collective)

    assert call(collective="xla") == "xla"
    with pytest.warns(DeprecationWarning, match=r"call\(comm=...\) is deprecated: use collective="):
        assert call(comm="ffi") == "ffi"


def test_moved_module_is_the_new_module(tmp_path, monkeypatch):
    package = tmp_path / "jax_tokenweave_old"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "split.py").write_text(
        "from jax_tokenweave._deprecation import moved_module\n\n"
        'moved_module(__name__, "jax_tokenweave.weave.plan")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("jax_tokenweave_old", "jax_tokenweave_old.split"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.warns(DeprecationWarning, match="old.split is deprecated: it moved to") as w:
        from jax_tokenweave_old import split  # type: ignore[import-not-found]
    assert split is importlib.import_module("jax_tokenweave.weave.plan")
    assert w[0].filename == __file__


def test_a_message_must_name_the_package():
    """The tests turn ``jax_tokenweave...`` DeprecationWarnings into errors (pyproject.toml)."""
    with pytest.raises(ValueError, match="must start with 'jax_tokenweave'"):
        _deprecation.deprecated("layers is deprecated")


def test_the_names_deprecated_in_0_3_0_are_gone():
    """0.4.0 removed them (CHANGELOG.md, 0.4.0, Removed): the old module paths, the ``_legacy``
    package and the package's ``__path__`` entry for it, and the renamed names."""
    # (an editable install with the CUDA extension adds its build folder: only _legacy is gone)
    assert not [p for p in jax_tokenweave.__path__ if "_legacy" in p]
    for old in ("jax_tokenweave._legacy", "jax_tokenweave.layers", "jax_tokenweave.ops"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    from jax_tokenweave.serving import EngineConfig, LLMEngine
    from jax_tokenweave.weave import plan, schedules

    assert not hasattr(schedules, "COMMS") and not hasattr(LLMEngine, "generate")
    assert not hasattr(plan.BatchPlan, "split") and not hasattr(EngineConfig, "comm")
    with pytest.raises(TypeError, match="comm"):
        EngineConfig(comm="xla")  # type: ignore[call-arg]


def test_comm_option_is_gone(capsys):
    from jax_tokenweave.harness import job

    assert job.build_parser().parse_args(["--collective", "xla"]).collective == "xla"
    with pytest.raises(SystemExit):
        job.build_parser().parse_args(["--comm", "xla"])
    assert "unrecognized arguments: --comm" in capsys.readouterr().err


def test_the_per_rank_prefill_attention_moved_to_nn_prefill():
    from jax_tokenweave.nn import prefill, stack

    with pytest.warns(DeprecationWarning, match=r"stack\.PrefillAttention is deprecated: use "):
        assert stack.PrefillAttention is prefill.PrefillAttentionRank


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("blocks", "scheduling.blocks"),
        ("compile_count", "compilation.compile_count"),
        ("engine", "core.engine"),
        ("llm", "offline.llm"),
        ("oneshot", "offline.oneshot"),
    ],
)
def test_serving_modules_moved_into_rooms_warn_and_are_the_new_modules(monkeypatch, old, new):
    """0.4.0 grouped ``serving`` into rooms; the old paths of the modules that hold public names
    warn and are the new modules until 0.5.0 (CHANGELOG.md, Deprecated)."""
    monkeypatch.delitem(sys.modules, f"jax_tokenweave.serving.{old}", raising=False)
    with pytest.warns(DeprecationWarning, match=rf"serving\.{old} is deprecated: it moved to"):
        module = importlib.import_module(f"jax_tokenweave.serving.{old}")
    assert module is importlib.import_module(f"jax_tokenweave.serving.{new}")
