#include "policies.h"

#include "allocator.h"

namespace waterwave {

// Defined next to their policies.
std::unique_ptr<Allocator> make_waterwave_policy(Device& device, const AllocatorConfig& config);
std::unique_ptr<Allocator> make_pytorch_policy(Device& device, const AllocatorConfig& config);

const std::vector<PolicyInfo>& policies() {
  static const std::vector<PolicyInfo> kPolicies = {
      {PolicyKind::kWaterwave, "waterwave",
       "multi-stream: per-stream unsynced sets, one synced set (the Waterwave paper)", false},
      {PolicyKind::kPytorch, "pytorch", "PyTorch 2.14's native caching allocator", true},
  };
  return kPolicies;
}

const PolicyInfo& policy_info(PolicyKind kind) {
  for (const PolicyInfo& p : policies()) {
    if (p.kind == kind) return p;
  }
  throw InvariantError("a policy kind missing from the list of policies");
}

PolicyKind parse_policy(const std::string& name) {
  std::string choices;
  for (const PolicyInfo& p : policies()) {
    if (name == p.name) return p.kind;
    choices += std::string(choices.empty() ? "" : ", ") + "'" + p.name + "' (" + p.summary + ")";
  }
  throw ConfigError("unknown allocator policy '" + name + "': choose " + choices);
}

std::unique_ptr<Allocator> make_allocator(PolicyKind kind, Device& device,
                                          const AllocatorConfig& config) {
  switch (kind) {
    case PolicyKind::kWaterwave: return make_waterwave_policy(device, config);
    case PolicyKind::kPytorch: return make_pytorch_policy(device, config);
  }
  throw InvariantError("make_allocator: a policy kind with no factory");
}

}  // namespace waterwave
