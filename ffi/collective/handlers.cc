#include "handlers.h"

#include <cuda_runtime_api.h>

#include <string>

#include "comm.h"
#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace tokenweave {
namespace {

std::string Shape(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax-tokenweave: " + what);
}

// Everything a launch needs, validated.
struct Call {
  Comm* comm = nullptr;
  DeviceState* dev = nullptr;
  KernelParams params{};
  DType dtype = DType::kF32;
  Algo algo = Algo::kTwoShot;
  int num_ctas = 0;
};

// The comm and this device's state; refuses a comm whose group failed (the sticky error).
ffi::Error Lookup(int64_t comm_id, int32_t ordinal, Comm** comm, DeviceState** dev) {
  // The primary context of this device: the one XLA runs on and the workspace lives in.
  int current = -1;  // cudaSetDevice only where XLA's thread is on another device
  TW_FFI_CHECK(cudaGetDevice(&current));
  if (current != ordinal) TW_FFI_CHECK(cudaSetDevice(ordinal));
  *comm = LookupComm(comm_id);
  if (*comm == nullptr) return Invalid("unknown comm id " + std::to_string(comm_id));
  if (std::string why = FailureMessage(**comm); !why.empty()) return ffi::Error::Internal(why);
  *dev = (*comm)->Find(ordinal);
  if (*dev == nullptr)
    return Invalid("device " + std::to_string(ordinal) + " is not part of comm " +
                   std::to_string(comm_id));
  return ffi::Error::Success();
}

// One fused call's operands and attributes, as the handlers receive them.
struct CallArgs {
  ffi::AnyBuffer partial;       // [T, H]
  ffi::AnyBuffer residual;      // [ceil(T/N), H]; [T, H] where residual_replicated
  ffi::AnyBuffer weight;        // [H], f32 or the partial's dtype
  ffi::AnyBuffer normed;        // [T, H], output
  ffi::AnyBuffer residual_out;  // residual's shape, output
  int64_t comm_id;
  int32_t slot;
  float eps;
  int32_t num_ctas;
  int32_t algo;
  int32_t residual_replicated;  // 1: residual and residual_out are [T, H] on every rank
};

ffi::Error Prepare(int32_t ordinal, const CallArgs& args, Call* call) {
  const auto& [partial, residual, weight, normed, residual_out, comm_id, slot, eps, num_ctas, algo,
               residual_replicated] = args;
  if (ffi::Error e = Lookup(comm_id, ordinal, &call->comm, &call->dev); e.failure()) return e;
  const Comm& comm = *call->comm;
  const CommOptions& opt = comm.options();
  const int n = comm.group_size();
  switch (partial.element_type()) {
    case ffi::DataType::F32: call->dtype = DType::kF32; break;
    case ffi::DataType::F16: call->dtype = DType::kF16; break;
    case ffi::DataType::BF16: call->dtype = DType::kBF16; break;
    default: return Invalid("dtype must be f32, f16 or bf16");
  }
  const auto pd = partial.dimensions();
  if (pd.size() != 2 || pd[0] < 1 || pd[1] < 1)
    return Invalid("partial must be [T, H], got " + Shape(pd));
  const bool replicated = residual_replicated != 0;
  const int64_t tokens = pd[0], hidden = pd[1], rows = replicated ? tokens : (tokens + n - 1) / n;
  if (hidden % kHiddenMultiple != 0 || hidden > kMaxHidden)
    return Invalid("hidden size must be a multiple of " + std::to_string(kHiddenMultiple) +
                   " and at most " + std::to_string(kMaxHidden) + ", got " +
                   std::to_string(hidden));
  const auto rd = residual.dimensions(), nd = normed.dimensions(), od = residual_out.dimensions();
  if (rd.size() != 2 || rd[0] != rows || rd[1] != hidden)
    return Invalid(std::string(replicated ? "a replicated" : "a token-sharded") +
                   " residual must be [" + std::to_string(rows) + ", " + std::to_string(hidden) +
                   "], got " + Shape(rd));
  if (nd.size() != 2 || nd[0] != tokens || nd[1] != hidden || od.size() != 2 || od[0] != rows ||
      od[1] != hidden)
    return Invalid("output shapes do not match the inputs");
  if (residual.element_type() != partial.element_type() ||
      normed.element_type() != partial.element_type() ||
      residual_out.element_type() != partial.element_type())
    return Invalid("partial, residual and outputs must share a dtype");
  if ((weight.element_type() != ffi::DataType::F32 &&
       weight.element_type() != partial.element_type()) ||
      weight.dimensions().size() != 1 || weight.dimensions()[0] != hidden)
    return Invalid("weight must be [H], float32 or the partial's dtype");
  if (slot < 0 || slot >= opt.num_slots)
    return Invalid("slot " + std::to_string(slot) + " out of range [0, " +
                   std::to_string(opt.num_slots) + ")");
  if (algo < 1 || algo > 4)
    return Invalid("algo must be 1 (two-shot), 2 (one-shot), 3 (direct) or 4 (copy engine)");
  const bool ce = algo == static_cast<int>(Algo::kCopyEngine);
  if (ce && opt.multimem) return Invalid("the copy-engine variant runs on comms without multimem");
  if (ce && opt.ce_bytes == 0)
    return Invalid("the communicator has no copy-engine staging area (ce_mib = 0)");
  if (comm.cross_process() && algo == static_cast<int>(Algo::kDirect))
    return Invalid(
        "algo direct reads XLA's buffers by address, which another process cannot "
        "map: use one_shot or two_shot across processes");
  if (comm.cross_process() && !comm.Ready())  // (a single-process comm is ready when built)
    return Invalid(
        "the communicator's peers in other processes are not mapped yet (connect "
        "it first: jax_tokenweave.comm.Communicator.comm_id does)");
  const int max_ctas = algo == static_cast<int>(Algo::kOneShot) ? kMaxOneShotCtas
                       : ce                                     ? kMaxCeCtas
                                                                : kMaxCtas;
  if (num_ctas < kMinCtas || num_ctas > max_ctas)
    return Invalid("num_ctas must be in [" + std::to_string(kMinCtas) + ", " +
                   std::to_string(max_ctas) + "] for this algo, got " + std::to_string(num_ctas));
  if (replicated &&
      !ResidualReplicatedFits(n, static_cast<int>(tokens), static_cast<int>(hidden), call->dtype,
                              static_cast<Algo>(algo), opt.multimem, num_ctas))
    return Invalid(
        "a replicated residual needs one rank or the decode one-shot kernel: algo one_shot, "
        "T <= num_ctas (T = " +
        std::to_string(tokens) + ", num_ctas = " + std::to_string(num_ctas) +
        "), rows of at most 16 KiB, no multimem");
  for (const void* p : {partial.untyped_data(), residual.untyped_data(), weight.untyped_data(),
                        normed.untyped_data(), residual_out.untyped_data()})
    if (!Aligned(p)) return Invalid("buffers must be 16-byte aligned");

  const Algo a = static_cast<Algo>(algo);
  const int64_t es = call->dtype == DType::kF32 ? 4 : 2;
  int64_t need, have;
  const char* area = a == Algo::kOneShot ? "one-shot buffer" : "data area";
  if (opt.multimem) {
    need = MultimemBytes(n, tokens, hidden, es), have = opt.area_bytes;
  } else if (ce) {
    need = CopyEngineBytes(n, rows, hidden, es), have = opt.ce_bytes;
    area = "copy-engine staging area";
  } else if (a == Algo::kOneShot) {
    need = OneShotBytes(n, tokens, replicated ? 0 : rows, hidden, es), have = opt.oneshot_bytes;
  } else {
    need = a == Algo::kDirect ? kDirectBytes : TwoShotBytes(n, rows, hidden, es);
    have = opt.area_bytes;
  }
  if (need > have)
    return Invalid("[" + std::to_string(tokens) + ", " + std::to_string(hidden) + "] needs " +
                   std::to_string(need) + " bytes of " + area + " per slot, the communicator has " +
                   std::to_string(have));
  call->algo = a;
  call->num_ctas = num_ctas;

  KernelParams& p = call->params;
  comm.Fill(*call->dev, slot, p);
  p.partial = partial.untyped_data();
  p.residual = residual.untyped_data();
  p.weight = weight.untyped_data();
  p.weight_in_dtype = weight.element_type() != ffi::DataType::F32;
  p.normed = normed.untyped_data();
  p.residual_out = residual_out.untyped_data();
  p.tokens = static_cast<int32_t>(tokens);
  p.hidden = static_cast<int32_t>(hidden);
  p.rows = static_cast<int32_t>(rows);
  p.eps = eps;
  p.residual_replicated = replicated ? 1 : 0;
  return ffi::Error::Success();
}

// The call's kernels, or where its launch gate expired (`gate`), the report and NaN outputs.
ffi::Error Launch(Call& c, const GateWait& gate, cudaStream_t stream) {
  if (gate.late_ordinal >= 0) {
    const DeviceState* late = c.comm->Find(gate.late_ordinal);
    TW_FFI_CHECK(LaunchGateTimeout(c.params, c.dtype, late != nullptr ? late->rank : -1,
                                   static_cast<uint32_t>(gate.call),
                                   static_cast<uint32_t>(gate.late_calls), stream));
    return ffi::Error::Success();
  }
  c.dev->issued[c.params.slot].fetch_add(1, std::memory_order_relaxed);
  if (c.algo == Algo::kCopyEngine && c.params.nranks > 1) {
    if (std::string why = IssueCopyEngineCall(c.params, c.dtype, c.num_ctas, stream); !why.empty())
      return ffi::Error::Internal(why);
    return ffi::Error::Success();
  }
  TW_FFI_CHECK(LaunchAllreduceRmsnorm(c.params, c.dtype, c.algo, c.comm->options().multimem,
                                      c.num_ctas, stream));
  return ffi::Error::Success();
}

// Prepare, then, where `gated`, the launch gate: only calls XLA runs through the handler on
// every run of every device pass it (a command buffer records a call, and may record it again
// on one device alone, so the counts could drift apart).
ffi::Error PrepareAndGate(int32_t ordinal, const CallArgs& args, bool gated, Call* call,
                          GateWait* gate) {
  if (ffi::Error e = Prepare(ordinal, args, call); e.failure()) return e;
  if (gated) *gate = call->comm->gate().Arrive(ordinal, call->comm->options().timeout_s);
  return ffi::Error::Success();
}

// The sync call; kGated: the uncaptured target, which XLA calls on every run.
template <bool kGated>
ffi::Error RunImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer partial,
                   ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                   ffi::Result<ffi::AnyBuffer> normed, ffi::Result<ffi::AnyBuffer> residual_out,
                   int64_t comm_id, int32_t slot, float eps, int32_t num_ctas, int32_t algo,
                   int32_t residual_replicated) {
  Call call;
  GateWait gate;
  if (ffi::Error e = PrepareAndGate(ordinal,
                                    {partial, residual, weight, *normed, *residual_out, comm_id,
                                     slot, eps, num_ctas, algo, residual_replicated},
                                    kGated, &call, &gate);
      e.failure())
    return e;
  return Launch(call, gate, stream);
}

// The start/done pair forks work onto a side stream and joins it in another call, which a
// command buffer cannot capture (each command is traced alone), so these two are not
// command-buffer compatible; they carry no per-call host state either.
ffi::Error StartImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer partial,
                     ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                     ffi::Result<ffi::AnyBuffer> normed, ffi::Result<ffi::AnyBuffer> residual_out,
                     int64_t comm_id, int32_t slot, float eps, int32_t num_ctas, int32_t algo,
                     int32_t residual_replicated) {
  Call call;
  GateWait gate;
  if (ffi::Error e = PrepareAndGate(ordinal,
                                    {partial, residual, weight, *normed, *residual_out, comm_id,
                                     slot, eps, num_ctas, algo, residual_replicated},
                                    true, &call, &gate);
      e.failure())
    return e;
  DeviceState& d = *call.dev;
  TW_FFI_CHECK(call.comm->EnsureSideStream(d));
  TW_FFI_CHECK(cudaEventRecord(d.ready[slot], stream));
  TW_FFI_CHECK(cudaStreamWaitEvent(d.side, d.ready[slot], 0));
  if (ffi::Error e = Launch(call, gate, d.side); e.failure()) return e;
  TW_FFI_CHECK(cudaEventRecord(d.done[slot], d.side));
  return ffi::Error::Success();
}

ffi::Error DoneImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer normed,
                    ffi::AnyBuffer residual_out, ffi::AnyBuffer /*partial*/,
                    ffi::AnyBuffer /*residual*/, ffi::AnyBuffer /*weight*/,
                    ffi::Result<ffi::AnyBuffer> normed_out,
                    ffi::Result<ffi::AnyBuffer> residual_out_out, int64_t comm_id, int32_t slot) {
  Comm* comm;
  DeviceState* d;
  if (ffi::Error e = Lookup(comm_id, ordinal, &comm, &d); e.failure()) return e;
  if (slot < 0 || slot >= comm->options().num_slots) return Invalid("slot out of range");
  if (d->side == nullptr || d->done[slot] == nullptr)
    return Invalid("done without a start on this slot");
  TW_FFI_CHECK(cudaStreamWaitEvent(stream, d->done[slot], 0));
  // Outputs alias the operands; if XLA gave separate buffers, copy (after the wait).
  if (normed_out->untyped_data() != normed.untyped_data())
    TW_FFI_CHECK(cudaMemcpyAsync(normed_out->untyped_data(), normed.untyped_data(),
                                 normed.size_bytes(), cudaMemcpyDeviceToDevice, stream));
  if (residual_out_out->untyped_data() != residual_out.untyped_data())
    TW_FFI_CHECK(cudaMemcpyAsync(residual_out_out->untyped_data(), residual_out.untyped_data(),
                                 residual_out.size_bytes(), cudaMemcpyDeviceToDevice, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tokenweave

using tokenweave::DoneImpl;
using tokenweave::RunImpl;
using tokenweave::StartImpl;

// The buffers and attributes of the fused call and of its start (named: the typed API binds
// them by position).
#define TW_BIND_MAIN()                                                               \
  ffi::Ffi::Bind()                                                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>() /* XLA's stream */                   \
      .Ctx<ffi::DeviceOrdinal>()                /* this device */                    \
      .Arg<ffi::AnyBuffer>()                    /* partial [T, H] */                 \
      .Arg<ffi::AnyBuffer>()                    /* residual [ceil(T/N) or T, H] */   \
      .Arg<ffi::AnyBuffer>()                    /* weight [H], f32 or partial's */   \
      .Ret<ffi::AnyBuffer>()                    /* normed [T, H] */                  \
      .Ret<ffi::AnyBuffer>()                    /* residual_out, residual's shape */ \
      .Attr<int64_t>("comm_id")                                                      \
      .Attr<int32_t>("slot")                                                         \
      .Attr<float>("eps")                                                            \
      .Attr<int32_t>("num_ctas")                                                     \
      .Attr<int32_t>("algo")                                                         \
      .Attr<int32_t>("residual_replicated")

// The synchronous call keeps no per-call host state (the kernels advance the device-resident
// sync state), so XLA may record it into a command buffer and replay it.
XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenweaveAllreduceRmsnorm, RunImpl<false>, TW_BIND_MAIN(),
                              {ffi::Traits::kCmdBufferCompatible});
// The same call for the copy-engine variant, left out of command buffers: captured, its peer
// copies stalled the GPUs in a graph replay (2 x H200, 2026-11-28, with the stream-wait design
// of that day); not measured again since the waits became a kernel.
XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenweaveAllreduceRmsnormUncaptured, RunImpl<true>, TW_BIND_MAIN());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenweaveAllreduceRmsnormStart, StartImpl, TW_BIND_MAIN());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenweaveAllreduceRmsnormDone, DoneImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int32_t>("slot"));
