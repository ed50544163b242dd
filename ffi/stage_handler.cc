// The stage copy (stage_handler.h): one cudaMemcpyAsync per operand, on XLA's stream.
#include "stage_handler.h"

#include <cuda_runtime_api.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace tokenweave {
namespace {

ffi::Error StageImpl(cudaStream_t stream, ffi::RemainingArgs operands,
                     ffi::RemainingRets results) {
  if (operands.size() != results.size())
    return ffi::Error::InvalidArgument("jax-tokenweave stage: " +
                                       std::to_string(operands.size()) + " operands but " +
                                       std::to_string(results.size()) + " results");
  for (size_t i = 0; i < operands.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> from = operands.get<ffi::AnyBuffer>(i);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> to = results.get<ffi::AnyBuffer>(i);
    if (!from.has_value()) return from.error();
    if (!to.has_value()) return to.error();
    if ((*to)->size_bytes() != from->size_bytes() ||
        (*to)->element_type() != from->element_type())
      return ffi::Error::InvalidArgument("jax-tokenweave stage: result " + std::to_string(i) +
                                         " differs from its operand in dtype or size");
    if (from->size_bytes() == 0 || (*to)->untyped_data() == from->untyped_data()) continue;
    if (cudaError_t e = cudaMemcpyAsync((*to)->untyped_data(), from->untyped_data(),
                                        from->size_bytes(), cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess)
      return ffi::Error::Internal(std::string("jax-tokenweave stage: copy ") +
                                  std::to_string(i) + ": " + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tokenweave

// No ffi::Traits::kCmdBufferCompatible: XLA runs this call outside its command buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenweaveStage, tokenweave::StageImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()   // x_0 .. x_n
                                  .RemainingRets());  // copies of x_0 .. x_n
