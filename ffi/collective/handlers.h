// XLA FFI handlers (typed API) of the fused AllReduce + residual + RMSNorm op.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
// One call: (partial [T,H], residual [q,H], weight f32 [H]) -> (normed [T,H], residual_out
// [q,H]) on XLA's stream. Attributes: comm_id i64, slot i32, eps f32, num_ctas i32, algo i32.
XLA_FFI_Error* TokenweaveAllreduceRmsnorm(XLA_FFI_CallFrame* call_frame);
// The same, not command-buffer compatible: what the copy-engine variant ("ce") is called by.
XLA_FFI_Error* TokenweaveAllreduceRmsnormUncaptured(XLA_FFI_CallFrame* call_frame);
// Same operands/attributes; runs the kernel on the device's high-priority side stream after an
// event recorded on XLA's stream, and records the slot's done-event.
XLA_FFI_Error* TokenweaveAllreduceRmsnormStart(XLA_FFI_CallFrame* call_frame);
// (normed, residual_out, partial, residual, weight) -> (normed, residual_out), aliased: XLA's
// stream waits on the slot's done-event. Attributes: comm_id i64, slot i32.
XLA_FFI_Error* TokenweaveAllreduceRmsnormDone(XLA_FFI_CallFrame* call_frame);
}  // extern "C"
