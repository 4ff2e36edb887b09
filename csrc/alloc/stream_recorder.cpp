#include "stream_recorder.h"

namespace waterwave {

void StreamRecorder::note_allocate(Addr ptr, std::size_t bytes) {
  if (!ptr) return;
  std::lock_guard<std::mutex> g(mu_);
  live_[ptr] = blocks_.size();
  blocks_.push_back({round_to_block(bytes), clock_++, -1});
}

void StreamRecorder::note_free(Addr ptr) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = live_.find(ptr);
  if (it != live_.end()) {
    blocks_[it->second].freed = clock_++;
    live_.erase(it);
  }
}

std::vector<TracedBlock> StreamRecorder::trace() {
  std::lock_guard<std::mutex> g(mu_);
  return blocks_;
}

}  // namespace waterwave
