// XLA FFI handler that copies its operands into its results on XLA's stream, and that XLA never
// captures into a command buffer (it declares no command-buffer trait). The serving step puts
// one at its start (inputs that are new buffers every step -> buffers of the step's own) and one
// at its end (results -> the step's outputs), so the command buffer between them touches only
// addresses that stay the same from step to step and XLA replays its CUDA graph unchanged.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
// (x_0, ..., x_n) -> (copy of x_0, ..., copy of x_n): any dtypes and shapes, one result per
// operand, each the operand's shape and dtype.
XLA_FFI_Error* TokenweaveStage(XLA_FFI_CallFrame* call_frame);
}  // extern "C"
