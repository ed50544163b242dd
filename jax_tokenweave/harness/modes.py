"""Benchmark modes and their measurement on one batch (``e2e_bench.py``, ``breakdown.py``).

A mode: ``baseline``, ``nocomm`` or ``weave-<collective>``, plus ``-nosplit`` / ``@<n>`` (CTAs).
:func:`measure` compiles every mode, checks those that compute the model against ``baseline``
and times them all in one run. Mode names in full: docs/PACKAGE.md#harnessmodes.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from jax_tokenweave.harness import timing
from jax_tokenweave.weave.tuning import DEFAULT_ENTRY, TuneEntry


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of running the stack: schedule, collective, whether the batch may split (None:
    the tuning table decides), and a forced CTA count of the fused kernel (None: the plan's)."""

    schedule: str
    collective: str = "auto"
    split: bool | None = None
    ctas: int | None = None
    algo: str | None = None  # a forced variant of the fused calls (None: the plan's)

    @property
    def name(self) -> str:
        """``baseline`` / ``nocomm`` / ``weave-<collective>`` (+ ``-nosplit``, ``[<algo>]``,
        ``@<ctas>``)."""
        if self.schedule != "weave":
            return self.schedule
        return (
            f"weave-{self.collective}"
            + ("-nosplit" if self.split is False else "")
            + (f"[{self.algo}]" if self.algo is not None else "")
            + (f"@{self.ctas}" if self.ctas is not None else "")
        )

    @property
    def needs_ffi(self) -> bool:
        """Whether the mode runs the fused kernel whatever happens (``auto`` may fall back)."""
        return self.schedule == "weave" and self.collective.startswith("ffi")

    @property
    def reference(self) -> bool:
        """Compared against baseline (``nocomm``'s and ``weave-local``'s outputs are not the
        model's)."""
        return self.schedule == "weave" and self.collective != "local"

    def tuning_for(self, planned: TuneEntry | None) -> TuneEntry | None:
        """The ``tuning=`` override: the plan's entry with this mode's forced CTA count and
        variant (None where the mode forces neither)."""
        if self.ctas is None and self.algo is None:
            return None
        entry = planned or DEFAULT_ENTRY
        if self.ctas is not None:
            entry = dataclasses.replace(entry, num_ctas=self.ctas, first_num_ctas=None)
        if self.algo is not None:
            entry = dataclasses.replace(entry, algo=self.algo)
        return entry


def make_plan(
    config: Any,
    model: str,
    lengths: Sequence[int],
    tp: int,
    *,
    threshold: int | None = None,
    split: bool | None = None,
    table: Any = None,
) -> Any:
    """``weave.plan.plan_batch`` as the library plans a batch of ``model`` (the tuning table's rows
    for its name, else the wildcard rows; ``table`` default: the shipped one), with ``config``'s
    work-balance rule and wave model; ``threshold``/``split`` override the table's decision."""
    from jax_tokenweave.weave.plan import plan_batch

    return plan_batch(
        tuple(lengths),
        tp=tp,
        split=split,
        model=model,
        config=config,
        threshold=threshold,
        table=table,
    )


def compile_forward(
    decoder: Any, plan: Any, hidden: jax.Array, **kwargs: Any
) -> tuple[Callable[[], jax.Array], float, str | None]:
    """Compile ``decoder(hidden, plan, **kwargs)`` (``schedule=``, ``collective=``, ``tuning=``).

    Returns ``(run, compile seconds, compiled HLO text)`` (the text None where the backend
    gives none: ``jax.stages.Compiled.as_text``); ``run()`` calls the executable on
    ``hidden`` (asynchronously, like any JAX call).
    """
    graphdef, state = nnx.split(decoder)

    def forward(state: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(x, plan, **kwargs)

    start = time.perf_counter()
    compiled = jax.jit(forward).lower(state, hidden).compile()
    seconds = time.perf_counter() - start
    return (lambda: compiled(state, hidden)), seconds, compiled.as_text()


F32_MARGIN = 1.5
"""With a float32 reference, a mode may be this much further from it than bf16 baseline is."""


def float32_copy(decoder: Any) -> Any:
    """A float32 ``WeaveDecoder`` holding ``decoder``'s weights (cast on the devices, same
    shardings): the reference for models whose bf16 runs differ by more than rounding (an MoE
    router's top-k flips on near ties, so two valid bf16 orders of the same sums disagree)."""
    import jax.numpy as jnp

    from jax_tokenweave.nn.decoder import WeaveDecoder

    ref = WeaveDecoder(
        decoder.config,
        decoder.mesh,
        axis_name=decoder.axis_name,
        dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    nnx.update(ref, jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(decoder, nnx.Param)))
    return ref


def float32_output(reference: Any, config: Any, model: str, lengths, hidden) -> jax.Array:
    """The baseline output of ``reference`` (:func:`float32_copy`) on the batch of ``lengths``
    and ``hidden`` [T, H], for :func:`measure`. Compute every batch's before timing anything,
    then drop the copy: it holds twice the bf16 weights' memory."""
    import jax.numpy as jnp

    plan = make_plan(config, model, lengths, reference.tp, split=False)
    run, _, _ = compile_forward(reference, plan, hidden.astype(jnp.float32), schedule="baseline")
    return jax.block_until_ready(run())


def _check(fns, info, table, tol: float, ref32: jax.Array | None) -> None:
    """Drop from ``fns`` (status ``mismatch``) each mode that computes the model and is further
    from baseline than ``tol``, or with ``ref32``, from it than baseline is (``measure``)."""
    if "baseline" not in fns:
        return
    base = fns["baseline"]()
    bound, base_f32 = tol, None
    if ref32 is not None:
        base_f32 = timing.rel_error(base, ref32)
        info["baseline"]["rel_err_f32"] = base_f32
        bound = max(tol, F32_MARGIN * base_f32)
    for name in list(fns):
        if not table[name].reference:
            continue
        out = fns[name]()
        rel = info[name]["rel_err"] = timing.rel_error(out, base)
        if ref32 is not None:
            rel = info[name]["rel_err_f32"] = timing.rel_error(out, ref32)
        del out
        if not rel <= bound:
            against = "vs baseline" if ref32 is None else f"vs float32 (baseline's {base_f32:.3g})"
            info[name].update(
                status="mismatch", reason=f"relative error {rel:.3g} {against} > {bound:.3g}"
            )
            del fns[name]


def measure(
    decoder: Any,
    config: Any,
    model: str,
    lengths: Sequence[int],
    hidden: jax.Array,
    modes: Mapping[str, Mode],
    *,
    tol: float,
    warmup: int,
    iters: int,
    ffi_reason: str | None = None,
    reference: jax.Array | None = None,
    device_time: Callable[[Callable[[], Any]], dict[str, Any]] | None = None,
    ahead: int = 1,
) -> dict[str, dict[str, Any]]:
    """Compile, check and time ``modes`` on one batch; ``{name: info}`` for each mode.

    ``lengths``/``hidden``: the batch's request lengths and [T, H] input; ``ffi_reason``: why
    the fused kernel cannot run (modes that need it are skipped). ``baseline`` is compiled
    anyway: modes that compute the model over ``tol`` from it are ``mismatch``, not timed; with
    ``reference`` (:func:`float32_output`) each ``rel_err_f32`` may be ``F32_MARGIN`` x
    baseline's. ``device_time``: a timed run -> ``{"median", "range"}`` ms or ``{"reason"}``
    (``step_profile.busy_ms``): ``device_ms``/``_range``/``_reason``/``device_class_ms``.
    ``info``: ``status``, ``reason``, ``compile_s``, ``split``, ``half_lengths``, ``tuning``,
    errors and ``timing.Stats.summary`` (``ahead``: runs per sample, :func:`timing.time_once`)."""
    tp = decoder.tp
    fns: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    table = {"baseline": Mode("baseline"), **modes}
    for name, mode in table.items():
        if mode.needs_ffi and ffi_reason is not None:
            info[name] = {"status": "skipped", "reason": f"ffi unavailable: {ffi_reason}"}
            continue
        try:
            plan = make_plan(config, model, lengths, tp, split=mode.split)
            forced = mode.tuning_for(plan.tuning)
            fns[name], seconds, _ = compile_forward(
                decoder,
                plan,
                hidden,
                schedule=mode.schedule,
                collective=mode.collective,
                tuning=forced,
            )
            entry = forced or plan.tuning
            info[name] = {
                "status": "ok",
                "compile_s": seconds,
                "split": plan.is_split,
                "half_lengths": [h.length for h in plan.halves],
                "tuning": dataclasses.asdict(entry) if entry else None,
            }
        except Exception as err:  # a mode that fails must not end the sweep
            info[name] = {"status": "error", "reason": one_line(err)}
            traceback.print_exc(limit=3)
    _check(fns, info, table, tol, reference)
    timed = {n: fns[n] for n in modes if n in fns}
    if timed:
        for name, stats in timing.benchmark(timed, warmup=warmup, iters=iters, ahead=ahead).items():
            info[name].update(stats.summary())
        if device_time is not None:
            for name, fn in timed.items():
                dev = device_time(fn)
                if "reason" in dev:
                    info[name]["device_reason"] = dev["reason"]
                else:
                    info[name].update(device_ms=dev["median"], device_ms_range=dev["range"])
                    if "classes" in dev:
                        info[name]["device_class_ms"] = dev["classes"]
    return {name: info[name] for name in modes}


def one_line(err: BaseException) -> str:
    """An exception as one short line: ``Type: first line of the message``."""
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:300] if text else type(err).__name__
