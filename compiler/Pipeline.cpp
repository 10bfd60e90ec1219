//===- Pipeline.cpp - Pass registry, the schedule and verify passes, compilePlan ---===//
#include "compiler/Pass.h"

#include "compiler/Budget.h"
#include "compiler/Evaluate.h"
#include "compiler/Verifier.h"
#include "ir/MeasuredCosts.h"
#include "ir/support/Error.h"
#include "ir/support/Limits.h"
#include "schedules/Policy.h"

#include "llvm/ADT/STLExtras.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace pipec {

namespace {

/// Establishes: plan.ranks holds the policy's compute order, one stream per rank; the plan's
/// schedule name and post-validation are those of the policy the order is (Policy::identify).
class SchedulePass final : public Pass {
public:
  llvm::StringRef name() const override { return "schedule"; }
  llvm::Expected<bool> run(Plan &plan, PassContext &ctx) override {
    const ScheduleRequest request{plan.parallel, plan.stages, ctx.options.memoryLimit};
    // Constraints that need the costs or the memory limit (zb-auto's --memory-limit).
    if (auto err = ctx.policy->checkRequest(request))
      return err;
    ComputeOrder order;
    ctx.policy->emit(request, order);
    assert(int(order.size()) == plan.parallel.pp && "policy emitted the wrong number of ranks");
    plan.ranks = std::move(order);
    ctx.scheduled = true;
    // The plan is named after the policy whose order it holds, and whether it skips the
    // optimizer's pipeline-wide wait is that policy's to declare.
    auto as = ctx.policy->identify(plan);
    if (!as)
      return as.takeError();
    plan.schedule = (*as)->name().str();
    plan.postValidation = (*as)->postValidation();
    return true;
  }
};

/// Checks the whole plan (comms and collectives required); changes nothing.
class VerifyPass final : public Pass {
public:
  llvm::StringRef name() const override { return "verify"; }
  llvm::Expected<bool> run(Plan &plan, PassContext &ctx) override {
    if (auto err = verifyPlan(plan, VerifyOptions{ctx.commsLowered, ctx.collectivesLowered}))
      return err;
    return false;
  }
};

/// Every registered pass, in the default pipeline's order: the passes that decide time and
/// memory are evaluateOrder's list (compiler/Evaluate.h), so that the planner and zb-auto score
/// exactly what compile states.
const std::vector<PassEntry> &registry() {
  static const std::vector<PassEntry> all = [] {
    std::vector<PassEntry> v = {{"seq-split", createSeqSplitPass},
                                {"partition", createPartitionPass},
                                {"schedule", createSchedulePass}};
    llvm::ArrayRef<PassEntry> scoring = scoringPasses();
    v.insert(v.end(), scoring.begin(), scoring.end());
    v.push_back({"verify", createVerifyPass});
    return v;
  }();
  return all;
}

} // namespace

std::unique_ptr<Pass> createSchedulePass() { return std::make_unique<SchedulePass>(); }
std::unique_ptr<Pass> createVerifyPass() { return std::make_unique<VerifyPass>(); }

llvm::ArrayRef<llvm::StringRef> defaultPipeline() {
  static const std::vector<llvm::StringRef> names = [] {
    std::vector<llvm::StringRef> n;
    for (const PassEntry &e : registry())
      n.push_back(e.name);
    return n;
  }();
  return names;
}

llvm::Expected<std::unique_ptr<Pass>> createPass(llvm::StringRef name) {
  for (const PassEntry &e : registry())
    if (e.name == name)
      return e.create();
  return inputError("unknown pass '{}'", name.str());
}

llvm::Error runPipeline(llvm::ArrayRef<llvm::StringRef> names, Plan &plan, PassContext &ctx) {
  for (llvm::StringRef name : names) {
    auto pass = createPass(name);
    if (!pass)
      return pass.takeError();
    auto changed = (*pass)->run(plan, ctx);
    if (!changed)
      return changed.takeError();
    // Measured costs replace the model's where they cover it, before anything uses the times.
    if (name == "partition" && ctx.options.costs)
      if (auto err = applyMeasuredCosts(*ctx.options.costs, ctx.options.costsSource, plan))
        return err;
    // Invariants hold after every pass once there are streams to check.
    if (ctx.verifyEach && ctx.scheduled && name != "verify") {
      VerifyOptions opts;
      opts.requireComms = ctx.commsLowered;
      opts.requireCollectives = ctx.collectivesLowered;
      if (auto err = verifyPlan(plan, opts))
        return finding("after pass {}: {}", name.str(), takeMessage(std::move(err)));
    }
  }
  // Every layer's time is finite (the partition pass); a step of them, with its transfers,
  // all-reduces and optimizer, can still not be (compile and import alike).
  for (double t : {plan.stats.makespan, plan.stats.stepTime})
    if (!std::isfinite(t))
      return inputError("the step takes {} ms, past what pipec can add up: the --cluster's "
                        "rates are too small for this model (raise $.device.memory_GBps or "
                        "peak_tflops)",
                        t);
  return llvm::Error::success();
}

llvm::Error checkCompileOptions(const CompileOptions &o) {
  const ParallelConfig &pc = o.parallel;
  struct Flag {
    const char *name;
    int value;
  } flags[] = {{"--pp", pc.pp},
               {"--vpp", pc.vpp},
               {"--tp", pc.tp},
               {"--dp", pc.dp},
               {"--cp", pc.cp},
               {"--microbatches", pc.microbatches},
               {"--seq-splits", pc.seqSplits}};
  for (const Flag &f : flags)
    if (f.value < 1)
      return inputError("{} must be at least 1 (got {}); try {} 1", f.name, f.value, f.name);
  if (int64_t(pc.pp) * pc.vpp > kMaxStages) {
    // The flag at fault is the one past what its partner leaves room for.
    if (pc.vpp > 1 && pc.pp <= kMaxStages)
      return inputError("--pp {} x --vpp {} = {} stages is beyond what pipec plans ({}); try "
                        "--vpp {}",
                        pc.pp, pc.vpp, int64_t(pc.pp) * pc.vpp, kMaxStages, kMaxStages / pc.pp);
    return inputError("--pp {} x --vpp {} = {} stages is beyond what pipec plans ({}); try --pp "
                      "{}",
                      pc.pp, pc.vpp, int64_t(pc.pp) * pc.vpp, kMaxStages,
                      std::max<int64_t>(1, kMaxStages / pc.vpp));
  }
  int64_t units = int64_t(pc.microbatches) * pc.seqSplits;
  if (units > kMaxUnits)
    return inputError("--microbatches x --seq-splits = {} is beyond what pipec plans (2^24)",
                      units);
  int64_t stages = int64_t(pc.pp) * pc.vpp;
  if (stages * units > kMaxUnits)
    return inputError("--pp x --vpp x --microbatches x --seq-splits = {} is beyond what pipec "
                      "plans (2^24); try --microbatches {}",
                      stages * units, std::max<int64_t>(1, (kMaxUnits / stages) / pc.seqSplits));
  // The ranks of one pipeline stage: tp x dp, and cp where it is used.
  const int64_t perDp = int64_t(pc.tp) * pc.cp;
  if (perDp * pc.dp > kMaxTpDp)
    return inputError("--tp {}{} x --dp {} = {} is beyond what pipec plans ({}); try --dp {}",
                      pc.tp, pc.cp > 1 ? fmt::format(" x --cp {}", pc.cp) : std::string(), pc.dp,
                      perDp * pc.dp, kMaxTpDp, std::max<int64_t>(1, kMaxTpDp / perDp));
  if (o.memoryLimit < 0)
    return inputError("--memory-limit must be a positive byte count (got {})", o.memoryLimit);
  return llvm::Error::success();
}

llvm::Error checkStageCount(const ModelSpec &model, const ParallelConfig &pc) {
  const int64_t stages = int64_t(pc.pp) * pc.vpp, layers = int64_t(model.layers.size());
  if (stages <= layers)
    return llvm::Error::success();
  // The flag to change: --vpp where the ranks leave room for two chunks each (what the
  // interleaved schedules need), else --pp, unless --vpp alone is past the layers.
  std::string fix;
  if (pc.vpp > 1 && layers / pc.pp >= 2)
    fix = fmt::format("--vpp {}{}", layers / pc.pp,
                      layers / pc.vpp >= 1 ? fmt::format(" or --pp {}", layers / pc.vpp)
                                           : std::string());
  else if (layers / pc.vpp >= 1)
    fix = fmt::format("--pp {}", layers / pc.vpp);
  else
    fix = fmt::format("--vpp {}", std::max<int64_t>(1, layers / pc.pp));
  return inputError("--pp {} x --vpp {} = {} stages but the model has {} layers; every stage "
                    "needs at least one layer; try {}",
                    pc.pp, pc.vpp, stages, layers, fix);
}

llvm::Error checkContextParallel(const ModelSpec &model, const ParallelConfig &pc, int64_t gpus) {
  if (pc.cp > 1 && pc.seqSplits > 1)
    return inputError("--cp {} and --seq-splits {} both cut the sequence; give one of them", pc.cp,
                      pc.seqSplits);
  int fits = 1;
  if (std::optional<std::string> why = contextParallelProblem(model.transformer, pc, fits, gpus))
    return inputError("--cp {} {}; {}", pc.cp, *why,
                      model.transformer ? fmt::format("try --cp {}", fits) : "drop --cp");
  return llvm::Error::success();
}

llvm::Error checkCompileOptions(const ModelSpec &model, const CompileOptions &options) {
  // The layers bound the stages more tightly than what pipec plans: named first.
  if (options.parallel.pp >= 1 && options.parallel.vpp >= 1)
    if (auto err = checkStageCount(model, options.parallel))
      return err;
  if (auto err = checkCompileOptions(options))
    return err;
  if (auto err = checkCompileBudget(model, options)) // before anything is allocated
    return err;
  if (auto err = checkContextParallel(model, options.parallel))
    return err;
  if (model.transformer) {
    // Megatron splits heads, key/value groups and the MLP's hidden size across tp ranks: the
    // suggestion divides all three.
    const TransformerConfig &t = *model.transformer;
    int tp = options.parallel.tp;
    int64_t best = 1;
    for (int64_t d = 1; d <= tp; ++d)
      if (t.kvHeads() % d == 0 && t.numAttentionHeads % d == 0 && t.ffnHiddenSize % d == 0)
        best = d;
    if (t.numAttentionHeads % tp != 0 || t.ffnHiddenSize % tp != 0)
      return inputError("--tp {} must divide num_attention_heads ({}) and ffn_hidden_size ({}); "
                        "try --tp {}",
                        tp, t.numAttentionHeads, t.ffnHiddenSize, best);
    if (t.kvHeads() % tp != 0)
      return inputError("--tp {} must divide num_query_groups ({}): each tp rank holds whole "
                        "key/value groups; try --tp {}",
                        tp, t.kvHeads(), best);
  }
  return llvm::Error::success();
}

llvm::Expected<Plan> compilePlan(const ModelSpec &model, const ClusterSpec &cluster,
                                 const CompileOptions &given, bool verifyEach) {
  if (auto err = checkCompileOptions(model, given))
    return err;
  // As Megatron-LM does: sequence parallelism with one tp rank (or no transformer to split)
  // and ZeRO-1 with one replica change nothing, and the plan records them off, so that piperun,
  // which runs neither switch, runs it.
  CompileOptions options = given;
  options.parallel.sequenceParallel &= options.parallel.tp > 1 && model.isTransformer();
  options.parallel.distributedOptimizer &= options.parallel.gradReduceRanks() > 1;
  auto policy = findPolicy(options.schedule);
  if (!policy)
    return policy.takeError();
  if (auto err = (*policy)->check(options.parallel))
    return err;
  PassContext ctx;
  ctx.model = &model;
  ctx.cluster = &cluster;
  ctx.options = options;
  ctx.policy = *policy;
  ctx.verifyEach = verifyEach;
  Plan plan;
  plan.schedule = options.schedule;
  plan.model = model.name;
  plan.timeUnit = model.timeUnit().str();
  plan.parallel = options.parallel;
  plan.placement = (*policy)->placement();
  plan.gpusPerNode = cluster.gpusPerNode;
  plan.stateBytesPerParamByte = model.stateBytesPerParamByte;
  plan.transformer = model.transformer;
  if (auto err = runPipeline(defaultPipeline(), plan, ctx))
    return err;
  return plan;
}

} // namespace pipec
