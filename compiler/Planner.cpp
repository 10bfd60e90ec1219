//===- Planner.cpp - pipec plan: the best layout and schedule for a cluster ----------===//
#include "compiler/Planner.h"

#include "compiler/Partition.h"
#include "compiler/Pass.h"
#include "compiler/QuickEval.h"
#include "ir/CostModel.h"
#include "ir/Error.h"
#include "schedules/Policy.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <tuple>

namespace pipec {

llvm::StringRef toString(Outcome o) {
  switch (o) {
  case Outcome::Ranked:
    return "ranked";
  case Outcome::Fits:
    return "fits";
  case Outcome::Memory:
    return "memory";
  case Outcome::Divisibility:
    return "divisibility";
  case Outcome::Constraint:
    return "constraint";
  case Outcome::Pruned:
    return "pruned";
  }
  llvm_unreachable("unknown Outcome");
}

ModelSpec modelVariant(const ModelSpec &model, int64_t microbatchSize, Recompute recompute) {
  ModelSpec m = model;
  if (m.transformer) {
    m.transformer->microbatchSize = microbatchSize;
    m.transformer->recompute = recompute;
  }
  return m;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string mib(int64_t bytes) {
  double b = double(bytes);
  if (std::abs(b) >= double(1 << 30))
    return fmt::format("{:.2f} GiB", b / (1 << 30));
  if (std::abs(b) >= double(1 << 20))
    return fmt::format("{:.2f} MiB", b / (1 << 20));
  return fmt::format("{:.1f} KiB", b / 1024);
}

std::vector<int> divisorsOf(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0)
      out.push_back(d);
  return out;
}

/// A schedule and the virtual-stage and sequence-split settings it takes (probed through its
/// own check(), so a new policy needs nothing here).
struct ScheduleChoice {
  const SchedulePolicy *policy = nullptr;
  std::vector<int> vpps, seqSplits;
};

ScheduleChoice probe(const SchedulePolicy *policy, const PlannerOptions &o) {
  ScheduleChoice c;
  c.policy = policy;
  auto accepts = [&](int vpp, int k) {
    ParallelConfig pc;
    pc.pp = 4;
    pc.vpp = vpp;
    pc.microbatches = 64;
    pc.seqSplits = k;
    llvm::Error err = policy->check(pc);
    bool ok = !err;
    llvm::consumeError(std::move(err));
    return ok;
  };
  std::vector<int> ks = o.seqSplits;
  if (!llvm::is_contained(ks, 1))
    ks.insert(ks.begin(), 1);
  for (int v = 1; v <= std::max(1, o.maxVpp); ++v)
    if (llvm::any_of(ks, [&](int k) { return accepts(v, k); }))
      c.vpps.push_back(v);
  for (int k : o.seqSplits)
    if (llvm::any_of(c.vpps, [&](int v) { return accepts(v, k); }))
      c.seqSplits.push_back(k);
  if (c.seqSplits.empty())
    c.seqSplits.push_back(1);
  return c;
}

/// Runs fn(i) for i in [0, n) on `threads` threads.
template <typename Fn> void parallelFor(size_t n, unsigned threads, Fn &&fn) {
  if (threads <= 1 || n <= 1) {
    for (size_t i = 0; i < n; ++i)
      fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < n; i = next++)
      fn(i);
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < std::min<size_t>(threads, n); ++t)
    pool.emplace_back(worker);
  worker();
  for (std::thread &t : pool)
    t.join();
}

struct Variant {
  int64_t microbatchSize;
  Recompute recompute;
  ModelSpec model;
  double flopsPerMicrobatch = 0;
  /// Whole-sequence F + B + W of one microbatch through every layer, by tp (for ordering).
  std::map<int, double> timeByTp;
};

class Search {
public:
  Search(const ModelSpec &model, const ClusterSpec &cluster, const PlannerOptions &options)
      : model(model), cluster(cluster), o(options) {}

  llvm::Expected<PlannerResult> run();

private:
  const ModelSpec &model;
  const ClusterSpec &cluster;
  const PlannerOptions &o;
  int64_t limit = 0;
  unsigned threads = 1;
  std::vector<ScheduleChoice> schedules;
  std::vector<Variant> variants; // by (recompute, microbatch size)
  std::vector<PlanCandidate> cands;
  std::vector<size_t> variantOf; // per candidate
  std::vector<size_t> scheduleOf;
  std::mutex partitionMu;
  std::map<std::tuple<size_t, int, int>, std::vector<int>> partitions;

  llvm::Error setUp();
  size_t variantFor(int64_t b, Recompute r);
  void enumerate();
  std::vector<int> partitionFor(size_t variant, int tp, int stages);
  void evaluate(size_t index, double threshold);
  bool compile(size_t index, Plan *out);
  llvm::Error explainNothingFits() const;
};

llvm::Error Search::setUp() {
  if (o.gpus < 1)
    return inputError("--gpus must be at least 1 (got {}); try --gpus 8", o.gpus);
  if (o.globalBatch < 1)
    return inputError("--global-batch must be at least 1 (got {}); try --global-batch {}",
                      o.globalBatch, o.gpus);
  if (o.top < 1)
    return inputError("--top must be at least 1 (got {}); try --top 5", o.top);
  limit = o.memoryLimit > 0 ? o.memoryLimit : cluster.memoryBytes;
  threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  if (o.schedules.empty()) {
    for (const SchedulePolicy *p : allPolicies())
      schedules.push_back(probe(p, o));
  } else {
    for (const std::string &name : o.schedules) {
      auto p = findPolicy(name);
      if (!p)
        return inputError("--schedules: {}",
                          llvm::StringRef(takeMessage(p.takeError())).split(": ").second.str());
      if (llvm::any_of(schedules, [&](const ScheduleChoice &c) { return c.policy == *p; }))
        continue;
      schedules.push_back(probe(*p, o));
    }
  }
  if (!model.isTransformer() && !o.recompute.empty() &&
      llvm::any_of(o.recompute, [](Recompute r) { return r != Recompute::None; }))
    return inputError("--recompute: the model is an abstract layer list with given costs; "
                      "recomputation applies to a \"transformer\" model");
  for (int k : o.seqSplits)
    if (k < 1)
      return inputError("--seq-splits must list counts of at least 1 (got {}); try 1,2,4", k);
  for (int64_t b : o.microbatchSizes)
    if (b < 1)
      return inputError("--microbatch-sizes must list sizes of at least 1 (got {}); try 1,2,4", b);
  return llvm::Error::success();
}

size_t Search::variantFor(int64_t b, Recompute r) {
  for (size_t i = 0; i < variants.size(); ++i)
    if (variants[i].microbatchSize == b && variants[i].recompute == r)
      return i;
  Variant v;
  v.microbatchSize = b;
  v.recompute = r;
  v.model = modelVariant(model, b, r);
  v.flopsPerMicrobatch = v.model.modelFlopsPerMicrobatch();
  variants.push_back(std::move(v));
  return variants.size() - 1;
}

void Search::enumerate() {
  std::vector<Recompute> recomputes = o.recompute;
  if (recomputes.empty())
    recomputes.push_back(model.transformer ? model.transformer->recompute : Recompute::None);
  const int n = o.gpus;
  const int numLayers = int(model.layers.size());
  for (Recompute rec : recomputes) {
    for (int tp : divisorsOf(n)) {
      if (!model.isTransformer() && tp > 1)
        continue; // an abstract model's costs are per pipeline rank
      if (tp > cluster.gpusPerNode && !o.tpAcrossNodes)
        continue; // tensor parallelism stays within a node unless asked
      if (!o.tpSizes.empty() && !llvm::is_contained(o.tpSizes, tp))
        continue;
      PlanCandidate base;
      base.recompute = rec;
      base.parallel.tp = tp;
      base.parallel.pp = base.parallel.dp = 0; // not chosen yet (a row of --csv says so)
      base.parallel.sequenceParallel = o.sequenceParallel;
      base.parallel.distributedOptimizer = o.distributedOptimizer;
      if (model.transformer) {
        const TransformerConfig &t = *model.transformer;
        if (t.numAttentionHeads % tp || t.kvHeads() % tp || t.ffnHiddenSize % tp ||
            t.vocabSize % tp) {
          base.why =
              fmt::format("tp {} must divide the heads ({}), the key/value groups ({}), "
                          "ffn_hidden_size ({}) and vocab_size ({})",
                          tp, t.numAttentionHeads, t.kvHeads(), t.ffnHiddenSize, t.vocabSize);
          cands.push_back(base);
          variantOf.push_back(SIZE_MAX);
          scheduleOf.push_back(SIZE_MAX);
          continue;
        }
      }
      for (int pp : divisorsOf(n / tp)) {
        if (!o.ppSizes.empty() && !llvm::is_contained(o.ppSizes, pp))
          continue;
        int dp = n / tp / pp;
        PlanCandidate layout = base;
        layout.parallel.pp = pp;
        layout.parallel.dp = dp;
        auto drop = [&](std::string why) {
          layout.outcome = Outcome::Divisibility;
          layout.why = std::move(why);
          cands.push_back(layout);
          variantOf.push_back(SIZE_MAX);
          scheduleOf.push_back(SIZE_MAX);
        };
        if (pp > numLayers) {
          drop(fmt::format("pp {} exceeds the model's {} layers", pp, numLayers));
          continue;
        }
        if (o.globalBatch % dp) {
          drop(fmt::format("dp {} does not divide the global batch {}", dp, o.globalBatch));
          continue;
        }
        int64_t perReplica = o.globalBatch / dp;
        std::vector<int64_t> sizes;
        if (!model.isTransformer()) {
          sizes.push_back(1);
        } else if (!o.microbatchSizes.empty()) {
          sizes = o.microbatchSizes;
        } else {
          for (int64_t b = 1; b <= std::min(perReplica, o.maxMicrobatchSize); ++b)
            if (perReplica % b == 0)
              sizes.push_back(b);
        }
        for (int64_t b : sizes) {
          layout.microbatchSize = b;
          if (perReplica % b) {
            drop(fmt::format("microbatch size {} does not divide the {} sequences per replica", b,
                             perReplica));
            continue;
          }
          int64_t m = perReplica / b;
          if (m > (1 << 24)) {
            drop(fmt::format("{} microbatches per step is beyond what pipec plans (2^24)", m));
            continue;
          }
          size_t variant = variantFor(b, rec);
          for (size_t si = 0; si < schedules.size(); ++si) {
            const ScheduleChoice &sc = schedules[si];
            for (int vpp : sc.vpps)
              for (int k : sc.seqSplits) {
                PlanCandidate c = layout;
                c.schedule = sc.policy->name().str();
                c.parallel.vpp = vpp;
                c.parallel.microbatches = int(m);
                c.parallel.seqSplits = k;
                c.outcome = Outcome::Fits; // until evaluated
                if (int64_t(pp) * vpp > numLayers) {
                  c.outcome = Outcome::Divisibility;
                  c.why = fmt::format("pp {} x vpp {} stages exceed the model's {} layers", pp, vpp,
                                      numLayers);
                } else {
                  CompileOptions co;
                  co.schedule = c.schedule;
                  co.parallel = c.parallel;
                  llvm::Error err = checkCompileOptions(co);
                  if (!err)
                    err = sc.policy->check(c.parallel);
                  if (err) {
                    c.outcome = Outcome::Constraint;
                    c.why = takeMessage(std::move(err));
                  }
                }
                cands.push_back(std::move(c));
                variantOf.push_back(variant);
                scheduleOf.push_back(si);
              }
          }
        }
      }
    }
  }
}

std::vector<int> Search::partitionFor(size_t variant, int tp, int stages) {
  auto key = std::make_tuple(variant, tp, stages);
  {
    std::lock_guard<std::mutex> lock(partitionMu);
    auto it = partitions.find(key);
    if (it != partitions.end())
      return it->second;
  }
  const ModelSpec &m = variants[variant].model;
  // The partition pass's input: whole-sequence costs of every layer (its seq_splits only
  // matter to an abstract model without a seq_length, whose costs do not depend on it).
  std::vector<int> ends = exactPartition(layerTimes(m, cluster, m.sequenceLength(1), tp), stages);
  std::lock_guard<std::mutex> lock(partitionMu);
  partitions.emplace(key, ends);
  return ends;
}

/// Bytes the largest op of a microbatch of `st` holds on its rank while its backward runs.
int64_t lifetimeBytes(const StageInfo &st, size_t k) {
  return activationLifetimePeak(st, int(k)) + workspaceBytes(st, int(k));
}

void Search::evaluate(size_t index, double threshold) {
  PlanCandidate &c = cands[index];
  const Variant &var = variants[variantOf[index]];
  const SchedulePolicy &policy = *schedules[scheduleOf[index]].policy;
  const ParallelConfig &pc = c.parallel;
  Plan plan;
  plan.schedule = c.schedule;
  plan.model = model.name;
  plan.timeUnit = model.timeUnit().str();
  plan.parallel = pc;
  plan.placement = policy.placement();
  plan.gpusPerNode = cluster.gpusPerNode;
  plan.stateBytesPerParamByte = var.model.stateBytesPerParamByte;
  plan.transformer = var.model.transformer;
  if (llvm::Error err = seqSlicesFor(var.model, cluster, pc, plan.seqSlices)) {
    c.outcome = Outcome::Constraint;
    c.why = takeMessage(std::move(err));
    return;
  }
  buildStages(plan, var.model, cluster, partitionFor(variantOf[index], pc.tp, pc.numStages()));

  // Memory lower bound: static bytes and the most one microbatch holds, on every rank.
  std::vector<int64_t> params(size_t(pc.pp), 0), most(size_t(pc.pp), 0);
  for (const StageInfo &st : plan.stages) {
    params[size_t(st.rank)] += st.paramBytes;
    for (size_t k = 0; k < size_t(pc.seqSplits); ++k)
      most[size_t(st.rank)] = std::max(most[size_t(st.rank)], lifetimeBytes(st, k));
  }
  int64_t maxStatic = 0, bound = 0;
  for (int r = 0; r < pc.pp; ++r) {
    int64_t stat = int64_t(double(params[size_t(r)]) * plan.stateBytesPerParamByte);
    maxStatic = std::max(maxStatic, stat);
    if (stat + most[size_t(r)] > bound) {
      bound = stat + most[size_t(r)];
      c.worstRank = r;
    }
  }
  c.peakMemoryBytes = bound;
  if (bound > limit) {
    c.outcome = Outcome::Memory;
    c.why = fmt::format("rank {} needs at least {} (weights, gradients and optimizer state and "
                        "one microbatch) of {}",
                        c.worstRank, mib(bound), mib(limit));
    return;
  }

  // Step-time lower bound: the busiest rank's compute and tp all-reduces, after the forwards
  // of the stages before its first one (the first microbatch must pass them).
  double timeBound = 0;
  {
    std::vector<double> occupied(size_t(pc.pp), 0), trailing(size_t(pc.pp), 0);
    std::vector<int> firstStage(size_t(pc.pp), INT32_MAX);
    for (const StageInfo &st : plan.stages) {
      size_t r = size_t(st.rank);
      firstStage[r] = std::min(firstStage[r], st.stage);
      int parts = pc.tp > 1 ? st.tpAllReduces : 0;
      for (size_t k = 0; k < size_t(pc.seqSplits); ++k) {
        double ar = parts > 0 ? st.tpAllReduceTime[k] : 0;
        occupied[r] += double(pc.microbatches) * (st.forward[k] + st.backwardInput[k] +
                                                  st.backwardWeight[k] + 2.0 * parts * ar);
        trailing[r] = std::max(trailing[r], ar);
      }
    }
    for (int r = 0; r < pc.pp; ++r) {
      double fill = 0;
      for (int s = 0; s < firstStage[size_t(r)]; ++s)
        fill += *std::min_element(plan.stages[size_t(s)].forward.begin(),
                                  plan.stages[size_t(s)].forward.end());
      timeBound = std::max(timeBound, fill + occupied[size_t(r)] - trailing[size_t(r)]);
    }
  }
  c.stepTimeBound = timeBound;
  if (timeBound * (1 - 1e-9) > threshold) {
    c.outcome = Outcome::Pruned;
    c.why = "its step-time lower bound exceeds the top-K step time found";
    return;
  }

  ScheduleRequest request;
  request.parallel = pc;
  request.stages = plan.stages;
  if (c.schedule == "zb-auto") {
    // zb-auto at the device's memory: what is left of it for activations on the fullest rank,
    // less room for two receive buffers each way.
    int64_t buffers = 0;
    for (const StageInfo &st : plan.stages)
      for (int64_t b : st.outputBytes)
        buffers = std::max(buffers, b);
    c.zbAutoLimit = std::max<int64_t>(0, limit - maxStatic - 4 * buffers);
    request.memoryLimit = c.zbAutoLimit;
  }
  if (llvm::Error err = policy.checkRequest(request)) {
    c.outcome = Outcome::Constraint;
    c.why = takeMessage(std::move(err));
    return;
  }
  ComputeOrder order;
  policy.emit(request, order);
  plan.ranks = std::move(order);
  QuickStats stats;
  if (llvm::Error err = quickEvaluate(plan, stats)) {
    // A policy's order that cannot run is a bug of the policy; report it as a constraint
    // rather than stop the search.
    c.outcome = Outcome::Constraint;
    c.why = takeMessage(std::move(err));
    return;
  }
  c.simulated = true;
  c.stepTime = stats.stepTime;
  c.bubbleRatio = stats.bubbleRatio;
  int64_t peak = 0;
  for (int r = 0; r < pc.pp; ++r) {
    int64_t bytes = stats.staticBytes[size_t(r)] + stats.peakActivationBytes[size_t(r)];
    if (bytes > peak) {
      peak = bytes;
      c.worstRank = r;
    }
  }
  c.peakMemoryBytes = peak;
  if (peak > limit) {
    c.outcome = Outcome::Memory;
    c.why = fmt::format("rank {} peaks at {} (without receive buffers) of {}", c.worstRank,
                        mib(peak), mib(limit));
    return;
  }
  c.outcome = Outcome::Fits;
}

bool Search::compile(size_t index, Plan *out) {
  PlanCandidate &c = cands[index];
  CompileOptions co;
  co.schedule = c.schedule;
  co.parallel = c.parallel;
  co.memoryLimit = c.zbAutoLimit;
  auto plan = compilePlan(variants[variantOf[index]].model, cluster, co);
  c.compiled = true;
  if (!plan) {
    c.outcome = Outcome::Constraint;
    c.why = takeMessage(plan.takeError());
    return false;
  }
  int64_t peak = 0;
  for (const RankStats &r : plan->stats.ranks)
    if (r.peakMemoryBytes > peak) {
      peak = r.peakMemoryBytes;
      c.worstRank = r.rank;
    }
  c.peakMemoryBytes = peak;
  // quickEvaluate computes the step time the full pipeline does; the compiled plan is the
  // authority all the same.
  c.stepTime = plan->stats.stepTime;
  c.bubbleRatio = plan->stats.bubbleRatio;
  if (peak > limit) {
    c.outcome = Outcome::Memory;
    c.why = fmt::format("rank {} peaks at {} of {}", c.worstRank, mib(peak), mib(limit));
    return false;
  }
  if (out)
    *out = std::move(*plan);
  return true;
}

llvm::Error Search::explainNothingFits() const {
  // Layouts exist (else run() reported bad input): all are over the memory limit.
  const PlanCandidate *closest = nullptr;
  for (const PlanCandidate &c : cands)
    if (c.outcome == Outcome::Memory && (!closest || c.peakMemoryBytes < closest->peakMemoryBytes))
      closest = &c;
  if (!closest)
    return finding("no layout of {} GPUs could be scheduled (every candidate failed a "
                   "schedule's constraint); see --csv for each one's reason",
                   o.gpus);
  const ParallelConfig &pc = closest->parallel;
  return finding("no layout of {} GPUs fits in {} per GPU: the closest, {} with tp={} pp={} "
                 "vpp={} dp={} microbatch size {} seq-splits {} recompute {}, needs {} on rank "
                 "{} ({} short); try --memory-limit {}, more GPUs, or --recompute full",
                 o.gpus, mib(limit), closest->schedule, pc.tp, pc.pp, pc.vpp, pc.dp,
                 closest->microbatchSize, pc.seqSplits, toString(closest->recompute).str(),
                 mib(closest->peakMemoryBytes), closest->worstRank,
                 mib(closest->peakMemoryBytes - limit), closest->peakMemoryBytes);
}

llvm::Expected<PlannerResult> Search::run() {
  if (llvm::Error err = setUp())
    return err;
  enumerate();

  // Candidates that passed the structural checks, cheapest-looking first: whole-model time of
  // one microbatch times microbatches, over pipeline ranks (a rough estimate, only an order).
  std::vector<size_t> open;
  for (size_t i = 0; i < cands.size(); ++i)
    if (cands[i].outcome == Outcome::Fits)
      open.push_back(i);
  if (open.empty()) {
    bool batchIsTheProblem = false;
    for (const PlanCandidate &c : cands)
      batchIsTheProblem |= llvm::StringRef(c.why).contains("global batch") ||
                           llvm::StringRef(c.why).contains("per replica");
    // The nearest GPU count and global batch with a layout that passes the structural checks.
    auto layoutsExist = [&](int gpus, int64_t batch) {
      PlannerOptions probeOptions = o;
      probeOptions.gpus = gpus;
      probeOptions.globalBatch = batch;
      Search s(model, cluster, probeOptions);
      if (llvm::Error err = s.setUp()) {
        llvm::consumeError(std::move(err));
        return false;
      }
      s.enumerate();
      return llvm::any_of(s.cands,
                          [](const PlanCandidate &c) { return c.outcome == Outcome::Fits; });
    };
    if (batchIsTheProblem) {
      // A layout of dp replicas takes a multiple of dp: one is within gpus of any batch.
      for (int64_t d = 1; d <= o.globalBatch + o.gpus; ++d)
        for (int64_t b : {o.globalBatch - d, o.globalBatch + d})
          if (b >= 1 && layoutsExist(o.gpus, b))
            return inputError("--global-batch {}: no layout of {} GPUs divides it into dp x "
                              "microbatches x microbatch size; try --global-batch {}",
                              o.globalBatch, o.gpus, b);
    }
    for (int d = 1; d <= o.gpus; ++d)
      for (int g : {o.gpus - d, o.gpus + d})
        if (g >= 1 && layoutsExist(g, o.globalBatch))
          return inputError("--gpus {}: no layout tp x pp x dp = {} fits this model, the "
                            "global batch {} and the schedules asked for; try --gpus {}",
                            o.gpus, o.gpus, o.globalBatch, g);
    return inputError("--gpus {}: no layout fits this model and --global-batch {}; see "
                      "--csv for each candidate's reason",
                      o.gpus, o.globalBatch);
  }
  std::vector<double> order(cands.size(), 0);
  for (size_t i : open) {
    Variant &v = variants[variantOf[i]];
    const ParallelConfig &pc = cands[i].parallel;
    auto it = v.timeByTp.find(pc.tp);
    if (it == v.timeByTp.end()) {
      std::vector<double> t = layerTimes(v.model, cluster, v.model.sequenceLength(1), pc.tp);
      it = v.timeByTp.emplace(pc.tp, std::accumulate(t.begin(), t.end(), 0.0)).first;
    }
    order[i] = it->second * double(pc.microbatches) / double(pc.pp);
  }
  std::stable_sort(open.begin(), open.end(),
                   [&](size_t a, size_t b) { return order[a] < order[b]; });

  // Fitting candidates by (step time, enumeration order); compiled ones that fit are final.
  auto better = [&](size_t a, size_t b) {
    return std::tie(cands[a].stepTime, a) < std::tie(cands[b].stepTime, b);
  };
  std::vector<size_t> fitting;
  const size_t top = size_t(o.top);
  double threshold = kInf;
  // Compile, in parallel, the best quick-evaluated candidates until the first K fitting ones
  // are all compiled (a compiled one may turn out over the limit: receive buffers).
  auto settle = [&]() {
    for (;;) {
      std::sort(fitting.begin(), fitting.end(), better);
      std::vector<size_t> need;
      for (size_t i = 0; i < fitting.size() && i < top; ++i)
        if (!cands[fitting[i]].compiled)
          need.push_back(fitting[i]);
      if (need.empty())
        break;
      parallelFor(need.size(), threads, [&](size_t j) { compile(need[j], nullptr); });
      llvm::erase_if(fitting, [&](size_t i) { return cands[i].outcome != Outcome::Fits; });
    }
    threshold = fitting.size() >= top ? cands[fitting[top - 1]].stepTime : kInf;
  };
  // A wave size that does not depend on the thread count: which candidates are compiled in
  // full (the CSV's peak_memory_exact) must not change with --threads.
  const size_t wave = 64;
  for (size_t begin = 0; begin < open.size(); begin += wave) {
    size_t end = std::min(open.size(), begin + wave);
    parallelFor(end - begin, threads, [&](size_t j) { evaluate(open[begin + j], threshold); });
    for (size_t j = begin; j < end; ++j)
      if (cands[open[j]].outcome == Outcome::Fits)
        fitting.push_back(open[j]);
    settle();
  }
  if (fitting.empty())
    return explainNothingFits();

  PlannerResult result;
  result.memoryLimit = limit;
  std::sort(fitting.begin(), fitting.end(), better);
  for (size_t i = 0; i < fitting.size() && i < top; ++i) {
    cands[fitting[i]].outcome = Outcome::Ranked;
    result.ranked.push_back(fitting[i]);
    const Variant &v = variants[variantOf[fitting[i]]];
    const ParallelConfig &pc = cands[fitting[i]].parallel;
    result.modelFlops.push_back(v.flopsPerMicrobatch * pc.microbatches * pc.dp);
  }
  if (model.transformer)
    result.tokensPerStep = o.globalBatch * model.transformer->seqLength;
  // The best plan, compiled once more to keep it (compiling is deterministic).
  Plan best;
  PlanCandidate keep = cands[result.ranked[0]];
  bool ok = compile(result.ranked[0], &best);
  cands[result.ranked[0]] = keep;
  if (!ok)
    return finding("the best candidate no longer compiles; this is a bug");
  result.best = std::move(best);
  result.candidates = std::move(cands);
  return result;
}

} // namespace

llvm::Expected<PlannerResult> planLayouts(const ModelSpec &model, const ClusterSpec &cluster,
                                          const PlannerOptions &options) {
  Search search(model, cluster, options);
  return search.run();
}

std::string plannerCsv(const ModelSpec &model, const ClusterSpec &cluster,
                       const PlannerOptions &options, const PlannerResult &result) {
  std::string out = "recompute,tp,pp,vpp,dp,microbatch_size,microbatches,seq_splits,schedule,"
                    "outcome,step_time,step_time_bound,bubble_ratio,peak_memory_bytes,"
                    "peak_memory_exact,worst_rank,tokens_per_s,model_tflops_per_gpu,mfu,why\n";
  auto quote = [](llvm::StringRef s) {
    std::string q = "\"";
    for (char ch : s) {
      if (ch == '"')
        q += '"';
      q += ch == '\n' ? ' ' : ch;
    }
    return q + "\"";
  };
  double seq = model.transformer ? double(model.transformer->seqLength) : 0;
  for (const PlanCandidate &c : result.candidates) {
    const ParallelConfig &pc = c.parallel;
    std::string time, bound, bubble, tokens, tflops, mfu;
    if (c.simulated) {
      time = fmt::format("{:.6g}", c.stepTime);
      bubble = fmt::format("{:.4f}", c.bubbleRatio);
      if (model.transformer && c.stepTime > 0) {
        double seconds = c.stepTime / 1000;
        tokens = fmt::format("{:.6g}", double(options.globalBatch) * seq / seconds);
        double flops =
            modelVariant(model, c.microbatchSize, c.recompute).modelFlopsPerMicrobatch() *
            pc.microbatches * pc.dp;
        double perGpu = flops / seconds / options.gpus;
        tflops = fmt::format("{:.4g}", perGpu / 1e12);
        mfu = fmt::format("{:.4f}", perGpu / (cluster.peakTflops * 1e12));
      }
    }
    if (c.stepTimeBound > 0)
      bound = fmt::format("{:.6g}", c.stepTimeBound);
    out += fmt::format(
        "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
        toString(c.recompute).str(), pc.tp, pc.pp ? std::to_string(pc.pp) : "",
        c.schedule.empty() ? "" : std::to_string(pc.vpp), pc.pp ? std::to_string(pc.dp) : "",
        c.schedule.empty() ? "" : std::to_string(c.microbatchSize),
        c.schedule.empty() ? "" : std::to_string(pc.microbatches),
        c.schedule.empty() ? "" : std::to_string(pc.seqSplits),
        c.schedule.empty() ? "*" : c.schedule, toString(c.outcome).str(), time, bound, bubble,
        c.peakMemoryBytes ? std::to_string(c.peakMemoryBytes) : "",
        c.peakMemoryBytes ? (c.compiled ? "yes" : "no") : "",
        c.peakMemoryBytes ? std::to_string(c.worstRank) : "", tokens, tflops, mfu, quote(c.why));
  }
  return out;
}

} // namespace pipec
