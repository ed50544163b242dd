// Paged attention (paged_attention.h): the entry point picks the decode kernels
// (paged_decode.cu) for tile == 1 and the tensor-core prompt-tile kernel (paged_prefill.cu)
// above. Both read the block table and the positions on the device and keep the softmax in
// float32 with base-2 exponentials (logits pre-scaled by scale * log2(e)).
#include "paged_attention.h"

namespace tokenweave {
namespace attn {
cudaError_t LaunchDecodeAttention(const AttentionParams& p, AttnDType dtype, cudaStream_t stream);
cudaError_t LaunchPrefillAttention(const AttentionParams& p, AttnDType dtype, cudaStream_t stream);
}  // namespace attn

bool AttentionShapeSupported(int head_dim, int group) {
  return (head_dim == 64 || head_dim == 128) &&
         (group == 1 || group == 2 || group == 4 || group == 8);
}

cudaError_t LaunchPagedAttention(const AttentionParams& p, AttnDType dtype, cudaStream_t stream) {
  if (p.groups == 0) return cudaSuccess;
  return p.tile > 1 ? attn::LaunchPrefillAttention(p, dtype, stream)
                    : attn::LaunchDecodeAttention(p, dtype, stream);
}

}  // namespace tokenweave
