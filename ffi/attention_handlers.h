// XLA FFI handler of the paged attention kernels (typed API).
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
// (q [rows, Hq, D], k_cache, v_cache [NB, BS, KVH, D], tables s32 [G, W], positions s32 [rows])
// -> (out [rows, Hq, D], k_cache, v_cache (aliased to the inputs), work f32 (decode partials)).
// Attributes: tile i32 (rows per group; 1 = decode), splits i32 (decode blocks per row and kv
// head), scale f32.
XLA_FFI_Error* TokenweavePagedAttention(XLA_FFI_CallFrame* call_frame);
}  // extern "C"
