//===- Policy.h - The schedule policy interface ------------------*- C++ -*-===//
//
// A policy decides one thing: the order of compute ops (F, B or I and W) on every rank, and the
// stage-to-rank placement it assumes. Communication, collectives, memory and timing are passes
// (compiler/), never a policy's business. Policies are registered once, in Registry.cpp.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SCHEDULES_POLICY_H
#define PIPEC_SCHEDULES_POLICY_H

#include "ir/Instruction.h"
#include "ir/Plan.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace pipec {

/// What a policy may read: the configuration and the (already partitioned) stage table, for
/// policies that weigh costs or memory.
struct ScheduleRequest {
  ParallelConfig parallel;
  llvm::ArrayRef<StageInfo> stages;
  int64_t memoryLimit = 0; // bytes per rank; 0 = none given
};

/// Compute ops of each rank, in order (ranks[r] for pipeline rank r).
using ComputeOrder = std::vector<std::vector<Instruction>>;

class SchedulePolicy {
public:
  virtual ~SchedulePolicy() = default;
  virtual llvm::StringRef name() const = 0;
  /// One line: what the schedule does and where it comes from.
  virtual llvm::StringRef summary() const = 0;
  /// One line: the flags it needs, e.g. "--vpp 1, --seq-splits 1".
  virtual llvm::StringRef constraints() const = 0;
  virtual Placement placement() const { return Placement::Loop; }
  /// The schedule replaces the optimizer's pipeline-wide synchronisation by post-validation
  /// (Qi et al., zero-bubble pipeline parallelism, §4): each rank steps on its own.
  virtual bool postValidation() const { return false; }
  /// Every backward the schedule emits is split into backward_input and backward_weight (none
  /// fused): memory bounds may take the split form's (ir/CostModel.h's activationLifetimePeak).
  virtual bool splitsEveryBackward() const { return false; }
  /// Reject a configuration up front: name the flag, the value and the nearest valid setting.
  virtual llvm::Error check(const ParallelConfig &config) const = 0;
  /// Reject what check() cannot see (stage costs and bytes, --memory-limit); runs on the
  /// partitioned stages, before emit(). Most policies need nothing here.
  virtual llvm::Error checkRequest(const ScheduleRequest &) const { return llvm::Error::success(); }
  /// The least --memory-limit (activation bytes per rank) the policy schedules under, for a
  /// policy that takes one (checkRequest() refuses less); 0 for the others.
  virtual int64_t leastMemoryLimit(const ScheduleRequest &) const { return 0; }
  /// Emit every rank's compute order for a configuration that passed check().
  virtual void emit(const ScheduleRequest &request, ComputeOrder &order) const = 0;
  /// Once the schedule pass has put the emitted order into `plan` (configuration, stage table,
  /// compute streams): the policy the plan is named after and whose post-validation it takes.
  /// A policy's order is its own; an order that pipec did not make (an imported one,
  /// compiler/Import.h) is checked here and named after the policy that emits the same order.
  virtual llvm::Expected<const SchedulePolicy *> identify(const Plan &) const { return this; }
};

/// What a policy declares as data: its name and lines, the --vpp and --seq-splits it takes
/// (checked before anything else, each with its one-line error "NAME needs --vpp 1 (got 2);
/// HINT"), its placement and whether it takes post-validation.
struct PolicyTraits {
  /// The --vpp a policy takes.
  enum class Vpp : uint8_t { One, Two, AtLeastTwo };
  PolicyTraits(llvm::StringRef name, llvm::StringRef summary, llvm::StringRef constraints, Vpp vpp,
               llvm::StringRef vppHint)
      : name(name), summary(summary), constraints(constraints), vpp(vpp), vppHint(vppHint) {}
  /// The policy takes --seq-splits 1 only; `hint` ends the error.
  PolicyTraits &oneSeqSplit(llvm::StringRef hint) {
    seqSplitsHint = hint;
    return *this;
  }
  PolicyTraits &postValidated() {
    postValidation = true;
    return *this;
  }
  PolicyTraits &vShape() {
    placement = Placement::VShape;
    return *this;
  }
  PolicyTraits &splitBackwards() {
    splitBackward = true;
    return *this;
  }

  llvm::StringRef name, summary, constraints;
  Vpp vpp;
  llvm::StringRef vppHint;
  llvm::StringRef seqSplitsHint; // empty: any --seq-splits
  bool postValidation = false;
  bool splitBackward = false;
  Placement placement = Placement::Loop;
};

/// A policy whose description, placement and first checks are its PolicyTraits; check() runs
/// the traits' checks, then checkMore().
class DeclaredPolicy : public SchedulePolicy {
public:
  explicit DeclaredPolicy(const PolicyTraits &traits) : traits(traits) {}
  llvm::StringRef name() const final { return traits.name; }
  llvm::StringRef summary() const final { return traits.summary; }
  llvm::StringRef constraints() const final { return traits.constraints; }
  Placement placement() const final { return traits.placement; }
  bool postValidation() const final { return traits.postValidation; }
  bool splitsEveryBackward() const final { return traits.splitBackward; }
  llvm::Error check(const ParallelConfig &config) const final;

protected:
  /// The checks beyond --vpp and --seq-splits.
  virtual llvm::Error checkMore(const ParallelConfig &) const { return llvm::Error::success(); }

private:
  PolicyTraits traits;
};

/// Every registered policy, in `pipec list-schedules` order.
llvm::ArrayRef<const SchedulePolicy *> allPolicies();
/// The policy called `name`; an InputError listing the known names if there is none.
llvm::Expected<const SchedulePolicy *> findPolicy(llvm::StringRef name);

// Factories, one per policy file.
std::unique_ptr<SchedulePolicy> createGPipePolicy();
std::unique_ptr<SchedulePolicy> createOneFOneBPolicy();
std::unique_ptr<SchedulePolicy> createInterleaved1F1BPolicy();
std::unique_ptr<SchedulePolicy> createSeq1F1BPolicy();
std::unique_ptr<SchedulePolicy> createSeq1F1BInterleavedPolicy();
std::unique_ptr<SchedulePolicy> createZBH1Policy();
std::unique_ptr<SchedulePolicy> createZBH2Policy();
std::unique_ptr<SchedulePolicy> createZBVPolicy();
std::unique_ptr<SchedulePolicy> createZBAutoPolicy();
std::unique_ptr<SchedulePolicy> createDualPipeVPolicy();

} // namespace pipec

#endif // PIPEC_SCHEDULES_POLICY_H
