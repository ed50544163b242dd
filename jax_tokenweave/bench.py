"""``python -m jax_tokenweave.bench``: the main job (:mod:`jax_tokenweave.harness.job`)."""

from __future__ import annotations

import sys

from jax_tokenweave.harness.job import main

if __name__ == "__main__":
    sys.exit(main())
