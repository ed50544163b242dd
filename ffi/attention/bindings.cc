// The attention's bindings in the extension module (ffi/module.h): the XLA FFI handlers of
// the paged attention and the RoPE + cache write as capsules, which
// jax_tokenweave.serving.attention.attention_kernel registers as FFI targets.
#include <nanobind/nanobind.h>

#include "attention_handlers.h"
#include "module.h"

namespace nb = nanobind;

void tokenweave::BindAttention(nb::module_& m) {
  m.def("attention_handlers", [] {
    nb::dict d;
    d["paged_attention"] = nb::capsule(reinterpret_cast<void*>(TokenweavePagedAttention));
    d["rope_cache_write"] = nb::capsule(reinterpret_cast<void*>(TokenweaveRopeCacheWrite));
    return d;
  });
}
