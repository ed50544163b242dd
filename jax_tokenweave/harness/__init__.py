"""The main job and the benchmarks' helpers; importing any of them sets nothing.

``python -m jax_tokenweave.bench`` runs the main job (``bench.job``, ``bench.report``);
``benchmarking``, ``modes``, ``timing`` and ``hlo_check`` serve it and ``benchmarks/*.py``.
The modules' roles: docs/PACKAGE.md#bench.
"""
