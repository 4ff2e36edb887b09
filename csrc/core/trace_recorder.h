// Records the allocations and frees an allocator serves, passing every call
// through. On a GPU one recorded training step is the exact allocation
// sequence the plan must match: it includes what the captured graph cannot
// see (cuDNN and cuBLAS workspaces, outputs a CUDA kernel shapes
// differently), so offsets packed from it fit the program as it runs.
#pragma once

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "allocator.h"

namespace waterwave {

// One allocation of the recorded stream: its size (rounded as the plan
// allocator rounds), and when it was allocated and freed, counted in events
// (allocations and frees of that stream). `freed` is -1 if it outlived the
// recording.
struct TracedBlock {
  std::size_t size;
  std::int64_t allocated;
  std::int64_t freed;
};

class TraceRecorder final : public Allocator {
 public:
  // Records `stream`'s allocations; others pass through unrecorded.
  TraceRecorder(std::shared_ptr<Allocator> inner, StreamId stream);

  Addr allocate(std::size_t bytes, StreamId stream) override;
  void deallocate(Addr ptr) override;
  void record_stream(Addr ptr, StreamId stream) override { inner_->record_stream(ptr, stream); }
  void sync_and_coalesce() override { inner_->sync_and_coalesce(); }
  void empty_cache() override { inner_->empty_cache(); }
  AllocatorStats stats() override { return inner_->stats(); }
  void reset_peak_stats() override { inner_->reset_peak_stats(); }
  std::vector<SegmentInfo> snapshot() override { return inner_->snapshot(); }
  void check_invariants() override { inner_->check_invariants(); }
  std::size_t allocation_size(Addr ptr) override { return inner_->allocation_size(ptr); }
  std::string policy() const override { return inner_->policy(); }
  const AllocatorConfig& config() const override { return inner_->config(); }

  // The blocks in allocation order.
  std::vector<TracedBlock> trace();

 private:
  std::shared_ptr<Allocator> inner_;
  StreamId stream_;
  std::mutex mu_;
  std::int64_t clock_ = 0;
  std::vector<TracedBlock> blocks_;
  std::unordered_map<Addr, std::size_t> live_;  // ptr -> index in blocks_
};

}  // namespace waterwave
