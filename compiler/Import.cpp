//===- Import.cpp - Compile a schedule read from a file --------------------===//
#include "compiler/Import.h"

#include "compiler/Verifier.h"
#include "ir/PlanText.h"
#include "ir/support/Bytes.h"
#include "ir/support/Error.h"
#include "ir/support/Limits.h"
#include "schedules/Policy.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/ErrorHandling.h"

#include <algorithm>
#include <map>

namespace pipec {

llvm::StringRef describe(ImportedOrder::Source source) {
  switch (source) {
  case ImportedOrder::Source::TorchCsv:
    return "PyTorch CSV, compute only";
  case ImportedOrder::Source::TorchCsvComms:
    return "PyTorch CSV with comms";
  case ImportedOrder::Source::PipecText:
    return "pipec text";
  }
  llvm_unreachable("unknown ImportedOrder::Source");
}

namespace {

/// The rank that runs most of a stage's ops (the lowest on a tie); -1 if the stage has none.
/// A stage that also shows up on another rank is then the verifier's finding, not a
/// placement question.
std::vector<int> stageOwners(const ImportedOrder &order) {
  std::vector<std::map<int, size_t>> count(size_t(order.numStages));
  for (size_t r = 0; r < order.ranks.size(); ++r)
    for (const Instruction &i : order.ranks[r])
      ++count[size_t(i.stage)][int(r)];
  std::vector<int> owner(size_t(order.numStages), -1);
  for (size_t s = 0; s < count.size(); ++s) {
    size_t best = 0;
    for (auto [r, n] : count[s])
      if (n > best) {
        best = n;
        owner[s] = r;
      }
  }
  return owner;
}

bool fits(Placement p, const std::vector<int> &owner, int pp) {
  for (size_t s = 0; s < owner.size(); ++s)
    if (owner[s] >= 0 && owner[s] != rankOfStage(p, int(s), pp))
      return false;
  return true;
}

/// Does `policy` emit exactly `ranks` for the plan's configuration and stages?
bool policyEmits(const SchedulePolicy &policy, const Plan &plan, int64_t memoryLimit,
                 const std::vector<std::vector<Instruction>> &ranks) {
  if (policy.placement() != plan.placement)
    return false;
  if (auto err = policy.check(plan.parallel)) {
    llvm::consumeError(std::move(err));
    return false;
  }
  ScheduleRequest request;
  request.parallel = plan.parallel;
  request.stages = plan.stages;
  request.memoryLimit = memoryLimit;
  if (auto err = policy.checkRequest(request)) {
    llvm::consumeError(std::move(err));
    return false;
  }
  ComputeOrder emitted;
  policy.emit(request, emitted);
  return emitted == ranks;
}

/// Where a policy's order first differs from the imported one, for the finding.
std::string firstDifference(const SchedulePolicy &policy, const Plan &plan, int64_t memoryLimit,
                            const std::vector<std::vector<Instruction>> &ranks) {
  ScheduleRequest request;
  request.parallel = plan.parallel;
  request.stages = plan.stages;
  request.memoryLimit = memoryLimit;
  ComputeOrder emitted;
  policy.emit(request, emitted);
  Plan shown = plan; // for the token spelling only
  for (size_t r = 0; r < ranks.size(); ++r) {
    const auto &a = ranks[r];
    const auto &b = emitted[r];
    for (size_t n = 0; n < std::max(a.size(), b.size()); ++n) {
      if (n < a.size() && n < b.size() && a[n] == b[n])
        continue;
      std::string got = n < a.size() ? formatToken(shown, a[n]) : "the end of the row";
      std::string want = n < b.size() ? formatToken(shown, b[n]) : "the end of the row";
      return fmt::format("rank {} compute step {} is {}, {} has {} there", r, n, got,
                         policy.name().str(), want);
    }
  }
  return "the orders are equal";
}

/// The index in allPolicies() of the first policy from `from` on, other than `skip`, whose
/// order for the plan's configuration and stages is `ranks`; allPolicies().size() if none.
size_t nextMatch(const Plan &plan, int64_t memoryLimit,
                 const std::vector<std::vector<Instruction>> &ranks, size_t from,
                 const SchedulePolicy *skip) {
  llvm::ArrayRef<const SchedulePolicy *> all = allPolicies();
  for (size_t k = from; k < all.size(); ++k)
    if (all[k] != skip && policyEmits(*all[k], plan, memoryLimit, ranks))
      return k;
  return all.size();
}

/// The imported order as the schedule policy of compile's pipeline: it emits the order read
/// from the file, has the verifier check it before anything lowers it, and names the plan
/// after the registered policy that emits the same order (the named one, which it must then
/// be), or custom.
class ImportedOrderPolicy final : public SchedulePolicy {
public:
  ImportedOrderPolicy(const ImportedOrder &order, Placement placement, const SchedulePolicy *named,
                      int64_t memoryLimit, llvm::StringRef source)
      : order(order), place(placement), named(named), memoryLimit(memoryLimit), source(source) {}

  llvm::StringRef name() const override { return named ? named->name() : kCustomSchedule; }
  llvm::StringRef summary() const override { return "the compute order read from a file"; }
  llvm::StringRef constraints() const override {
    return "pp, vpp, microbatches and seq-splits from the file";
  }
  Placement placement() const override { return place; }
  // compileImported checks the configuration against the file and the named policy.
  llvm::Error check(const ParallelConfig &) const override { return llvm::Error::success(); }
  void emit(const ScheduleRequest &, ComputeOrder &out) const override { out = order.ranks; }

  llvm::Expected<const SchedulePolicy *> identify(const Plan &plan) const override {
    // The imported order stands where a policy's would: check it as the verifier checks a
    // policy's output (structure, completeness, same-rank dependencies) before lowering it.
    VerifyOptions computeOnly;
    computeOnly.requireComms = false;
    computeOnly.requireCollectives = false;
    if (auto err = verifyPlan(plan, computeOnly))
      return err;
    if (named) {
      if (auto err = named->checkRequest({plan.parallel, plan.stages, memoryLimit}))
        return err;
      if (!policyEmits(*named, plan, memoryLimit, order.ranks))
        return finding("{} is not pipec's {} for pp={} vpp={} microbatches={}: {}; drop "
                       "--schedule to import it as a {} schedule",
                       source, named->name().str(), plan.parallel.pp, plan.parallel.vpp,
                       plan.parallel.microbatches,
                       firstDifference(*named, plan, memoryLimit, order.ranks), kCustomSchedule);
      return named;
    }
    // An order that is a policy's is that policy's plan, its optimizer step included (whether
    // it post-validates instead of waiting for the pipeline-wide check), as compile makes it.
    size_t first = nextMatch(plan, memoryLimit, order.ranks, 0, nullptr);
    if (first < allPolicies().size())
      return allPolicies()[first];
    return this;
  }

private:
  const ImportedOrder &order;
  Placement place;
  const SchedulePolicy *named;
  int64_t memoryLimit;
  std::string source;
};

} // namespace

llvm::Error checkMemoryLimit(const Plan &plan, int64_t memoryLimit, bool imported) {
  if (memoryLimit <= 0)
    return llvm::Error::success();
  // The fix names what the command can change: an imported order's stages and microbatches
  // are the file's.
  const char *fix = imported ? "the order is the file's: give a larger --memory-limit or --tp, "
                               "or import an order with more stages or fewer microbatches in "
                               "flight (1f1b holds min(p, m))"
                             : "raise --pp, lower --microbatches for gpipe, or use a schedule "
                               "that bounds memory (1f1b holds min(p, m) microbatches)";
  for (const RankStats &r : plan.stats.ranks)
    if (r.peakActivationBytes > memoryLimit)
      return finding("rank {} holds {} of activations at its peak, over --memory-limit {}; {}",
                     r.rank, humanBytes(r.peakActivationBytes), humanBytes(memoryLimit), fix);
  return llvm::Error::success();
}

llvm::Expected<ImportResult> compileImported(const ModelSpec &model, const ClusterSpec &cluster,
                                             const ImportedOrder &order,
                                             const ImportOptions &options, llvm::StringRef source,
                                             bool verifyEach) {
  int pp = int(order.ranks.size());
  if (pp == 0)
    return inputError("{}: no ranks: the file has no rows", source.str());
  if (order.numStages == 0)
    return inputError("{}: no compute actions (F, I, W or B) in any row", source.str());
  if (pp > kMaxStages)
    return inputError("{}: {} ranks is beyond what pipec plans ({})", source.str(), pp, kMaxStages);
  if (order.numStages > kMaxStages)
    return inputError("{}: stage {} is beyond what pipec plans ({} stages)", source.str(),
                      order.numStages - 1, kMaxStages);
  if (order.numStages % pp != 0)
    return inputError("{}: stages 0..{} ({} stages) on {} ranks is not a whole number of stages "
                      "per rank (--vpp); every rank must hold the same number of stages",
                      source.str(), order.numStages - 1, order.numStages, pp);
  int vpp = order.numStages / pp;
  if (options.vpp > 0 && options.vpp != vpp)
    return inputError("--vpp {} disagrees with {}: {} stages on {} ranks is --vpp {}; try --vpp "
                      "{}",
                      options.vpp, source.str(), order.numStages, pp, vpp, vpp);
  std::vector<int> owner = stageOwners(order);
  Placement placement = Placement::Loop;
  if (!fits(Placement::Loop, owner, pp)) {
    if (vpp == 2 && fits(Placement::VShape, owner, pp)) {
      placement = Placement::VShape;
    } else {
      for (size_t s = 0; s < owner.size(); ++s)
        if (owner[s] >= 0 && owner[s] != rankOfStage(Placement::Loop, int(s), pp))
          return inputError("{}: placement: stage {} runs on rank {}, but pipec places stage s "
                            "on rank s % pp (loop){}; renumber the stages so that stage {} is "
                            "on rank {}",
                            source.str(), s, owner[s],
                            vpp == 2 ? " or in a V (rank s for s < pp, else 2·pp-1-s)" : "", s,
                            rankOfStage(Placement::Loop, int(s), pp));
    }
  }

  CompileOptions o;
  o.schedule = options.schedule.empty() ? kCustomSchedule : options.schedule;
  o.parallel.pp = pp;
  o.parallel.vpp = vpp;
  o.parallel.tp = options.tp;
  o.parallel.dp = options.dp;
  o.parallel.cp = options.cp;
  o.parallel.microbatches = order.microbatches;
  o.parallel.seqSplits = order.seqSplits;
  o.parallel.microbatchGroupSize = options.microbatchGroupSize;
  o.memoryLimit = options.memoryLimit;
  o.costs = options.costs;
  o.costsSource = options.costsSource;
  if (auto err = checkCompileOptions(model, o))
    return err;

  const SchedulePolicy *named = nullptr;
  if (!options.schedule.empty()) {
    auto policy = findPolicy(options.schedule);
    if (!policy)
      return policy.takeError();
    named = *policy;
    if (named->placement() != placement)
      return inputError("--schedule {} places stages in a {}, but {} has a {} placement; drop "
                        "--schedule to have the order recognised",
                        options.schedule, toString(named->placement()).str(), source.str(),
                        toString(placement).str());
    // The layout is the file's, not flags import takes: the schedule's own fix ("try --vpp
    // 2", "try --seq-splits 1") would not apply, so the way out named is the file's.
    if (auto err = named->check(o.parallel)) {
      std::string why = takeMessage(std::move(err));
      if (size_t at = why.find("; try "); at != std::string::npos)
        why.resize(at);
      return inputError("--schedule {}: {} ({}'s layout: pp {}, {} chunk{} per rank, {} "
                        "microbatches, {} sub-sequence{}); drop --schedule to have the order "
                        "recognised",
                        options.schedule, why, source.str(), pp, vpp, vpp == 1 ? "" : "s",
                        order.microbatches, order.seqSplits, order.seqSplits == 1 ? "" : "s");
    }
  }

  ImportedOrderPolicy policy(order, placement, named, options.memoryLimit, source);
  ImportResult result;
  Plan &plan = result.plan;
  plan.schedule = policy.name().str();
  plan.model = model.name;
  plan.timeUnit = model.timeUnit().str();
  plan.parallel = o.parallel;
  plan.placement = placement;
  plan.gpusPerNode = cluster.gpusPerNode;
  plan.stateBytesPerParamByte = model.stateBytesPerParamByte;
  plan.transformer = model.transformer;
  PassContext ctx;
  ctx.model = &model;
  ctx.cluster = &cluster;
  ctx.options = o;
  ctx.policy = &policy;
  ctx.verifyEach = verifyEach;
  if (auto err = runPipeline(defaultPipeline(), plan, ctx))
    return err;

  // Every policy whose order this is, the one the plan is named after first. The schedule pass
  // tried the policies before that one (or, with --schedule, only the named one): the rest are
  // tried here, each once.
  llvm::ArrayRef<const SchedulePolicy *> all = allPolicies();
  const SchedulePolicy *first = named;
  size_t from = 0;
  if (!named) {
    auto it =
        llvm::find_if(all, [&](const SchedulePolicy *p) { return p->name() == plan.schedule; });
    first = it == all.end() ? nullptr : *it; // none: custom, and every policy was tried
    from = size_t(it - all.begin()) + (first ? 1 : 0);
  }
  if (first)
    result.matches.push_back(first->name().str());
  for (size_t k = nextMatch(plan, options.memoryLimit, order.ranks, from, first); k < all.size();
       k = nextMatch(plan, options.memoryLimit, order.ranks, k + 1, first))
    result.matches.push_back(all[k]->name().str());
  if (auto err = checkMemoryLimit(plan, options.memoryLimit, /*imported=*/true))
    return err;
  return result;
}

} // namespace pipec
