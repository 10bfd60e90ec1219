//===- Planner.cpp - pipec plan: the best layout and schedule for a cluster ----------===//
#include "compiler/Planner.h"

#include "compiler/Budget.h"

#include "compiler/Evaluate.h"
#include "compiler/LowerCollectives.h"
#include "compiler/Partition.h"
#include "compiler/Pass.h"
#include "ir/CostModel.h"
#include "ir/MeasuredCosts.h"
#include "ir/support/Bytes.h"
#include "ir/support/Error.h"
#include "ir/support/Limits.h"
#include "schedules/Policy.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"

#include <fmt/format.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

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

std::string scheduleLabel(const PlanCandidate &c) {
  return c.parallel.pp == 1 && !c.schedule.empty() ? kNoPipelineLabel : c.schedule;
}

std::string compileFlags(const PlanCandidate &c, const PlannerOptions &options, bool transformer) {
  const ParallelConfig &pc = c.parallel;
  std::string out = fmt::format("--schedule {} --pp {}", c.schedule, pc.pp);
  if (pc.vpp != 1)
    out += fmt::format(" --vpp {}", pc.vpp);
  out += fmt::format(" --microbatches {}", pc.microbatches);
  if (pc.seqSplits != 1)
    out += fmt::format(" --seq-splits {}", pc.seqSplits);
  out += fmt::format(" --tp {}", pc.tp);
  if (pc.cp > 1)
    out += fmt::format(" --cp {}", pc.cp);
  out += fmt::format(" --dp {} --recompute {}", pc.dp, toString(c.recompute).str());
  if (transformer)
    out += fmt::format(" --microbatch-size {}", c.microbatchSize);
  if (pc.sequenceParallel)
    out += " --sequence-parallel";
  if (pc.distributedOptimizer)
    out += " --distributed-optimizer";
  if (c.zbAutoLimit)
    out += fmt::format(" --memory-limit {}", c.zbAutoLimit);
  if (options.evenPartition)
    out += " --partition even";
  if (c.measured && !options.costsSource.empty())
    out += " " + options.costsSource;
  return out;
}

bool coversCandidate(const MeasuredCosts &costs, const PlanCandidate &c) {
  const ParallelConfig &pc = c.parallel;
  return int64_t(pc.pp) * pc.vpp == costs.numStages && pc.seqSplits == costs.numSlices &&
         (costs.ranks.empty() || costs.ranks.size() == size_t(pc.pp));
}

int64_t headroomFor(int64_t minHeadroom, double percent, int64_t limit) {
  if (minHeadroom >= 0)
    return minHeadroom;
  if (percent == std::floor(percent))
    return limit / 100 * int64_t(percent);
  return int64_t(double(limit) * percent / 100);
}

int64_t limitThatFits(int64_t minHeadroom, double percent, int64_t peak) {
  if (minHeadroom >= 0)
    return peak + minHeadroom;
  // The least L with L - headroomFor(L) >= peak, near where the percentage puts it (the
  // integer rounding makes L - headroomFor(L) step unevenly: L is the least of the ones near).
  auto fits = [&](int64_t l) { return l - headroomFor(-1, percent, l) >= peak; };
  int64_t l = int64_t(std::ceil(double(peak) * 100 / (100 - percent)));
  while (!fits(l))
    ++l;
  const int64_t near = 200 + int64_t(200 * percent / (100 - percent));
  for (int64_t k = l - 1; k >= peak && k >= l - near; --k)
    if (fits(k))
      l = k;
  return l;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
/// The most microbatches per step pipec plans.
constexpr int64_t kMostMicrobatches = kMaxFlagCount;

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
  /// Not asked for: only the no-pipeline layout (pp 1) uses it.
  bool noPipelineOnly = false;
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
  /// Whole-sequence F + B + W of one microbatch through every layer, by tp (for ordering).
  std::map<std::pair<int, int>, double> timeByTp; // by (tp, cp)
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
  /// What a plan may use: limit less the headroom it must leave.
  int64_t fit = 0, headroom = 0;
  unsigned threads = 1;
  std::vector<ScheduleChoice> schedules;
  /// schedules' entry for the no-pipeline layout (1f1b).
  size_t noPipeline = 0;
  std::vector<Variant> variants; // by (recompute, microbatch size)
  std::vector<PlanCandidate> cands;
  /// With --costs: the candidates the file covers by layout but refused (another model's
  /// profile, or a switch its times would cancel), by index (each written by its own evaluation).
  std::vector<char> refusedByCosts;
  std::vector<size_t> variantOf; // per candidate
  std::vector<size_t> scheduleOf;
  std::mutex partitionMu;
  std::map<std::tuple<size_t, int, int, int>, std::vector<int>> partitions;
  /// seqSlicesFor's answer (the slices, or its error's message) and the slice costs of every
  /// layer (layerSliceCosts) by (variant, seq splits, tp, split rule, sequence parallelism):
  /// the same for every pp, vpp, schedule and ZeRO setting.
  struct Slicing {
    std::vector<std::pair<int64_t, int64_t>> slices;
    std::string why;
    std::vector<SliceCost> costs;
  };
  std::map<std::tuple<size_t, int, int, bool, bool, int>, Slicing> slicings;

  llvm::Error setUp();
  size_t variantFor(int64_t b, Recompute r);
  void enumerate();
  std::vector<int> partitionFor(size_t variant, int tp, int cp, int stages);
  /// seqSlicesFor(variant's model, cluster, pc) and its slices' costs, cached (entries stay
  /// put: std::map).
  const Slicing &slicingFor(size_t variant, const ParallelConfig &pc);
  void evaluate(size_t index, double threshold);
  bool compile(size_t index, Plan *out);
  llvm::Error explainNothingFits();
  llvm::Error explainNoLayout() const;
  // explainNoLayout's arithmetic (no search): whether --pp allows pp; whether some microbatch
  // size splits `perReplica` into a count a schedule takes at pp; the global batch nearest
  // --global-batch for these (tp, pp) pairs, and the GPU count nearest --gpus for these tp
  // values (0: none).
  bool ppAllowed(int pp) const;
  bool splits(int pp, int64_t perReplica) const;
  int64_t nearestBatch(const std::vector<std::pair<int, int>> &pairs) const;
  int64_t nearestGpus(const std::vector<int> &tps) const;
  std::vector<int64_t> microbatchSizesFor(int64_t perReplica) const;
  bool tpAllowed(int tp) const;
  bool scheduleOpen(int pp, int64_t microbatches) const;
  /// The recomputation settings enumerated: --recompute's, else none, selective where it
  /// changes something (materialized attention) and full; with --costs, the model's own.
  std::vector<Recompute> recomputeSettings() const;
  /// A switch's settings to try: the fixed one (where it applies), else off and on where it
  /// applies (never searched with --costs: the profile was measured with one setting).
  std::vector<bool> switchSettings(std::optional<bool> fixed, bool applies) const;
  /// With --costs: one line (naming the flag) when the file covers no open candidate.
  llvm::Error checkCostsCover() const;
};

std::vector<Recompute> Search::recomputeSettings() const {
  if (!o.recompute.empty())
    return o.recompute;
  if (!model.transformer)
    return {Recompute::None};
  if (o.costs)
    return {model.transformer->recompute};
  if (model.transformer->attention == Attention::Flash)
    return {Recompute::None, Recompute::Full};
  return {Recompute::None, Recompute::Selective, Recompute::Full};
}

std::vector<bool> Search::switchSettings(std::optional<bool> fixed, bool applies) const {
  if (!applies || !model.isTransformer())
    return {false};
  if (fixed)
    return {*fixed};
  if (o.costs)
    return {false};
  return {false, true};
}

llvm::Error Search::checkCostsCover() const {
  if (!o.costs)
    return llvm::Error::success();
  std::vector<int64_t> stageCounts;
  for (const PlanCandidate &c : cands) {
    if (c.outcome != Outcome::Fits)
      continue;
    if (coversCandidate(*o.costs, c))
      return llvm::Error::success();
    int64_t n = int64_t(c.parallel.pp) * c.parallel.vpp;
    if (!llvm::is_contained(stageCounts, n))
      stageCounts.push_back(n);
  }
  llvm::sort(stageCounts);
  std::string counts;
  for (int64_t n : stageCounts)
    counts += (counts.empty() ? "" : ",") + std::to_string(n);
  const MeasuredCosts &m = *o.costs;
  return inputError("{}: measured on {} stages with {} sub-sequences{}, and no candidate of "
                    "this search has that layout (their pp x vpp: {}); profile a plan of a "
                    "layout the search tries, or let it try the file's: its pp divides the GPUs "
                    "over --tp, and --pp, --max-vpp and --seq-splits allow it",
                    o.costsSource, m.numStages, m.numSlices,
                    m.ranks.empty() ? std::string()
                                    : fmt::format(" on {} pipeline ranks", m.ranks.size()),
                    counts);
}

llvm::Error Search::setUp() {
  if (o.gpus < 1)
    return inputError("--gpus must be at least 1 (got {}); try --gpus 8", o.gpus);
  if (o.globalBatch < 1)
    return inputError("--global-batch must be at least 1 (got {}); try --global-batch {}",
                      o.globalBatch, o.gpus);
  if (o.top < 1)
    return inputError("--top must be at least 1 (got {}); try --top 5", o.top);
  limit = o.memoryLimit > 0 ? o.memoryLimit : cluster.memoryBytes;
  headroom = headroomFor(o.minHeadroom, o.minHeadroomPercent, limit);
  if (headroom >= limit)
    return inputError("--min-headroom {} leaves nothing of the {} memory limit; try "
                      "--min-headroom {}%",
                      humanBytes(headroom), humanBytes(limit), kDefaultHeadroomPercent);
  fit = limit - headroom;
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
      // A schedule asked for by name that --max-vpp leaves no chunk count: named, with the
      // least --max-vpp that gives it one (else the search found nothing and said --gpus).
      if (schedules.back().vpps.empty()) {
        PlannerOptions wider = o;
        wider.maxVpp = 64;
        const std::vector<int> takes = probe(*p, wider).vpps;
        return inputError("--max-vpp {}: {} needs more chunks per rank{}", o.maxVpp, name,
                          takes.empty() ? std::string()
                                        : fmt::format("; try --max-vpp {}", takes.front()));
      }
    }
  }
  // Seq1F1B with one sub-sequence is its plain schedule (seq1f1b: 1f1b, seq1f1b-interleaved:
  // interleaved-1f1b), the same order under another label: where both are searched, K = 1 is
  // left to the plain one.
  for (ScheduleChoice &c : schedules) {
    llvm::StringRef name = c.policy->name();
    if (!name.consume_front("seq1f1b"))
      continue;
    std::string plain = name.empty() ? "1f1b" : name.drop_front().str() + "-1f1b";
    if (llvm::any_of(schedules, [&](const ScheduleChoice &d) { return d.policy->name() == plain; }))
      llvm::erase_value(c.seqSplits, 1);
  }
  llvm::erase_if(schedules, [](const ScheduleChoice &c) { return c.seqSplits.empty(); });
  // pp 1 is one layout, "no pipeline", compiled as 1f1b whatever --schedules lists: at one
  // rank every schedule's order is a microbatch's forwards then its backwards, and virtual
  // stages or sub-sequences would change only the label.
  auto oneFOneB =
      llvm::find_if(schedules, [](const ScheduleChoice &c) { return c.policy->name() == "1f1b"; });
  if (oneFOneB == schedules.end()) {
    auto p = findPolicy("1f1b");
    if (!p)
      return p.takeError();
    ScheduleChoice c;
    c.policy = *p;
    c.vpps = {1};
    c.seqSplits = {1};
    c.noPipelineOnly = true;
    schedules.push_back(c);
    noPipeline = schedules.size() - 1;
  } else {
    noPipeline = size_t(oneFOneB - schedules.begin());
  }
  if (!model.isTransformer() && !o.recompute.empty() &&
      llvm::any_of(o.recompute, [](Recompute r) { return r != Recompute::None; }))
    return inputError("--recompute: the model is an abstract layer list with given costs; "
                      "recomputation applies to a \"transformer\" model");
  for (int k : o.seqSplits)
    if (k < 1)
      return inputError("--seq-splits must list counts of at least 1 (got {}); try 1,2,4", k);
  for (int cp : o.cpSizes) {
    if (cp < 1 || cp > kMaxTpDp)
      return inputError("--cp must list sizes from 1 to {} (got {}); try --cp 1,2", kMaxTpDp, cp);
    ParallelConfig pc;
    pc.cp = cp;
    // The suggestion also divides --gpus, or it would fail again with another suggestion.
    if (llvm::Error err = checkContextParallel(model, pc, o.gpus))
      return err;
  }
  if (o.costs) {
    // The file says how many stages, sub-sequences and ranks it was measured on, not the
    // model variant or tensor parallelism: those are the flags', one value each.
    if (!model.isTransformer())
      return inputError("--costs: measured costs are in ms, but the model is an abstract layer "
                        "list (times in '{}'); use --costs with a transformer model spec",
                        model.timeUnit().str());
    if (o.tpSizes.size() != 1)
      return inputError("--costs: a costs file does not record the tp it was measured at; give "
                        "the profiled plan's as one --tp value (try --tp 1)");
    if (o.microbatchSizes.size() != 1)
      return inputError("--costs: a costs file does not record the microbatch size it was "
                        "measured at; give the profiled plan's as one --microbatch-sizes value "
                        "(try --microbatch-sizes {})",
                        model.transformer->microbatchSize);
    if (o.recompute.size() > 1)
      return inputError("--costs: a costs file was measured with one recomputation setting; "
                        "give it as one --recompute value (default: the model's own)");
  }
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
  variants.push_back(std::move(v));
  return variants.size() - 1;
}

void Search::enumerate() {
  const std::vector<Recompute> recomputes = recomputeSettings();
  // --cp's sizes, each once, ascending.
  std::vector<int> cps = o.cpSizes;
  llvm::sort(cps);
  cps.erase(std::unique(cps.begin(), cps.end()), cps.end());
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
      if (model.transformer) {
        const TransformerConfig &t = *model.transformer;
        // (The vocabulary need not divide: Megatron-LM pads it to a multiple of 128 x tp, and
        // the cost model splits it as it is; piperun, which does not pad, says so itself.)
        if (t.numAttentionHeads % tp || t.kvHeads() % tp || t.ffnHiddenSize % tp) {
          base.why = fmt::format("tp {} must divide the heads ({}), the key/value groups ({}) and "
                                 "ffn_hidden_size ({})",
                                 tp, t.numAttentionHeads, t.kvHeads(), t.ffnHiddenSize);
          cands.push_back(base);
          variantOf.push_back(SIZE_MAX);
          scheduleOf.push_back(SIZE_MAX);
          continue;
        }
      }
      for (int cp : cps) {
        if ((n / tp) % cp) {
          PlanCandidate c = base;
          c.parallel.cp = cp;
          c.why = fmt::format("cp {} does not divide the {} GPUs left over tp {}", cp, n / tp, tp);
          cands.push_back(c);
          variantOf.push_back(SIZE_MAX);
          scheduleOf.push_back(SIZE_MAX);
          continue;
        }
        for (int pp : divisorsOf(n / tp / cp)) {
          if (!o.ppSizes.empty() && !llvm::is_contained(o.ppSizes, pp))
            continue;
          int dp = n / tp / cp / pp;
          PlanCandidate layout = base;
          layout.parallel.cp = cp;
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
          for (int64_t b : microbatchSizesFor(perReplica)) {
            layout.microbatchSize = b;
            if (perReplica % b) {
              drop(fmt::format("microbatch size {} does not divide the {} sequences per replica", b,
                               perReplica));
              continue;
            }
            int64_t m = perReplica / b;
            if (m > kMostMicrobatches) {
              drop(fmt::format("{} microbatches per step is beyond what pipec plans (2^24)", m));
              continue;
            }
            size_t variant = variantFor(b, rec);
            for (size_t si = 0; si < schedules.size(); ++si) {
              const ScheduleChoice &sc = schedules[si];
              // pp 1: the no-pipeline entry only; pp > 1: every schedule asked for (1f1b
              // included when listed, which is also the no-pipeline entry).
              if (pp == 1 ? si != noPipeline : sc.noPipelineOnly)
                continue;
              // With cp > 1 no sub-sequences: a schedule tried only with them (the Seq1F1B
              // family, whose one-slice order is its plain schedule's) is not a candidate.
              if (cp > 1 && pp > 1 && !llvm::is_contained(sc.seqSplits, 1))
                continue;
              for (int vpp : pp == 1 ? std::vector<int>{1} : sc.vpps)
                // (Context parallelism cuts the sequence itself: one slice.)
                for (int k : pp == 1 || cp > 1 ? std::vector<int>{1} : sc.seqSplits) {
                  PlanCandidate c = layout;
                  c.schedule = sc.policy->name().str();
                  c.parallel.vpp = vpp;
                  c.parallel.microbatches = int(m);
                  c.parallel.seqSplits = k;
                  c.outcome = Outcome::Fits; // until evaluated
                  if (int64_t(pp) * vpp > numLayers) {
                    c.outcome = Outcome::Divisibility;
                    c.why = fmt::format("pp {} x vpp {} stages exceed the model's {} layers", pp,
                                        vpp, numLayers);
                  } else if (o.evenPartition && evenSplitUnits(model) % (pp * vpp) != 0) {
                    c.outcome = Outcome::Divisibility;
                    c.why = fmt::format("--partition even: pp {} x vpp {} stages do not divide "
                                        "the model's {} {}",
                                        pp, vpp, evenSplitUnits(model),
                                        model.isTransformer() ? "blocks" : "layers");
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
                  // Sequence parallelism (tp > 1) and ZeRO-1 (dp > 1), each off then on, unless
                  // fixed: the same layout, other memory and communication.
                  for (bool sp : switchSettings(o.sequenceParallel, tp > 1))
                    for (bool zero : switchSettings(o.distributedOptimizer, dp * cp > 1)) {
                      PlanCandidate v = c;
                      v.parallel.sequenceParallel = sp;
                      v.parallel.distributedOptimizer = zero;
                      // Sequence parallelism splits each cp rank's tokens over tp.
                      int fits = 1;
                      if (v.outcome == Outcome::Fits && cp > 1)
                        if (std::optional<std::string> why =
                                contextParallelProblem(model.transformer, v.parallel, fits)) {
                          v.outcome = Outcome::Constraint;
                          v.why = fmt::format("cp {} {}", cp, *why);
                        }
                      cands.push_back(std::move(v));
                      variantOf.push_back(variant);
                      scheduleOf.push_back(si);
                    }
                }
            }
          }
        }
      }
    }
  }
}

std::vector<int> Search::partitionFor(size_t variant, int tp, int cp, int stages) {
  auto key = std::make_tuple(variant, tp, cp, stages);
  {
    std::lock_guard<std::mutex> lock(partitionMu);
    auto it = partitions.find(key);
    if (it != partitions.end())
      return it->second;
  }
  const ModelSpec &m = variants[variant].model;
  // The partition pass's input: whole-sequence costs of every layer (its seq_splits only
  // matter to an abstract model without a seq_length, whose costs do not depend on it). With
  // --partition even, the pass's even split (candidates it cannot make were dropped).
  std::vector<int> ends =
      o.evenPartition ? *evenStageEnds(m, stages)
                      : exactPartition(layerTimes(m, cluster, m.sequenceLength(1), tp, cp), stages);
  std::lock_guard<std::mutex> lock(partitionMu);
  partitions.emplace(key, ends);
  return ends;
}

const Search::Slicing &Search::slicingFor(size_t variant, const ParallelConfig &pc) {
  auto key =
      std::make_tuple(variant, pc.seqSplits, pc.tp, pc.seqSplitByFlops, pc.sequenceParallel, pc.cp);
  {
    std::lock_guard<std::mutex> lock(partitionMu);
    auto it = slicings.find(key);
    if (it != slicings.end())
      return it->second;
  }
  Slicing s;
  const ModelSpec &m = variants[variant].model;
  if (llvm::Error err = seqSlicesFor(m, cluster, pc, s.slices))
    s.why = takeMessage(std::move(err));
  else
    s.costs = layerSliceCosts(m, cluster, pc, s.slices);
  std::lock_guard<std::mutex> lock(partitionMu);
  // (Another thread may have put the same answer in meanwhile: the first stays.)
  return slicings.emplace(key, std::move(s)).first->second;
}

/// Bytes the largest op of a microbatch of `st` holds on its rank while its backward runs: a
/// split backward's where the schedule splits every backward, else the smaller of a split and a
/// fused one's (a bound whichever the schedule runs).
int64_t lifetimeBytes(const StageInfo &st, size_t k, bool splitOnly) {
  int64_t split = activationLifetimePeak(st, int(k));
  int64_t held = splitOnly ? split : std::min(split, activationLifetimePeak(st, int(k), true));
  return held + workspaceBytes(st, int(k));
}

/// The layout's memory lower bound: on every rank its static bytes (weights, gradients,
/// optimizer state) and the most one microbatch holds; the worst rank's into c's
/// peakMemoryBytes and worstRank (`splitOnly`: the schedule splits every backward). Returns the
/// largest static bytes of a rank, and that rank in `fullest`.
int64_t layoutMemoryBound(const Plan &plan, PlanCandidate &c, bool splitOnly, int &fullest) {
  const ParallelConfig &pc = plan.parallel;
  std::vector<int64_t> params(size_t(pc.pp), 0), most(size_t(pc.pp), 0);
  for (const StageInfo &st : plan.stages) {
    params[size_t(st.rank)] += st.paramBytes;
    for (size_t k = 0; k < size_t(pc.seqSplits); ++k)
      most[size_t(st.rank)] = std::max(most[size_t(st.rank)], lifetimeBytes(st, k, splitOnly));
  }
  int64_t maxStatic = 0, bound = 0;
  for (int r = 0; r < pc.pp; ++r) {
    int64_t stat = int64_t(double(params[size_t(r)]) * plan.stateBytesPerParamByte);
    if (stat > maxStatic || r == 0) {
      maxStatic = stat;
      fullest = r;
    }
    if (stat + most[size_t(r)] > bound) {
      bound = stat + most[size_t(r)];
      c.worstRank = r;
    }
  }
  c.peakMemoryBytes = bound;
  return maxStatic;
}

/// The layout's step-time lower bound: the busiest rank's compute and tp all-reduces, after
/// the forwards of the stages before its first one (the first microbatch must pass them; not
/// under post-validation, whose step is each rank's own period).
double layoutTimeBound(const Plan &plan) {
  const ParallelConfig &pc = plan.parallel;
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
  // Under post-validation the step is the longest rank's own period, from its first op
  // (ir/CostModel.cpp's stepFigures): the fill before a rank's first stage is not in it.
  double bound = 0;
  for (int r = 0; r < pc.pp; ++r) {
    double fill = 0;
    for (int s = 0; !plan.postValidation && s < firstStage[size_t(r)]; ++s)
      fill += *std::min_element(plan.stages[size_t(s)].forward.begin(),
                                plan.stages[size_t(s)].forward.end());
    bound = std::max(bound, fill + occupied[size_t(r)] - trailing[size_t(r)]);
  }
  return bound;
}

/// The worst rank's peak memory in `stats` into c's peakMemoryBytes and worstRank.
void takePeak(PlanCandidate &c, const PlanStats &stats) {
  int64_t peak = 0;
  for (const RankStats &r : stats.ranks) {
    if (r.peakMemoryBytes > peak) {
      peak = r.peakMemoryBytes;
      c.worstRank = r.rank;
    }
  }
  c.peakMemoryBytes = peak;
}

/// A candidate's step time, bubble and worst rank's peak memory from the stats of its
/// evaluated or compiled plan.
void takeFigures(PlanCandidate &c, const PlanStats &stats) {
  c.stepTime = stats.stepTime;
  double busy = 0;
  for (const RankStats &r : stats.ranks)
    busy += r.busy;
  takePeak(c, stats);
  c.bubble = c.stepTime > 0 && !stats.ranks.empty()
                 ? 1.0 - busy / double(stats.ranks.size()) / c.stepTime
                 : 0.0;
}

/// A lower bound of the step time compile states for `plan`, a stage table and compute-only
/// streams. The simulate pass times the lowered streams: the same compute ops in the same
/// order per rank, with zero-time sends and recvs, and with tp > 1 each forward and
/// input-gradient op split into parts, each followed by a tp all-reduce that holds the rank
/// (docs/contracts.md#semantics). Timing the compute-only streams with all but the last of an
/// op's all-reduces added to the op (the last delays only the rank's next op, not the op's
/// output) can only start every op as early or earlier, so each rank's last end is at most the
/// lowered one's. With dp > 1 a rank's step also lasts until its gradient all-reduces are done:
/// one per stage, after the stage's last weight gradient (dpAllReducePoints), one at a time on
/// their own stream (collectiveTimes); chained from the compute-only ends they end no later.
/// (Not counted where they overlap the last backward, "grad_reduce": "overlapped".) Then as
/// stepFigures states the step: without the optimizer step timed, the last step end; without
/// post-validation, that plus the pipeline-wide check and the slowest optimizer step; with
/// post-validation, the period is at least the first stage's rank's (it starts at 0) step end
/// plus its optimizer step. With blocking p2p the step is the executed one
/// (simulateExecutedStep): each rank's clock passes every op no sooner than the timeline does,
/// the all-reduces on it, its optimizer step last; then the check unless post-validated.
double orderTimeBound(Plan &plan) {
  const ParallelConfig &pc = plan.parallel;
  // The all-reduces folded in, undone below (the stage table stays compile's).
  std::vector<std::pair<llvm::SmallVector<double, 1>, llvm::SmallVector<double, 1>>> saved;
  if (pc.tp > 1) {
    saved.reserve(plan.stages.size());
    for (StageInfo &st : plan.stages) {
      saved.emplace_back(st.forward, st.backwardInput);
      if (st.tpAllReduces <= 1)
        continue;
      for (size_t k = 0; k < st.forward.size(); ++k) {
        double held = double(st.tpAllReduces - 1) * st.tpAllReduceTime[k];
        st.forward[k] += held;
        st.backwardInput[k] += held;
      }
    }
  }
  Timeline t;
  llvm::Error err = simulateTimeline(plan, t);
  for (size_t s = 0; s < saved.size(); ++s) {
    plan.stages[s].forward = std::move(saved[s].first);
    plan.stages[s].backwardInput = std::move(saved[s].second);
  }
  if (err) {
    // (An order that cannot run: evaluateOrder reports it.)
    llvm::consumeError(std::move(err));
    return 0;
  }
  std::vector<double> end(plan.ranks.size(), 0);
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    const auto &stream = plan.ranks[r];
    if (stream.empty())
      continue;
    end[r] = t.ops[r].back().end;
    if (pc.gradReduceRanks() <= 1 || (plan.overlapGradReduce && !plan.blockingP2p))
      continue;
    std::vector<llvm::SmallVector<int, 2>> points = dpAllReducePoints(stream);
    double free = 0;
    for (size_t n = 1; n <= stream.size(); ++n)
      for (int s : points[n])
        free = std::max(free, t.ops[r][n - 1].end) + plan.stages[size_t(s)].dpAllReduceTime;
    end[r] = std::max(end[r], free);
  }
  if (plan.blockingP2p) {
    double executed = 0;
    for (size_t r = 0; r < plan.ranks.size(); ++r)
      executed = std::max(executed, end[r] + rankOptimizerTime(plan, r));
    return executed + (plan.postValidation ? 0.0 : plan.optimizerSyncTime);
  }
  double optimizer = 0;
  for (size_t r = 0; r < plan.ranks.size(); ++r)
    optimizer = std::max(optimizer, rankOptimizerTime(plan, r));
  if (optimizer <= 0 && plan.optimizerSyncTime <= 0)
    return *std::max_element(end.begin(), end.end());
  if (!plan.postValidation)
    return *std::max_element(end.begin(), end.end()) + plan.optimizerSyncTime + optimizer;
  size_t first = size_t(plan.rankOf(0));
  return end[first] + rankOptimizerTime(plan, first);
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
  plan.postValidation = policy.postValidation();
  plan.gpusPerNode = cluster.gpusPerNode;
  plan.stateBytesPerParamByte = var.model.stateBytesPerParamByte;
  plan.transformer = var.model.transformer;
  const Slicing &slicing = slicingFor(variantOf[index], pc);
  if (!slicing.why.empty()) {
    c.outcome = Outcome::Constraint;
    c.why = slicing.why;
    return;
  }
  plan.seqSlices = slicing.slices;
  buildStages(plan, var.model, cluster,
              partitionFor(variantOf[index], pc.tp, pc.cp, pc.numStages()), slicing.costs);
  // Measured times where the file covers the candidate, as compile's pipeline puts them in
  // right after its partition pass: the bounds, the order and the simulation all take them.
  if (o.costs && coversCandidate(*o.costs, c)) {
    if (llvm::Error err = applyMeasuredCosts(*o.costs, o.costsSource, plan)) {
      c.outcome = Outcome::Constraint;
      c.why = takeMessage(std::move(err));
      refusedByCosts[index] = 1;
      return;
    }
    c.measured = true;
  }

  int fullest = 0;
  int64_t maxStatic = layoutMemoryBound(plan, c, policy.splitsEveryBackward(), fullest);
  ScheduleRequest request;
  request.parallel = pc;
  request.stages = plan.stages;
  const bool zbAuto = c.schedule == "zb-auto";
  if (zbAuto) {
    // zb-auto schedules under one activation limit, the same for every rank: the device's
    // memory (less the headroom) less the fullest rank's static bytes and room for two receive
    // buffers each way. The layout needs at least the memory that gives that limit one
    // microbatch of its heaviest stage (which is also at least every rank's static bytes and
    // one microbatch): that need is its bound.
    int64_t buffers = 0;
    for (const StageInfo &st : plan.stages)
      for (int64_t b : st.outputBytes)
        buffers = std::max(buffers, b);
    c.zbAutoLeast = std::max<int64_t>(1, policy.leastMemoryLimit(request));
    const int64_t need = maxStatic + 4 * buffers + c.zbAutoLeast;
    if (need > fit) {
      c.outcome = Outcome::Memory;
      // (need is at least every rank's static bytes and one microbatch: the layout's bound.)
      c.peakMemoryBytes = need;
      c.worstRank = fullest;
      c.why = fmt::format("zb-auto needs at least {} per GPU of {}: its activation limit, the "
                          "same on every rank, must hold one microbatch of the heaviest stage "
                          "({}) beside rank {}'s weights, gradients and optimizer state ({}) and "
                          "four receive buffers ({})",
                          humanBytes(need), humanBytes(fit), humanBytes(c.zbAutoLeast), fullest,
                          humanBytes(maxStatic), humanBytes(4 * buffers));
      return;
    }
    c.zbAutoLimit = fit - maxStatic - 4 * buffers;
  }
  int64_t bound = c.peakMemoryBytes;
  if (bound > fit) {
    c.outcome = Outcome::Memory;
    c.why = fmt::format("rank {} needs at least {} (weights, gradients and optimizer state and "
                        "one microbatch) of {}",
                        c.worstRank, humanBytes(bound), humanBytes(fit));
    return;
  }

  double timeBound = layoutTimeBound(plan);
  c.stepTimeBound = timeBound;
  if (timeBound * (1 - 1e-9) > threshold) {
    c.outcome = Outcome::Pruned;
    c.why = "its step-time lower bound exceeds the top-K step time found";
    return;
  }

  // Before its order, which grows with the microbatches, is built: a search orders and
  // simulates many candidates, so each is held to kPlannerMaxInstructions; a larger one that
  // the bounds above kept is named, not simulated.
  {
    CompileOptions sized;
    sized.parallel = pc;
    if (const uint64_t n = instructionBound(var.model, sized); n > kPlannerMaxInstructions) {
      c.outcome = Outcome::Constraint;
      c.tooLarge = true;
      c.why = fmt::format("--pp {} --vpp {} with {} microbatches and --seq-splits {} makes up "
                          "to {} instructions, more than the {} the planner simulates per "
                          "candidate; larger --microbatch-sizes, fewer --seq-splits or a smaller "
                          "--global-batch make fewer (pipec compile takes it alone)",
                          pc.pp, pc.vpp, pc.microbatches, pc.seqSplits, n, kPlannerMaxInstructions);
      return;
    }
  }

  // zb-auto's limit leaves room for four receive buffers; lowering can hold more on a rank
  // whose neighbour runs ahead. An order over the memory is scheduled again under a limit
  // lowered by the excess (by an eighth of what is left above the least at the least), a few
  // times, and last under the least limit, whose order is the one a suggested --memory-limit
  // is read from (explainNothingFits).
  constexpr int kZbAutoAttempts = 5;
  for (int attempt = 0;; ++attempt) {
    c.simulated = c.peakExact = false;
    request.memoryLimit = c.zbAutoLimit;
    if (llvm::Error err = policy.checkRequest(request)) {
      c.outcome = Outcome::Constraint;
      c.why = takeMessage(std::move(err));
      return;
    }
    ComputeOrder order;
    policy.emit(request, order);
    plan.ranks = std::move(order);
    plan.stats = PlanStats{};
    // Memory lower bound of this order: the memory pass on the compute-only streams states
    // each rank's static bytes and activation peak as compile will (lowering adds receive
    // buffers, and a tp part holds no more than its whole op), so an order over the limit here
    // is over it in compile too, without lowering or simulating it.
    {
      PassContext ctx;
      ctx.scheduled = true;
      if (llvm::Expected<bool> ran = createMemoryPass()->run(plan, ctx); !ran) {
        c.outcome = Outcome::Constraint;
        c.why = takeMessage(ran.takeError());
        return;
      }
      takePeak(c, plan.stats);
      if (c.peakMemoryBytes > fit) {
        c.outcome = Outcome::Memory;
        c.why = fmt::format("rank {} needs at least {} (weights, gradients and optimizer state "
                            "and its activations in this order, before receive buffers) of {}",
                            c.worstRank, humanBytes(c.peakMemoryBytes), humanBytes(fit));
        return;
      }
      plan.stats = PlanStats{};
    }
    // Step-time lower bound of this order, raised from the layout's, checked against the K-th
    // best before the order is lowered and simulated as compile does it.
    c.stepTimeBound = std::max(timeBound, orderTimeBound(plan));
    if (c.stepTimeBound * (1 - 1e-9) > threshold) {
      c.outcome = Outcome::Pruned;
      c.why = "its step-time lower bound exceeds the top-K step time found";
      return;
    }
    // Step time and memory as `pipec compile` states them: its own lowering, memory and
    // simulate passes (verification is left to the candidates that may be ranked).
    if (llvm::Error err = evaluateOrder(plan)) {
      // A policy's order that cannot run is a bug of the policy; report it as a constraint
      // rather than stop the search.
      c.outcome = Outcome::Constraint;
      c.why = takeMessage(std::move(err));
      return;
    }
    c.simulated = true;
    c.peakExact = true;
    takeFigures(c, plan.stats);
    if (c.peakMemoryBytes <= fit) {
      c.outcome = Outcome::Fits;
      return;
    }
    if (zbAuto && c.zbAutoLimit > c.zbAutoLeast) {
      const int64_t above = c.zbAutoLimit - c.zbAutoLeast;
      const int64_t lower = std::max(c.peakMemoryBytes - fit, above / 8);
      c.zbAutoLimit = attempt + 2 < kZbAutoAttempts ? std::max(c.zbAutoLeast, c.zbAutoLimit - lower)
                                                    : c.zbAutoLeast;
      continue;
    }
    c.outcome = Outcome::Memory;
    c.why = fmt::format("rank {} peaks at {} of {}", c.worstRank, humanBytes(c.peakMemoryBytes),
                        humanBytes(fit));
    return;
  }
}

bool Search::compile(size_t index, Plan *out) {
  PlanCandidate &c = cands[index];
  CompileOptions co;
  co.schedule = c.schedule;
  co.parallel = c.parallel;
  co.evenPartition = o.evenPartition;
  // A zb-auto layout dropped by its need (zbAutoLimit unset) at the least limit it takes: what
  // it needs is the larger of that need and this order's peak.
  const bool atLeast = c.schedule == "zb-auto" && c.zbAutoLimit == 0;
  const int64_t need = atLeast ? c.peakMemoryBytes : 0;
  co.memoryLimit = atLeast ? c.zbAutoLeast : c.zbAutoLimit;
  if (c.measured) {
    co.costs = o.costs;
    co.costsSource = o.costsSource;
  }
  auto plan = compilePlan(variants[variantOf[index]].model, cluster, co);
  c.compiled = true;
  if (!plan) {
    c.outcome = Outcome::Constraint;
    c.why = takeMessage(plan.takeError());
    return false;
  }
  c.peakExact = true;
  // The same passes as evaluate()'s, so the same figures; the compiled plan is also verified.
  const int needRank = c.worstRank;
  takeFigures(c, plan->stats);
  if (atLeast && need > c.peakMemoryBytes) {
    // The search's need, not the peak compile states (the reason stays the need's).
    c.peakMemoryBytes = need;
    c.worstRank = needRank;
    c.peakExact = false;
    return false;
  }
  if (c.peakMemoryBytes > fit) {
    c.outcome = Outcome::Memory;
    c.why = fmt::format("rank {} peaks at {} of {}", c.worstRank, humanBytes(c.peakMemoryBytes),
                        humanBytes(fit));
    return false;
  }
  if (out)
    *out = std::move(*plan);
  return true;
}

llvm::Error Search::explainNothingFits() {
  // Layouts exist (else run() reported bad input): all are over the memory limit. The closest
  // is the one of least peak as compile states it. Every evaluated candidate's peak is that
  // already (evaluateOrder runs compile's passes); one dropped by the memory lower bound before
  // scheduling has only the bound. So: walk them by known peak, least first, compiling in waves
  // the bounded ones, until the next known peak is no less than the least exact one found.
  // A zb-auto layout dropped by its need (the memory that gives its activation limit one
  // microbatch of the heaviest stage, evaluate()) is compiled at that least limit, and what it
  // needs is the larger of the two: at that memory the search schedules it, going down to the
  // least limit if a larger one's order is over (evaluate()). One scheduled and still over went
  // down to the least limit already.
  auto known = [](const PlanCandidate &c) { return c.peakExact || c.compiled; };
  std::vector<size_t> over;
  for (size_t i = 0; i < cands.size(); ++i)
    if (cands[i].outcome == Outcome::Memory)
      over.push_back(i);
  std::stable_sort(over.begin(), over.end(), [&](size_t a, size_t b) {
    return cands[a].peakMemoryBytes < cands[b].peakMemoryBytes;
  });
  const size_t kMostCompiles = 4 * std::max<size_t>(4, threads);
  const PlanCandidate *closest = nullptr;
  size_t next = 0, compiles = 0;
  while (next < over.size() && compiles < kMostCompiles &&
         (!closest || cands[over[next]].peakMemoryBytes < closest->peakMemoryBytes)) {
    size_t begin = next;
    std::vector<size_t> wave;
    for (; next < over.size() && wave.size() < std::max(1u, threads) &&
           compiles + wave.size() < kMostCompiles &&
           (!closest || cands[over[next]].peakMemoryBytes < closest->peakMemoryBytes);
         ++next) {
      const PlanCandidate &c = cands[over[next]];
      if (!known(c))
        wave.push_back(over[next]);
      else if (!closest || c.peakMemoryBytes < closest->peakMemoryBytes)
        closest = &c;
    }
    compiles += wave.size();
    parallelFor(wave.size(), threads, [&](size_t j) { compile(wave[j], nullptr); });
    for (size_t j = begin; j < next; ++j) {
      const PlanCandidate &c = cands[over[j]];
      // (One that compiled within the limit would have been ranked: compile's peak is at least
      // the bound it was dropped by.)
      if (known(c) && c.outcome == Outcome::Memory &&
          (!closest || c.peakMemoryBytes < closest->peakMemoryBytes))
        closest = &c;
    }
  }
  if (!closest) {
    // Candidates too large to simulate first: they may well have fitted, and the fix (fewer,
    // larger microbatches) differs from every other reason's.
    auto large = llvm::find_if(cands, [](const PlanCandidate &c) { return c.tooLarge; });
    if (large != cands.end())
      return finding("no layout of {} GPUs could be scheduled: {} candidates were not simulated, "
                     "such as {}",
                     o.gpus,
                     llvm::count_if(cands, [](const PlanCandidate &c) { return c.tooLarge; }),
                     large->why);
    // No candidate's reasons are written anywhere (--csv needs a result): the commonest one,
    // among the candidates that were compiled if any were (a schedule's check of the flags
    // refuses many before they are, in the same words).
    std::map<std::string, size_t> whys;
    bool anyCompiled = llvm::any_of(cands, [](const PlanCandidate &c) {
      return c.outcome == Outcome::Constraint && c.compiled;
    });
    size_t failed = 0;
    for (const PlanCandidate &c : cands)
      if (c.outcome == Outcome::Constraint && (c.compiled || !anyCompiled)) {
        ++whys[c.why];
        ++failed;
      }
    auto commonest = std::max_element(
        whys.begin(), whys.end(), [](const auto &a, const auto &b) { return a.second < b.second; });
    if (commonest == whys.end())
      return finding("no layout of {} GPUs could be scheduled", o.gpus);
    return finding("no layout of {} GPUs could be scheduled; {} of the {} {}candidates failed "
                   "with: {}",
                   o.gpus, commonest->second, failed, anyCompiled ? "compiled " : "",
                   commonest->first);
  }
  const ParallelConfig &pc = closest->parallel;
  std::string kept = headroom > 0
                         ? fmt::format(" with {} kept free (--min-headroom)", humanBytes(headroom))
                         : std::string();
  // What the search has not tried yet that saves memory, as hints after the limit.
  std::string hints = "more GPUs";
  const std::vector<Recompute> tried = recomputeSettings();
  // (Not where zb-auto's least need decides: one microbatch of the heaviest stage, whose
  // deferred W keeps its GEMMs' inputs and output gradients however the forward is recomputed.)
  const bool zbAutoLeast = closest->schedule == "zb-auto" && !closest->peakExact;
  if (model.transformer && !llvm::is_contained(tried, Recompute::Full) && !zbAutoLeast)
    hints += ", or --recompute full";
  if (model.transformer && o.sequenceParallel == std::optional<bool>(false))
    hints += ", or let the search try sequence parallelism (without --no-sequence-parallel)";
  if (model.transformer && o.distributedOptimizer == std::optional<bool>(false))
    hints += ", or let the search try ZeRO-1 (without --no-distributed-optimizer)";
  return finding(
      "no layout of {} GPUs fits in {} per GPU{}: the closest, {} with tp={}{} pp={} "
      "vpp={} dp={} microbatch size {} seq-splits {} recompute {} sequence-parallel "
      "{} distributed-optimizer {}, needs {} on rank {} ({}; {} short); try "
      "--memory-limit {}, {}",
      o.gpus, humanBytes(limit), kept, scheduleLabel(*closest), pc.tp,
      pc.cp > 1 ? fmt::format(" cp={}", pc.cp) : std::string(), pc.pp, pc.vpp, pc.dp,
      closest->microbatchSize, pc.seqSplits, toString(closest->recompute).str(),
      pc.sequenceParallel ? "on" : "off", pc.distributedOptimizer ? "on" : "off",
      humanBytes(closest->peakMemoryBytes), closest->worstRank,
      !closest->peakExact
          ? std::string("for zb-auto to schedule it: its activation limit, the same "
                        "on every rank, must hold one microbatch of the heaviest "
                        "stage")
      : closest->schedule == "zb-auto"
          ? fmt::format("as `pipec compile` states it with zb-auto's --memory-limit {}",
                        closest->zbAutoLimit ? closest->zbAutoLimit : closest->zbAutoLeast)
          : std::string("as `pipec compile` states it"),
      humanBytes(closest->peakMemoryBytes - fit),
      limitThatFits(o.minHeadroom, o.minHeadroomPercent, closest->peakMemoryBytes), hints);
}

std::vector<int64_t> Search::microbatchSizesFor(int64_t perReplica) const {
  if (!model.isTransformer())
    return {1};
  if (!o.microbatchSizes.empty())
    return o.microbatchSizes;
  std::vector<int64_t> sizes;
  for (int64_t b = 1; b <= std::min(perReplica, o.maxMicrobatchSize); ++b)
    if (perReplica % b == 0)
      sizes.push_back(b);
  return sizes;
}

bool Search::tpAllowed(int tp) const {
  if (tp < 1 || (!model.isTransformer() && tp > 1))
    return false;
  if (tp > cluster.gpusPerNode && !o.tpAcrossNodes)
    return false;
  if (!o.tpSizes.empty() && !llvm::is_contained(o.tpSizes, tp))
    return false;
  if (const auto &t = model.transformer)
    return t->numAttentionHeads % tp == 0 && t->kvHeads() % tp == 0 && t->ffnHiddenSize % tp == 0;
  return true;
}

bool Search::scheduleOpen(int pp, int64_t microbatches) const {
  if (microbatches < 1 || microbatches > kMostMicrobatches)
    return false;
  if (pp == 1)
    return true; // no pipeline: 1f1b takes any microbatch count
  const int numLayers = int(model.layers.size());
  for (const ScheduleChoice &sc : schedules) {
    if (sc.noPipelineOnly)
      continue;
    for (int vpp : sc.vpps)
      for (int k : sc.seqSplits) {
        if (int64_t(pp) * vpp > numLayers)
          continue;
        CompileOptions co;
        co.schedule = sc.policy->name().str();
        co.parallel.pp = pp;
        co.parallel.vpp = vpp;
        co.parallel.microbatches = int(microbatches);
        co.parallel.seqSplits = k;
        llvm::Error err = checkCompileOptions(co);
        if (!err)
          err = sc.policy->check(co.parallel);
        bool ok = !err;
        llvm::consumeError(std::move(err));
        if (ok)
          return true;
      }
  }
  return false;
}

/// The divisors of n (n up to 2^40: trial division to its square root), ascending.
std::vector<int64_t> divisorsOf64(int64_t n) {
  std::vector<int64_t> low, high;
  for (int64_t d = 1; d * d <= n; ++d)
    if (n % d == 0) {
      low.push_back(d);
      if (d != n / d)
        high.push_back(n / d);
    }
  low.insert(low.end(), high.rbegin(), high.rend());
  return low;
}

/// How far a suggestion is from what was asked, as a factor (which flag to blame).
double ratio(int64_t a, int64_t b) {
  return double(std::max(a, b)) / double(std::max<int64_t>(1, std::min(a, b)));
}

bool Search::ppAllowed(int pp) const {
  return pp >= 1 && pp <= int(model.layers.size()) &&
         (o.ppSizes.empty() || llvm::is_contained(o.ppSizes, pp));
}

bool Search::splits(int pp, int64_t perReplica) const {
  for (int64_t b : microbatchSizesFor(perReplica))
    if (perReplica % b == 0 && scheduleOpen(pp, perReplica / b))
      return true;
  return false;
}

int64_t Search::nearestBatch(const std::vector<std::pair<int, int>> &pairs) const {
  // A multiple of dp·b near the batch, for every (tp, pp) and microbatch size (a few multiples
  // each side, for schedules that take some counts only).
  const int64_t batch = o.globalBatch;
  int64_t best = 0;
  auto offer = [&](int64_t b) {
    if (b < 1 || b > kMaxGlobalBatch)
      return;
    if (!best || std::abs(b - batch) < std::abs(best - batch) ||
        (std::abs(b - batch) == std::abs(best - batch) && b < best))
      best = b;
  };
  for (auto [tp, pp] : pairs) {
    int64_t dp = o.gpus / tp / pp;
    std::vector<int64_t> sizes = o.microbatchSizes;
    if (sizes.empty())
      for (int64_t b = 1; b <= (model.isTransformer() ? o.maxMicrobatchSize : 1); ++b)
        sizes.push_back(b);
    for (int64_t b : sizes) {
      int64_t unit = dp * b;
      int64_t k0 = std::clamp<int64_t>(batch / unit, 1, kMostMicrobatches);
      for (int64_t k = std::max<int64_t>(1, k0 - 8); k <= std::min(kMostMicrobatches, k0 + 9); ++k)
        if (scheduleOpen(pp, k))
          offer(k * unit);
    }
  }
  return best;
}

int64_t Search::nearestGpus(const std::vector<int> &tps) const {
  // tp · pp · dp with dp dividing the batch, for every tp and pp the flags allow, taking the
  // divisors of the batch nearest the count asked.
  const int64_t batch = o.globalBatch;
  int64_t best = 0;
  std::vector<int64_t> dps = divisorsOf64(batch);
  auto offer = [&](int64_t g, int pp, int64_t dp) {
    if (g < 1 || g > (int64_t(1) << 20) || g / pp > kMaxTpDp || !splits(pp, batch / dp))
      return false;
    if (!best || std::abs(g - o.gpus) < std::abs(best - o.gpus) ||
        (std::abs(g - o.gpus) == std::abs(best - o.gpus) && g < best))
      best = g;
    return true;
  };
  for (int tp : tps)
    for (int pp = 1; pp <= int(model.layers.size()); ++pp) {
      if (!ppAllowed(pp))
        continue;
      int64_t per = int64_t(tp) * pp;
      auto at = std::lower_bound(dps.begin(), dps.end(), std::max<int64_t>(1, o.gpus / per));
      // The first dp each side of the share that passes (a few tries: schedules that take
      // only some microbatch counts).
      int tries = 0;
      for (auto it = at; it != dps.end() && tries < 16; ++it, ++tries)
        if (per * *it > (int64_t(1) << 20) || offer(per * *it, pp, *it))
          break;
      tries = 0;
      for (auto it = at; it != dps.begin() && tries < 16; ++tries) {
        --it;
        if (offer(per * *it, pp, *it))
          break;
      }
    }
  return best;
}

llvm::Error Search::explainNoLayout() const {
  // The rules below are those of layouts without context parallelism (GPUs = tp x pp x dp):
  // where --cp leaves none of those, say what holds instead.
  if (!llvm::is_contained(o.cpSizes, 1)) {
    std::string cps;
    for (int cp : o.cpSizes)
      cps += (cps.empty() ? "" : ",") + std::to_string(cp);
    return inputError("--cp {}: no layout tp x cp x pp x dp = {} GPUs fits this model, the global "
                      "batch {} and the schedules asked for (cp must divide the GPUs left over "
                      "tp, dp = GPUs / (tp x cp x pp) the batch); try --cp 1 for the nearest "
                      "layouts without context parallelism",
                      cps, o.gpus, o.globalBatch);
  }
  // Layouts passed every rule but --partition even's: that flag is at fault; the pipeline
  // sizes of this GPU count whose stages can divide the blocks are the fix besides dropping it.
  if (o.evenPartition && llvm::any_of(cands, [](const PlanCandidate &c) {
        return llvm::StringRef(c.why).startswith("--partition even");
      })) {
    const bool transformer = model.isTransformer();
    const int64_t units = evenSplitUnits(model);
    std::string pps;
    for (int pp = 1; pp <= o.gpus && pp <= units; ++pp)
      if (o.gpus % pp == 0 && units % pp == 0)
        pps += (pps.empty() ? "" : ",") + std::to_string(pp);
    return inputError("--partition even: no layout of {} GPUs{} has stages (pp x vpp) that "
                      "divide the model's {} {}; try --partition balanced{}",
                      o.gpus, o.ppSizes.empty() ? std::string() : " at the --pp sizes given", units,
                      transformer ? "blocks" : "layers",
                      pps.empty() ? std::string() : ", or --pp " + pps);
  }
  // No candidate passed the structural checks. Find the flag at fault and the nearest values
  // that pass, by arithmetic on the same rules enumerate() applies (tp, pp, dp = GPUs/(tp·pp)
  // dividing the batch into microbatches, a schedule taking pp and their count), never by
  // running the search again: every loop is over divisors or a few multiples.
  const int numLayers = int(model.layers.size());
  const int64_t batch = o.globalBatch;
  const int maxTp = model.isTransformer() ? std::max(1, o.gpus) : 1;
  // tp values the model, the node and --tp allow, whatever the GPU count.
  std::vector<int> tps;
  for (int tp = 1; tp <= maxTp; ++tp)
    if (tpAllowed(tp))
      tps.push_back(tp);
  auto list = [](const std::vector<int> &v) {
    std::string out;
    for (int x : v)
      out += (out.empty() ? "" : ",") + std::to_string(x);
    return out;
  };
  // (tp, pp) pairs of this GPU count (tp x dp within what compile plans, as enumerate()'s
  // candidates are: a prime GPU count's dp past it is no layout, whatever the batch).
  std::vector<std::pair<int, int>> pairs;
  for (int tp : tps)
    if (o.gpus % tp == 0)
      for (int pp = 1; pp <= std::min(numLayers, o.gpus / tp); ++pp)
        if ((o.gpus / tp) % pp == 0 && ppAllowed(pp) && o.gpus / pp <= kMaxTpDp)
          pairs.push_back({tp, pp});
  const int64_t bestBatch = nearestBatch(pairs);
  const int64_t bestGpus = nearestGpus(tps);

  // --tp or --pp at fault: no value listed makes a layout of this GPU count.
  const std::string orGpus = bestGpus ? fmt::format(", or --gpus {}", bestGpus) : "";
  if (!o.tpSizes.empty() && llvm::none_of(tps, [&](int tp) { return o.gpus % tp == 0; })) {
    // Every --tp value breaks a rule on its own: the model's divisors, the node, the GPUs.
    std::vector<int> valid;
    int g = o.gpus;
    if (const auto &t = model.transformer)
      g = std::gcd(std::gcd(g, t->numAttentionHeads), std::gcd(t->kvHeads(), t->ffnHiddenSize));
    else
      g = 1;
    for (int tp = 1; tp <= g; ++tp)
      if (g % tp == 0 && (tp <= cluster.gpusPerNode || o.tpAcrossNodes))
        valid.push_back(tp);
    return inputError("--tp {}: tp must divide --gpus {}{}{}; try --tp {}", list(o.tpSizes), o.gpus,
                      model.transformer
                          ? fmt::format(", the heads ({}), the key/value groups ({}) and "
                                        "ffn_hidden_size ({})",
                                        model.transformer->numAttentionHeads,
                                        model.transformer->kvHeads(),
                                        model.transformer->ffnHiddenSize)
                          : std::string(" (an abstract model plans tp 1 only)"),
                      o.tpAcrossNodes ? std::string()
                                      : fmt::format(" and stay within a node of {} GPUs unless "
                                                    "--tp-across-nodes",
                                                    cluster.gpusPerNode),
                      list(valid));
  }
  if (!o.ppSizes.empty() && pairs.empty()) {
    std::vector<int> valid;
    for (int tp : tps)
      if (o.gpus % tp == 0)
        for (int pp = 1; pp <= std::min(numLayers, o.gpus / tp); ++pp)
          if ((o.gpus / tp) % pp == 0 && !llvm::is_contained(valid, pp))
            valid.push_back(pp);
    llvm::sort(valid);
    std::vector<int> dividing; // (the tp values that divide the GPUs at all)
    for (int tp : tps)
      if (o.gpus % tp == 0)
        dividing.push_back(tp);
    return inputError("--pp {}: pp must divide the {} GPUs over tp ({}) and be at most the "
                      "model's {} layers; try --pp {}{}",
                      list(o.ppSizes), o.gpus, list(dividing), numLayers, list(valid), orGpus);
  }

  bool batchFits = false;
  for (auto [tp, pp] : pairs)
    batchFits |= batch % (o.gpus / tp / pp) == 0 && splits(pp, batch / (o.gpus / tp / pp));
  std::string gpusHint = bestGpus ? fmt::format("--gpus {}", bestGpus) : std::string();
  // The batch is blamed when its nearest valid value is close (within a factor of 2) or no
  // farther than the GPU count's: a prime GPU count asks for a batch of its own size.
  // Where --microbatch-sizes narrows the sizes, the rule says so (it may be the flag at fault).
  std::string sizes;
  if (!o.microbatchSizes.empty()) {
    sizes = " (--microbatch-sizes ";
    for (size_t i = 0; i < o.microbatchSizes.size(); ++i)
      sizes += (i ? "," : "") + std::to_string(o.microbatchSizes[i]);
    sizes += ")";
  }
  if (!pairs.empty() && !batchFits && bestBatch &&
      (!bestGpus || ratio(bestBatch, batch) <= std::max(2.0, ratio(bestGpus, o.gpus))))
    return inputError("--global-batch {}: no layout of {} GPUs divides it into dp x "
                      "microbatches (at most 2^24) x microbatch size{}; try --global-batch {}{}",
                      batch, o.gpus, sizes, bestBatch, bestGpus ? ", or " + gpusHint : "");
  if (bestGpus)
    return inputError("--gpus {}: no layout tp x pp x dp = {} fits this model, the global "
                      "batch {} and the schedules asked for; try {}{}",
                      o.gpus, o.gpus, batch, gpusHint,
                      bestBatch ? fmt::format(", or --global-batch {}", bestBatch) : "");
  if (bestBatch)
    return inputError("--global-batch {}: no layout of {} GPUs divides it into dp x "
                      "microbatches (at most 2^24) x microbatch size{}; try --global-batch {}",
                      batch, o.gpus, sizes, bestBatch);
  // Layouts of this count and batch exist, but the flags' schedules and sizes drop each: the
  // commonest reason names the rule (the CSV is not written on an error).
  std::map<std::string, size_t> reasons;
  for (const PlanCandidate &c : cands)
    if (!c.why.empty())
      ++reasons[c.why];
  auto commonest = std::max_element(reasons.begin(), reasons.end(),
                                    [](auto &a, auto &b) { return a.second < b.second; });
  if (commonest == reasons.end())
    return inputError("--gpus {}: no layout fits this model and --global-batch {}", o.gpus, batch);
  return inputError("--gpus {}: no layout fits this model and --global-batch {} under the flags "
                    "given: all {} candidates break a rule, {} of them this one: {}",
                    o.gpus, batch, cands.size(), commonest->second, commonest->first);
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
  if (open.empty())
    return explainNoLayout();
  if (llvm::Error err = checkCostsCover())
    return err;
  std::vector<double> order(cands.size(), 0);
  for (size_t i : open) {
    Variant &v = variants[variantOf[i]];
    const ParallelConfig &pc = cands[i].parallel;
    auto it = v.timeByTp.find({pc.tp, pc.cp});
    if (it == v.timeByTp.end()) {
      std::vector<double> t = layerTimes(v.model, cluster, v.model.sequenceLength(1), pc.tp, pc.cp);
      // What compile refuses the search refuses, before it evaluates infinities.
      if (llvm::Error err = checkLayerTimesAddUp(v.model, t))
        return err;
      it = v.timeByTp.emplace(std::pair{pc.tp, pc.cp}, std::accumulate(t.begin(), t.end(), 0.0))
               .first;
    }
    order[i] = it->second * double(pc.microbatches) / double(pc.pp);
  }
  std::stable_sort(open.begin(), open.end(),
                   [&](size_t a, size_t b) { return order[a] < order[b]; });

  // Fitting candidates by (step time, enumeration order). Evaluation states compile's figures
  // (the same passes), so the search needs no compiling; the threshold for pruning is the K-th
  // best step time found, updated between waves only.
  auto better = [&](size_t a, size_t b) {
    return std::tie(cands[a].stepTime, a) < std::tie(cands[b].stepTime, b);
  };
  std::vector<size_t> fitting;
  const size_t top = size_t(o.top);
  double threshold = kInf;
  // (A fixed wave size: the threshold between waves, and so what is pruned, must not depend on
  // the thread count.)
  const size_t wave = 32;
  refusedByCosts.assign(cands.size(), 0);
  for (size_t begin = 0; begin < open.size(); begin += wave) {
    size_t end = std::min(open.size(), begin + wave);
    parallelFor(end - begin, threads, [&](size_t j) { evaluate(open[begin + j], threshold); });
    for (size_t j = begin; j < end; ++j)
      if (cands[open[j]].outcome == Outcome::Fits)
        fitting.push_back(open[j]);
    std::sort(fitting.begin(), fitting.end(), better);
    threshold = fitting.size() >= top ? cands[fitting[top - 1]].stepTime : kInf;
  }
  // A file that fits no candidate it covers (a profile of another model, say) scores nothing:
  // its one line, as compile states it, rather than a table scored by the model alone.
  if (o.costs && llvm::none_of(cands, [](const PlanCandidate &c) { return c.measured; }))
    for (size_t i : open)
      if (refusedByCosts[i])
        return inputError("{}", cands[i].why);
  // The top K are compiled in full and verified, in parallel; one that fails verification (a
  // bug, reported in its row) gives its place to the next.
  std::map<size_t, Plan> plans;
  for (;;) {
    std::vector<size_t> need;
    for (size_t i = 0; i < fitting.size() && i < top; ++i)
      if (!cands[fitting[i]].compiled)
        need.push_back(fitting[i]);
    if (need.empty())
      break;
    std::vector<Plan> built(need.size());
    parallelFor(need.size(), threads, [&](size_t j) { compile(need[j], &built[j]); });
    for (size_t j = 0; j < need.size(); ++j)
      if (cands[need[j]].outcome == Outcome::Fits)
        plans.emplace(need[j], std::move(built[j]));
    llvm::erase_if(fitting, [&](size_t i) { return cands[i].outcome != Outcome::Fits; });
    std::sort(fitting.begin(), fitting.end(), better);
  }
  if (fitting.empty())
    return explainNothingFits();

  PlannerResult result;
  result.memoryLimit = limit;
  result.minHeadroom = headroom;
  for (size_t i = 0; i < fitting.size() && i < top; ++i) {
    cands[fitting[i]].outcome = Outcome::Ranked;
    result.ranked.push_back(fitting[i]);
  }
  if (model.transformer)
    result.tokensPerStep = o.globalBatch * model.transformer->seqLength;
  result.best = std::move(plans.at(result.ranked[0]));
  result.candidates = std::move(cands);
  return result;
}

} // namespace

void keepFreedMemoryForPlanning() {
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [] {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  });
#endif
}

llvm::Expected<PlannerResult> planLayouts(const ModelSpec &model, const ClusterSpec &cluster,
                                          const PlannerOptions &options) {
  Search search(model, cluster, options);
  return search.run();
}

std::string plannerCsv(const ModelSpec &model, const ClusterSpec &cluster,
                       const PlannerOptions &options, const PlannerResult &result) {
  std::string out = "recompute,tp,pp,vpp,dp,microbatch_size,microbatches,seq_splits,"
                    "sequence_parallel,distributed_optimizer,schedule,outcome,step_time,"
                    "step_time_bound,bubble,peak_memory_bytes,peak_memory_exact,worst_rank,"
                    "tokens_per_s,model_tflops_per_gpu,mfu,costs,why,cp\n";
  auto quote = [](llvm::StringRef s) {
    std::string q = "\"";
    for (char ch : s) {
      if (ch == '"')
        q += '"';
      q += ch == '\n' ? ' ' : ch;
    }
    return q + "\"";
  };
  for (const PlanCandidate &c : result.candidates) {
    const ParallelConfig &pc = c.parallel;
    std::string time, bound, bubble, tokens, tflops, mfu;
    if (c.simulated) {
      time = fmt::format("{:.6g}", c.stepTime);
      bubble = fmt::format("{:.4f}", c.bubble);
      if (auto th = stepThroughput(modelVariant(model, c.microbatchSize, c.recompute), pc,
                                   c.stepTime, cluster.peakTflops)) {
        tokens = fmt::format("{:.6g}", th->tokensPerSecond);
        tflops = fmt::format("{:.4g}", th->tflopsPerGpu);
        mfu = fmt::format("{:.4f}", th->mfu);
      }
    }
    if (c.stepTimeBound > 0)
      bound = fmt::format("{:.6g}", c.stepTimeBound);
    const bool scheduled = !c.schedule.empty();
    auto onOff = [&](bool v) { return scheduled ? (v ? "on" : "off") : ""; };
    out += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
                       toString(c.recompute).str(), pc.tp, pc.pp ? std::to_string(pc.pp) : "",
                       scheduled ? std::to_string(pc.vpp) : "", pc.pp ? std::to_string(pc.dp) : "",
                       scheduled ? std::to_string(c.microbatchSize) : "",
                       scheduled ? std::to_string(pc.microbatches) : "",
                       scheduled ? std::to_string(pc.seqSplits) : "", onOff(pc.sequenceParallel),
                       onOff(pc.distributedOptimizer), scheduled ? scheduleLabel(c) : "*",
                       toString(c.outcome).str(), time, bound, bubble,
                       c.peakMemoryBytes ? std::to_string(c.peakMemoryBytes) : "",
                       c.peakMemoryBytes ? (c.peakExact ? "yes" : "no") : "",
                       c.peakMemoryBytes ? std::to_string(c.worstRank) : "", tokens, tflops, mfu,
                       c.simulated ? (c.measured ? "measured" : "model") : "", quote(c.why),
                       pc.pp ? std::to_string(pc.cp) : "");
  }
  return out;
}

} // namespace pipec
