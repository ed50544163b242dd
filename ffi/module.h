// The extension module's parts (module.cc), each bound by the file beside its kernels: the
// collective (collective/bindings.cc, used from jax_tokenweave.kernel) and the attention
// (attention/bindings.cc, used from jax_tokenweave.serving.attention).
#pragma once

#include <nanobind/nanobind.h>

namespace tokenweave {

// The fused AllReduce + residual + RMSNorm kernel: handlers, communicators, limits, loopback.
void BindCollective(nanobind::module_& m);
// The paged attention and RoPE + cache-write kernels: their handlers.
void BindAttention(nanobind::module_& m);

}  // namespace tokenweave
