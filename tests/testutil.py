"""Helpers shared by the tests: the relative error against a reference, a randomised
``WeaveDecoder``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_tokenweave.layers import WeaveDecoder
from jax_tokenweave.params import named_params


def build_decoder(config, mesh, dtype, rng: np.random.Generator) -> WeaveDecoder:
    """A decoder with random weights, norm weights randomised too (so a swapped norm shows)."""
    dec = WeaveDecoder(config, mesh, dtype=dtype, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    norms = {name: 1 + 0.2 * rng.standard_normal(p[...].shape)
             for name, p in named_params(dec).items() if name.endswith(("norm", "layernorm"))}
    dec.load_weights(norms, strict=False)
    return dec


def _f64(x) -> np.ndarray:
    if isinstance(x, jax.Array):  # bf16 has no NumPy float64 cast of its own
        x = x.astype(jnp.float32)
    return np.asarray(x, np.float64)


def rel_err(got, want) -> float:
    """``||got - want|| / ||want||`` in float64 (JAX arrays of any float dtype, or NumPy)."""
    got, want = _f64(got), _f64(want)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))
