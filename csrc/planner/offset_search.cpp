#include "offset_search.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "buffer_search.h"
#include "spot_search.h"

namespace waterwave::planner {
namespace {

// Each search recurses once per placement (tens of thousands deep on real
// training steps): it gets its own thread with a large stack, reserved and
// touched only as deep as it goes.
constexpr std::size_t kSearchStackBytes = std::size_t{1} << 30;

using Strategy = SearchResult (*)(const std::vector<PackBuffer>&, const Sweep&, std::int64_t,
                                  const Limits&);

struct Job {
  Strategy strategy;
  const std::vector<PackBuffer>* buffers;
  const Sweep* sweep;
  std::int64_t capacity;
  const Limits* limits;
  std::atomic<bool>* stop;
  SearchResult result;
  std::exception_ptr error;
};

void* run_job(void* arg) {
  auto* job = static_cast<Job*>(arg);
  try {
    job->result = job->strategy(*job->buffers, *job->sweep, job->capacity, *job->limits);
  } catch (...) {
    job->error = std::current_exception();
  }
  if (job->error || job->result.status != SearchStatus::kTimeout) job->stop->store(true);
  return nullptr;
}

}  // namespace

SearchResult search_offsets(const std::vector<PackBuffer>& buffers, std::int64_t capacity,
                            double seconds, SearchStrategy strategy) {
  if (capacity < 0) throw std::invalid_argument("capacity must not be negative");
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    const auto& b = buffers[i];
    if (b.upper <= b.lower)
      throw std::invalid_argument("buffer " + std::to_string(i) + " has an empty lifetime [" +
                                  std::to_string(b.lower) + ", " + std::to_string(b.upper) +
                                  "): upper must be greater than lower");
    if (b.size <= 0)
      throw std::invalid_argument("buffer " + std::to_string(i) + " has size " +
                                  std::to_string(b.size) + ": sizes must be positive");
  }
  std::atomic<bool> stop{false};
  const Limits limits{std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(std::max(seconds, 0.0))),
                      &stop, Limits::mask_for(buffers.size())};
  const Sweep sweep(buffers);
  std::vector<Job> jobs;
  if (strategy != SearchStrategy::kBuffer)
    jobs.push_back({&search_by_spot, &buffers, &sweep, capacity, &limits, &stop, {}, nullptr});
  if (strategy != SearchStrategy::kSpot)
    jobs.push_back({&search_by_buffer, &buffers, &sweep, capacity, &limits, &stop, {}, nullptr});
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, kSearchStackBytes);
  std::vector<pthread_t> threads(jobs.size());
  std::size_t started = 0;
  int rc = 0;
  for (; started < jobs.size(); ++started)
    if ((rc = pthread_create(&threads[started], &attr, run_job, &jobs[started])) != 0) break;
  pthread_attr_destroy(&attr);
  if (started < jobs.size()) stop.store(true);
  for (std::size_t k = 0; k < started; ++k) pthread_join(threads[k], nullptr);
  if (started < jobs.size())
    throw std::runtime_error("offset search: could not start its threads (error " + std::to_string(rc) + ")");
  SearchResult answer;  // the first search that settled it, else a timeout
  for (const Job& job : jobs) {
    if (job.error) std::rethrow_exception(job.error);
    if (answer.status == SearchStatus::kTimeout) answer.status = job.result.status;
    if (job.result.status == SearchStatus::kFound) answer.offsets = job.result.offsets;
  }
  answer.nodes = 0;
  for (const Job& job : jobs) answer.nodes += job.result.nodes;
  return answer;
}
}  // namespace waterwave::planner
