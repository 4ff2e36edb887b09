#include "trace_recorder.h"

namespace waterwave {

TraceRecorder::TraceRecorder(std::shared_ptr<Allocator> inner, StreamId stream)
    : inner_(std::move(inner)), stream_(stream) {}

Addr TraceRecorder::allocate(std::size_t bytes, StreamId stream) {
  const Addr p = inner_->allocate(bytes, stream);
  if (p && stream == stream_) {
    std::lock_guard<std::mutex> g(mu_);
    live_[p] = blocks_.size();
    blocks_.push_back({round_to_block(bytes), clock_++, -1});
  }
  return p;
}

void TraceRecorder::deallocate(Addr ptr) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(ptr);
    if (it != live_.end()) {
      blocks_[it->second].freed = clock_++;
      live_.erase(it);
    }
  }
  inner_->deallocate(ptr);
}

std::vector<TracedBlock> TraceRecorder::trace() {
  std::lock_guard<std::mutex> g(mu_);
  return blocks_;
}

}  // namespace waterwave
