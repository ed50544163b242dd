"""decode_bench with runner.UNSPLIT_K_MIN_ROWS from $MINROWS (a scratch experiment)."""

import os
import runpy
import sys

from jax_tokenweave.serving import runner

runner.UNSPLIT_K_MIN_ROWS = int(os.environ["MINROWS"])
sys.argv = ["decode_bench.py", *sys.argv[1:]]
runpy.run_path("benchmarks/decode_bench.py", run_name="__main__")
