// XLA FFI handlers of the paged attention kernels (paged_attention.h) and of the RoPE + cache
// write (rope_cache.h): each validates its buffers against each other and launches on XLA's
// stream. They keep no per-call host state, so XLA command buffers may capture them.
#include "attention_handlers.h"

#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include "paged_attention.h"
#include "rope_cache.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace tokenweave {
namespace {

constexpr int kMaxSplits = 256;  // decode blocks per (row, kv head)

std::string Dims(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

ffi::Error Bad(const std::string& what, const char* op = "paged_attention") {
  return ffi::Error::InvalidArgument(std::string("jax-tokenweave ") + op + ": " + what);
}

ffi::Error Cuda(cudaError_t e, const char* what, const char* op = "paged_attention") {
  return ffi::Error::Internal(std::string("jax-tokenweave ") + op + ": " + what + ": " +
                              cudaGetErrorString(e));
}

// An aliased output that XLA gave a buffer of its own gets the input's contents first.
ffi::Error CopyIfNotAliased(const ffi::AnyBuffer& in, void* out, cudaStream_t stream,
                            const char* op) {
  if (out == in.untyped_data()) return ffi::Error::Success();
  if (cudaError_t e = cudaMemcpyAsync(out, in.untyped_data(), in.size_bytes(),
                                      cudaMemcpyDeviceToDevice, stream);
      e != cudaSuccess)
    return Cuda(e, "copying the cache", op);
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                              ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> live,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_out,
                              ffi::Result<ffi::AnyBuffer> v_out,
                              ffi::Result<ffi::Buffer<ffi::F32>> work, int32_t tile, int32_t splits,
                              float scale) {
  AttnDType dtype;
  switch (q.element_type()) {
    case ffi::DataType::BF16: dtype = AttnDType::kBF16; break;
    case ffi::DataType::F16: dtype = AttnDType::kF16; break;
    default: return Bad("q must be bfloat16 or float16");
  }
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return Bad("want q [rows, Hq, D], caches [NB, BS, KVH, D], tables [G, W]; got q " + Dims(qd) +
               ", cache " + Dims(kd) + ", tables " + Dims(td));
  if (k_cache.element_type() != q.element_type() || v_cache.element_type() != q.element_type() ||
      Dims(v_cache.dimensions()) != Dims(kd))
    return Bad("the caches must share q's dtype and one shape; got " + Dims(kd) + " and " +
               Dims(v_cache.dimensions()));
  const int64_t rows = qd[0], hq = qd[1], d = qd[2], kvh = kd[2];
  if (kd[3] != d || kvh < 1 || hq % kvh != 0 || !AttentionShapeSupported(d, hq / kvh))
    return Bad("unsupported heads: q " + Dims(qd) + ", cache " + Dims(kd) +
               " (head_dim 64 or 128, 1, 2, 4 or 8 query heads per kv head)");
  if (tile < 1 || rows != td[0] * tile || positions.dimensions().size() != 1 ||
      positions.dimensions()[0] != rows)
    return Bad("want rows = groups * tile and one position per row; got q " + Dims(qd) +
               ", tables " + Dims(td) + ", tile " + std::to_string(tile) + ", positions " +
               Dims(positions.dimensions()));
  if (Dims(out->dimensions()) != Dims(qd) || out->element_type() != q.element_type())
    return Bad("the output must match q");
  if (live.element_count() != 1)
    return Bad("live must hold one int32, got " + Dims(live.dimensions()));
  AttentionParams p{};
  p.q = q.untyped_data();
  p.k_cache = k_cache.untyped_data();
  p.v_cache = v_cache.untyped_data();
  p.tables = tables.typed_data();
  p.positions = positions.typed_data();
  p.live = live.typed_data();
  p.out = out->untyped_data();
  p.work = work->typed_data();
  p.groups = static_cast<int32_t>(td[0]);
  p.tile = tile;
  p.hq = static_cast<int32_t>(hq);
  p.kvh = static_cast<int32_t>(kvh);
  p.head_dim = static_cast<int32_t>(d);
  p.block_size = static_cast<int32_t>(kd[1]);
  p.width = static_cast<int32_t>(td[1]);
  p.num_blocks = static_cast<int32_t>(kd[0]);
  p.scale = scale;
  if (p.num_blocks < 1 || p.block_size < 1 || p.width < 1) return Bad("empty cache or table");
  if (tile == 1) {
    if (splits < 1 || splits > kMaxSplits)
      return Bad("splits must be in [1, " + std::to_string(kMaxSplits) + "], got " +
                 std::to_string(splits));
    p.splits = splits;
    const int64_t need = rows * kvh * p.splits * (hq / kvh) * (d + 2);
    if (static_cast<int64_t>(work->element_count()) < need)
      return Bad("work buffer holds " + std::to_string(work->element_count()) +
                 " floats, the decode kernel needs " + std::to_string(need));
  }
  // The caches are aliased outputs: XLA hands back the same buffers (copy where it did not).
  for (auto [from, to] :
       {std::pair{&k_cache, k_out->untyped_data()}, std::pair{&v_cache, v_out->untyped_data()}})
    if (ffi::Error e = CopyIfNotAliased(*from, to, stream, "paged_attention"); e.failure())
      return e;
  if (cudaError_t e = LaunchPagedAttention(p, dtype, stream); e != cudaSuccess)
    return Cuda(e, "kernel launch");
  return ffi::Error::Success();
}

constexpr const char* kRope = "rope_cache_write";

ffi::Error RopeCacheImpl(cudaStream_t stream, ffi::AnyBuffer qkv, ffi::Buffer<ffi::S32> positions,
                         ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> inv_freq,
                         ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                         ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> k_out,
                         ffi::Result<ffi::AnyBuffer> v_out) {
  const ffi::DataType t = qkv.element_type();
  if (t != ffi::DataType::BF16 && t != ffi::DataType::F16)
    return Bad("qkv must be bfloat16 or float16", kRope);
  const auto xd = qkv.dimensions(), kd = k_cache.dimensions(), od = q_out->dimensions();
  if (xd.size() != 3 || kd.size() != 4 || od.size() != 3)
    return Bad(
        "want qkv [rows, Hq + 2 KVH, D], caches [NB, BS, KVH, D], q [rows, Hq, D]; got "
        "qkv " +
            Dims(xd) + ", cache " + Dims(kd) + ", q " + Dims(od),
        kRope);
  const int64_t rows = xd[0], d = xd[2], kvh = kd[2], hq = od[1];
  if (od[0] != rows || od[2] != d || kd[3] != d || xd[1] != hq + 2 * kvh || hq < 1 || kvh < 1)
    return Bad("heads do not add up: qkv " + Dims(xd) + ", cache " + Dims(kd) + ", q " + Dims(od),
               kRope);
  if (!RopeCacheShapeSupported(static_cast<int>(d)))
    return Bad("head_dim must be a multiple of 16, got " + std::to_string(d), kRope);
  if (k_cache.element_type() != t || v_cache.element_type() != t || q_out->element_type() != t ||
      Dims(v_cache.dimensions()) != Dims(kd))
    return Bad("qkv, q and the caches must share a dtype, the caches one shape", kRope);
  if (positions.element_count() != static_cast<size_t>(rows) ||
      slots.element_count() != static_cast<size_t>(rows) ||
      inv_freq.element_count() != static_cast<size_t>(d / 2))
    return Bad("want positions and slots [" + std::to_string(rows) + "], inv_freq [" +
                   std::to_string(d / 2) + "]; got " + Dims(positions.dimensions()) + ", " +
                   Dims(slots.dimensions()) + ", " + Dims(inv_freq.dimensions()),
               kRope);
  for (auto [from, to] :
       {std::pair{&k_cache, k_out->untyped_data()}, std::pair{&v_cache, v_out->untyped_data()}})
    if (ffi::Error e = CopyIfNotAliased(*from, to, stream, kRope); e.failure()) return e;
  RopeCacheParams p{};
  p.qkv = qkv.untyped_data();
  p.positions = positions.typed_data();
  p.slots = slots.typed_data();
  p.inv_freq = inv_freq.typed_data();
  p.q_out = q_out->untyped_data();
  p.k_cache = k_out->untyped_data();
  p.v_cache = v_out->untyped_data();
  p.rows = static_cast<int32_t>(rows);
  p.hq = static_cast<int32_t>(hq);
  p.kvh = static_cast<int32_t>(kvh);
  p.head_dim = static_cast<int32_t>(d);
  p.num_blocks = static_cast<int32_t>(kd[0]);
  p.block_size = static_cast<int32_t>(kd[1]);
  if (cudaError_t e = LaunchRopeCache(p, t == ffi::DataType::BF16, stream); e != cudaSuccess)
    return Cuda(e, "kernel launch", kRope);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tokenweave

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenweavePagedAttention, tokenweave::PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // q [rows, Hq, D]
                                  .Arg<ffi::AnyBuffer>()         // k_cache [NB, BS, KVH, D]
                                  .Arg<ffi::AnyBuffer>()         // v_cache [NB, BS, KVH, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables [G, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [rows]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live [1] (decode rows)
                                  .Ret<ffi::AnyBuffer>()         // out [rows, Hq, D]
                                  .Ret<ffi::AnyBuffer>()         // k_cache (aliased)
                                  .Ret<ffi::AnyBuffer>()         // v_cache (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // work (decode partials)
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("splits")
                                  .Attr<float>("scale"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenweaveRopeCacheWrite, tokenweave::RopeCacheImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // qkv [rows, Hq + 2 KVH, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [rows]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [rows]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // inv_freq [D / 2]
                                  .Arg<ffi::AnyBuffer>()         // k_cache [NB, BS, KVH, D]
                                  .Arg<ffi::AnyBuffer>()         // v_cache [NB, BS, KVH, D]
                                  .Ret<ffi::AnyBuffer>()         // q [rows, Hq, D], rotated
                                  .Ret<ffi::AnyBuffer>()         // k_cache (aliased)
                                  .Ret<ffi::AnyBuffer>(),        // v_cache (aliased)
                              {ffi::Traits::kCmdBufferCompatible});
