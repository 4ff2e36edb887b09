// The CPU's thread accounts: what each tagged thread allocates through
// PyTorch's CPU allocator, and the shared budget over them, so that
// waterwave.sharing gates members training on the CPU by the same rules as
// on a GPU (thread_accounts.h). PyTorch reaches them through the C entry
// points below, called by the allocator that waterwave/alloc/torch_cpu.cpp
// (built against the user's torch) puts in front of c10's CPU allocator.
//
// May include: core/, thread_accounts.h.
#pragma once

#include <cstddef>

#include "thread_accounts.h"

#ifndef WATERWAVE_EXPORT
#define WATERWAVE_EXPORT extern "C" __attribute__((visibility("default")))
#endif

namespace waterwave {
// The process's one CPU ledger, never destroyed (frees arrive at exit).
ThreadAccounts& cpu_accounts();
}  // namespace waterwave

// The version of these entry points; torch_cpu.cpp's copy must agree.
constexpr int kWaterwaveCpuAccountsAbi = 1;
WATERWAVE_EXPORT int waterwave_cpu_accounts_abi();
// Before an allocation of `bytes`: 0 to go on; 1 when it must fail (out of
// memory under the budget), the reason in message (NUL-terminated).
WATERWAVE_EXPORT int waterwave_cpu_before_allocate(std::size_t bytes, char* message,
                                                   std::size_t capacity);
WATERWAVE_EXPORT void waterwave_cpu_allocated(void* ptr, std::size_t bytes);
WATERWAVE_EXPORT void waterwave_cpu_freed(void* ptr);
