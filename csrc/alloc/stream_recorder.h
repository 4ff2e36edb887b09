// Records one stream's allocations and frees: the adaptor the stack (stack.h)
// puts between a stream and the online policy while a step is recorded.
//
// On a GPU one recorded training step is the exact allocation sequence the
// plan must match: it includes what the captured graph cannot see (cuDNN and
// cuBLAS workspaces, outputs a CUDA kernel shapes differently), so offsets
// packed from it fit the program as it runs.
//
// May include: core/ and this folder.
#pragma once

#include <mutex>
#include <unordered_map>
#include <vector>

#include "../core/types.h"

namespace waterwave {

// One allocation of the recorded stream: its size (rounded as the plan
// rounds), and when it was allocated and freed, counted in events
// (allocations and frees of that stream). `freed` is -1 if it outlived the
// recording.
struct TracedBlock {
  std::size_t size;
  std::int64_t allocated;
  std::int64_t freed;
};

class StreamRecorder {
 public:
  void note_allocate(Addr ptr, std::size_t bytes);
  // A free of a pointer this recorder saw allocated; others are ignored.
  void note_free(Addr ptr);
  // The blocks in allocation order.
  std::vector<TracedBlock> trace();

 private:
  std::mutex mu_;
  std::int64_t clock_ = 0;
  std::vector<TracedBlock> blocks_;
  std::unordered_map<Addr, std::size_t> live_;  // ptr -> index in blocks_
};

}  // namespace waterwave
