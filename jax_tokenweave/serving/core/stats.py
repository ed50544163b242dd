"""``EngineStats``: what an engine has run, counted per step."""

from __future__ import annotations

import dataclasses

from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving.runner import batch as batch_lib
from jax_tokenweave.serving.scheduling.scheduler import ScheduledStep


@dataclasses.dataclass
class EngineStats:
    """Counts since the engine was made: ``steps``, ``split_steps`` (woven in two halves),
    ``cut_steps`` (a request's prompt chunk cut by the split), ``tokens`` (real rows run)."""

    steps: int = 0
    split_steps: int = 0
    cut_steps: int = 0
    tokens: int = 0

    def record(self, step: ScheduledStep, layout: batch_lib.StepLayout) -> None:
        """Count one dispatched ``step`` packed as ``layout``."""
        self.steps += 1
        self.tokens += len(step.decodes) + sum(c.length for c in step.chunks)
        if layout.plan.is_split:
            self.split_steps += 1
            cut, row = layout.plan.halves[1].start, layout.decode_rows
            for c in step.chunks:
                self.cut_steps += row < cut < row + c.length
                row += ceil_div(c.length, layout.tile) * layout.tile
