"""The benchmark harness: the main job and the helpers of ``benchmarks/*.py``; importing any of
them sets nothing.

``python -m jax_tokenweave.bench`` (``jax_tokenweave/bench.py``) runs the main job (``job``,
``report``); ``benchmarking``, ``modes``, ``timing`` and ``hlo_check`` serve it and
``benchmarks/*.py``. The modules' roles: docs/PACKAGE.md#harness.
"""
