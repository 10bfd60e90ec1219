//===- PassTestUtil.h - Running passes one at a time; golden files -*- C++ -*-===//
//
// For the per-pass suites (LowerCommsTest, MemoryPassTest, SeqSplitTest): a plan prepared as
// compilePlan prepares it, then the named passes run in order with the verifier after each,
// so a suite can stop before the pass it tests and look at that pass's output alone. Their
// golden files: tests/Golden.h.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_PASSTESTUTIL_H
#define PIPEC_TESTS_PASSTESTUTIL_H

#include "tests/Golden.h"
#include "tests/TestUtil.h"

#include "schedules/Policy.h"

#include <memory>
#include <string>

namespace pipec::test {

/// A plan on its way through the pipeline, with what its passes read.
struct PassRun {
  ModelSpec model;
  ClusterSpec cluster = ClusterSpec::defaults();
  PassContext ctx;
  Plan plan;

  PassRun(ModelSpec m, const CompileOptions &o) : model(std::move(m)) {
    ctx.model = &model;
    ctx.cluster = &cluster;
    ctx.options = o;
    ctx.verifyEach = true;
    auto policy = findPolicy(o.schedule);
    EXPECT_TRUE(bool(policy)) << (policy ? "" : takeMessage(policy.takeError()));
    if (policy) {
      ctx.policy = *policy;
      plan.placement = (*policy)->placement();
    }
    plan.schedule = o.schedule;
    plan.model = model.name;
    plan.timeUnit = model.timeUnit().str();
    plan.parallel = o.parallel;
    plan.gpusPerNode = cluster.gpusPerNode;
    plan.stateBytesPerParamByte = model.stateBytesPerParamByte;
    plan.transformer = model.transformer;
  }
  PassRun(const PassRun &) = delete;
  PassRun &operator=(const PassRun &) = delete;

  /// Run `passes` in order (the verifier after each, at the plan's stage).
  llvm::Error run(llvm::ArrayRef<llvm::StringRef> passes) { return runPipeline(passes, plan, ctx); }
  /// Run them and fail the test on an error.
  void runOrFail(llvm::ArrayRef<llvm::StringRef> passes) {
    llvm::Error err = run(passes);
    ASSERT_FALSE(bool(err)) << takeMessage(std::move(err));
  }
};

} // namespace pipec::test

#endif // PIPEC_TESTS_PASSTESTUTIL_H
