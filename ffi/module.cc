// nanobind module jax_tokenweave.kernel._tokenweave_ffi, the one CUDA extension of the package
// (loaded by jax_tokenweave/kernel/_extension.py): the collective's bindings and the
// attention's (module.h). Importing it calls no CUDA function.
#include <nanobind/nanobind.h>

#include "module.h"

NB_MODULE(_tokenweave_ffi, m) {
  m.doc() =
      "jax-tokenweave fused AllReduce + residual + RMSNorm and paged attention (XLA FFI, CUDA)";
  tokenweave::BindCollective(m);
  tokenweave::BindAttention(m);
}
