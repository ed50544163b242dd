// XLA FFI handlers of the paged attention kernels and the RoPE + cache write (typed API).
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
// (q [rows, Hq, D], k_cache, v_cache [NB, BS, KVH, D], tables s32 [G, W], positions s32 [rows])
// -> (out [rows, Hq, D], k_cache, v_cache (aliased to the inputs), work f32 (decode partials)).
// Attributes: tile i32 (rows per group; 1 = decode), splits i32 (decode blocks per row and kv
// head), scale f32.
XLA_FFI_Error* TokenweavePagedAttention(XLA_FFI_CallFrame* call_frame);
// (qkv [rows, Hq + 2 KVH, D], positions s32 [rows], slots s32 [rows], inv_freq f32 [D / 2],
// k_cache, v_cache) -> (q [rows, Hq, D], k_cache, v_cache (aliased)): RoPE and the cache write
// of one step's K/V (rope_cache.h).
XLA_FFI_Error* TokenweaveRopeCacheWrite(XLA_FFI_CallFrame* call_frame);
}  // extern "C"
