#include "schedules/Policy.h"

#include "ir/support/Error.h"

#include "llvm/ADT/SmallVector.h"

namespace pipec {

namespace {
struct Registry {
  std::vector<std::unique_ptr<SchedulePolicy>> owned;
  llvm::SmallVector<const SchedulePolicy *, 16> view;
  Registry() {
    // The one place policies are registered; the order is list-schedules' order.
    owned.push_back(createGPipePolicy());
    owned.push_back(createOneFOneBPolicy());
    owned.push_back(createInterleaved1F1BPolicy());
    owned.push_back(createSeq1F1BPolicy());
    owned.push_back(createSeq1F1BInterleavedPolicy());
    owned.push_back(createZBH1Policy());
    owned.push_back(createZBH2Policy());
    owned.push_back(createZBVPolicy());
    owned.push_back(createZBAutoPolicy());
    owned.push_back(createDualPipeVPolicy());
    for (const auto &p : owned)
      view.push_back(p.get());
  }
};
} // namespace

static const Registry &registry() {
  static const Registry r;
  return r;
}

llvm::ArrayRef<const SchedulePolicy *> allPolicies() { return registry().view; }

llvm::Error DeclaredPolicy::check(const ParallelConfig &c) const {
  using Vpp = PolicyTraits::Vpp;
  const Vpp vpp = traits.vpp;
  if (vpp == Vpp::One ? c.vpp != 1 : vpp == Vpp::Two ? c.vpp != 2 : c.vpp < 2)
    return inputError("{} needs --vpp {} (got {}); {}", traits.name.str(),
                      vpp == Vpp::One   ? "1"
                      : vpp == Vpp::Two ? "2"
                                        : ">= 2",
                      c.vpp, traits.vppHint.str());
  if (!traits.seqSplitsHint.empty() && c.seqSplits != 1)
    return inputError("{} needs --seq-splits 1 (got {}); {}", traits.name.str(), c.seqSplits,
                      traits.seqSplitsHint.str());
  return checkMore(c);
}

/// Levenshtein distance, for "did you mean".
static unsigned editDistance(llvm::StringRef a, llvm::StringRef b) { return a.edit_distance(b); }

llvm::Expected<const SchedulePolicy *> findPolicy(llvm::StringRef name) {
  const SchedulePolicy *nearest = nullptr;
  unsigned best = ~0u;
  std::string names;
  for (const SchedulePolicy *p : allPolicies()) {
    if (p->name() == name)
      return p;
    unsigned d = editDistance(name, p->name());
    if (d < best) {
      best = d;
      nearest = p;
    }
    names += (names.empty() ? "" : ", ") + p->name().str();
  }
  return inputError("--schedule: unknown schedule '{}' (known: {}); try {}", name.str(), names,
                    nearest ? nearest->name().str() : std::string("1f1b"));
}

} // namespace pipec
