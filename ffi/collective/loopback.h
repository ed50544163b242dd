// The loopback harness: every rank of a group on ONE device, each on its own stream, launched
// concurrently. It runs the real kernels and the real device-resident protocol (epochs,
// one-shot buffer rotation, barriers, bounded waits) for N in {1, 2, 4, 8} where only one GPU
// is at hand, and times CUDA-graph replays of the calls. Peer memory is local memory here, so
// its timings say nothing about NVLink; they only compare variants' fixed costs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace tokenweave {

struct LoopbackRequest {
  int64_t comm_id = 0;  // a loopback comm (RegisterComm with options.loopback)
  DType dtype = DType::kBF16;
  Algo algo = Algo::kOneShot;
  int num_ctas = 8;
  int tokens = 1, hidden = 0;
  float eps = 1e-6f;
  // Host bytes, rank-major: partial [N, T, H], residual [N, q, H] (dtype; [N, T, H] where
  // residual_replicated), weight [H] float32.
  std::vector<uint8_t> partial, residual, weight;
  int calls = 1;  // back-to-back calls (same inputs), slot = call % slots
  int slots = 1;
  int skip_call = -1;  // test hook: at this call, rank `skip_rank` launches nothing
  int skip_rank = 0;
  int graph_calls = 0;    // then capture this many calls in one CUDA graph ...
  int graph_replays = 0;  // ... and time this many replays
  // The graph's ranks fork once and join once, each rank's calls back to back on its stream (as
  // on GPUs of their own; the protocol keeps a rank at most one call ahead). Else every call
  // forks and joins, so a call starts when every rank has ended the one before.
  bool free_running = false;
  // Residual [N, T, H] (every rank's whole copy, KernelParams::residual_replicated), not [N, q, H].
  bool residual_replicated = false;
};

struct LoopbackResult {
  std::vector<uint8_t> normed, residual_out;  // after the last call, rank-major
  int64_t mismatches = 0;  // output vectors of later calls (and replays) that differ from call 0
  std::vector<float> call_us;  // per replay: device time of one call (replay time / graph_calls)
  std::string error;           // the comm's failure message, "" when every call succeeded
};

// Runs the request; throws std::runtime_error on misuse or a CUDA error.
LoopbackResult RunLoopback(const LoopbackRequest& req);

// The one-shot wire encoding on the host (kernels.cuh): `data` encoded as a sender stores it,
// and in `pending` whether each 16-byte vector of `data`, read from a receive buffer, would
// still count as not written. itemsize 2 (bf16/fp16) or 4 (fp32).
std::vector<uint8_t> OneShotEncode(const std::vector<uint8_t>& data, int itemsize,
                                   std::vector<uint8_t>* pending);

// The lazy-loading hazard, measured: rank 0 of a loopback comm spins alone (until the comm's
// bound expires) while a kernel that was never launched before is launched on another stream.
// Returns seconds from that launch call to: its return, the probe kernel's completion, the
// spinner's end. `preload` loads the probe kernel before the spinner starts.
std::vector<double> LazyLoadProbe(int64_t comm_id, bool preload);

}  // namespace tokenweave
