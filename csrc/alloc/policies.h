// The one list of allocation policies, and the one factory that builds them.
//
// A policy is chosen by its kind; names are for configuration strings and
// messages. Adding a policy means a row in kPolicies (policies.cpp) and a case
// in make_allocator.
//
// May include: core/.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../core/config.h"
#include "../core/device.h"

namespace waterwave {

class Allocator;

enum class PolicyKind { kWaterwave, kPytorch };

struct PolicyInfo {
  PolicyKind kind;
  const char* name;     // as written in configuration: "waterwave", "pytorch"
  const char* summary;  // one line, for messages
  bool pool_stats;      // stats() breaks counters down by small/large pool
};

// Every policy, the default first.
const std::vector<PolicyInfo>& policies();
const PolicyInfo& policy_info(PolicyKind kind);
// The kind named `name`; ConfigError naming the choices otherwise.
PolicyKind parse_policy(const std::string& name);

std::unique_ptr<Allocator> make_allocator(PolicyKind kind, Device& device,
                                          const AllocatorConfig& config);

}  // namespace waterwave
