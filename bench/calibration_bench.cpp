//===- calibration_bench.cpp - pipec's cost model against published training runs -----===//
//
// Every run of bench/data/published-runs.csv (docs/calibration-sources.md) compiled as
// published and its predicted step time set against the measured one (bench/Calibration.h).
//
//   calibration_bench [--data bench/data/published-runs.csv]
//                     [--a100 examples/a100-selene.json] [--h100 examples/h100-nemo.json]
//                     [--fit] [--loso] [--evals N] [--device A100-80GB|H100-SXM] [--threads N]
//
// Without flags: each run's error under the given cluster specs, the mean absolute error per
// source and overall, and the zero-bubble paper's Table 4 (Qi et al. 2024): per setting the
// ranking of 1F1B, interleaved 1F1B, ZB-1p and ZB-2p, predicted against measured, and each
// gain over 1F1B. --fit fits ONE set of factors per device on all of its runs together (every
// source weighs the same; Nelder-Mead on their logarithms) and prints them.
// --loso (implies --fit) also reports the leave-one-source-out error: for each source, the
// factors fitted on the other sources, from a neutral start (never from the fit that saw the
// held-out source), predict it. Not a test (tests/CalibrationTest.cpp checks
// the shipped specs); the tables go into docs/planner.md.
//
//===----------------------------------------------------------------------===//
#include "bench/Calibration.h"
#include "ir/Model.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"
#include "tools/Args.h"

#include "llvm/ADT/StringExtras.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <thread>

using namespace pipec;

namespace {

unsigned gThreads = 2;

/// Runs `f(i)` for every i in [0, n) on gThreads threads.
template <typename F> void parallelFor(size_t n, F f) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++)
      f(i);
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < gThreads; ++t)
    pool.emplace_back(work);
  work();
  for (std::thread &t : pool)
    t.join();
}

/// Every run compiled once (by index into the runs); empty where it does not compile.
std::vector<std::optional<PreparedRun>> gPrepared;

/// Compiles the runs of `which` under `cluster` and checks that re-timing a compiled plan gives
/// what compiling it again gives, under `cluster` and under `other` (a cluster with every
/// factor changed): the fits below only re-time.
llvm::Error prepareAll(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
                       const ClusterSpec &cluster, const ClusterSpec &other) {
  gPrepared.resize(runs.size());
  std::vector<std::string> mismatch(which.size());
  parallelFor(which.size(), [&](size_t i) {
    const PublishedRun &run = runs[which[i]];
    auto p = prepareRun(run, cluster);
    if (!p) {
      llvm::consumeError(p.takeError());
      return;
    }
    // Under `cluster` the prepared plan is itself the compile to match. (A run whose order
    // depends on the costs, compiled under `other`, is ordered again, so it is only checked
    // under `cluster`: the fits compile it again after each round.)
    bool reorders = reordersWithCosts(run, cluster);
    llvm::Expected<double> compiled[] = {p->plan.stats.stepTime / 1000.0,
                                         reorders ? p->plan.stats.stepTime / 1000.0
                                                  : predictSeconds(run, other)};
    const ClusterSpec *clusters[] = {&cluster, &other};
    for (int c = 0; c < (reorders ? 1 : 2); ++c) {
      auto retimed = retimedSeconds(*p, *clusters[c]);
      if (!compiled[c] || !retimed || std::abs(*compiled[c] - *retimed) > 1e-9 * *compiled[c])
        mismatch[i] = fmt::format("{} {}: compiled {} s, re-timed {} s", run.source, run.id,
                                  compiled[c] ? *compiled[c] : NAN, retimed ? *retimed : NAN);
      if (!compiled[c])
        llvm::consumeError(compiled[c].takeError());
      if (!retimed)
        llvm::consumeError(retimed.takeError());
    }
    gPrepared[which[i]] = std::move(*p);
  });
  for (const std::string &m : mismatch)
    if (!m.empty())
      return inputError("re-timing a compiled run differs from compiling it: {}", m);
  return llvm::Error::success();
}

/// Compiles the runs of `which` whose order depends on the costs (reordersWithCosts) again
/// under `cluster`, so that re-timing them under `cluster` is compiling them under it.
void researchAll(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
                 const ClusterSpec &cluster) {
  std::vector<size_t> searched;
  for (size_t i : which)
    if (reordersWithCosts(runs[i], cluster))
      searched.push_back(i);
  parallelFor(searched.size(), [&](size_t j) {
    auto p = prepareRun(runs[searched[j]], cluster);
    if (p)
      gPrepared[searched[j]] = std::move(*p);
    else {
      llvm::consumeError(p.takeError());
      gPrepared[searched[j]].reset();
    }
  });
}

/// Predicted seconds of every run in `which` (indices into runs); 0 where it does not compile.
std::vector<double> predictAll(const std::vector<size_t> &which, const ClusterSpec &cluster) {
  std::vector<double> out(which.size(), 0);
  parallelFor(which.size(), [&](size_t i) {
    std::optional<PreparedRun> &p = gPrepared[which[i]];
    if (!p)
      return;
    auto s = retimedSeconds(*p, cluster);
    if (s)
      out[i] = *s;
    else
      llvm::consumeError(s.takeError());
  });
  return out;
}

/// |error| of one prediction; a run that does not compile counts as 100%.
double absError(const PublishedRun &run, double predicted) {
  return predicted > 0 ? std::abs(throughputError(run.measuredSeconds, predicted)) : 1.0;
}

/// Sum of |error| (absError) and count of `which`'s runs under `predicted`, grouped by
/// `key(run)`: by source for the fit's objective, by schedule for the spec's record.
template <typename Key>
std::map<std::string, std::pair<double, int>>
absErrorsBy(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
            const std::vector<double> &predicted, Key key) {
  std::map<std::string, std::pair<double, int>> out;
  for (size_t i = 0; i < which.size(); ++i) {
    auto &[sum, n] = out[key(runs[which[i]])];
    sum += absError(runs[which[i]], predicted[i]);
    ++n;
  }
  return out;
}

/// How much a source's runs weigh in the fit against its number of runs n: 0 (every source
/// weighs the same), 1 (every run does) or in between (a source weighs n^gWeightPower).
double gWeightPower = 0;

/// Weighted mean over sources of each source's mean absolute error (a source of n runs weighs
/// n^gWeightPower).
double objective(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
                 const std::vector<double> &predicted) {
  auto bySource =
      absErrorsBy(runs, which, predicted, [](const PublishedRun &r) { return r.source; });
  double total = 0, weights = 0;
  for (auto &[_, sn] : bySource) {
    double w = std::pow(double(sn.second), gWeightPower);
    total += w * sn.first / sn.second;
    weights += w;
  }
  return weights > 0 ? total / weights : 0;
}

/// The factors the fit moves, each with its bounds.
struct Factor {
  const char *name;
  double ClusterSpec::*field; // or nullptr: the efficiency of `link`
  double lo, hi;
  Link ClusterSpec::*link = nullptr;
  /// Whether the fit is pulled towards the factor's prior (gPriorWeight). Not for a factor
  /// whose neutral value is none (its lower bound), which the pull would keep it from reaching.
  bool pulled = true;
};
const Factor kFactors[] = {
    // The best dense GEMMs reach about 85% of an A100's or H100's peak: no fit goes past it.
    {"achieved_fraction", &ClusterSpec::achievedFraction, 0.2, 0.85},
    // GEMM efficiency by arithmetic intensity (gemm_half_dim, by the smallest dimension, came
    // out with no shape dependence: every run's GEMMs are at least ~1,000 tokens deep).
    {"gemm_half_intensity", &ClusterSpec::gemmHalfIntensity, 1, 4096},
    // FP8 GEMMs over BF16 ones: at most the tensor cores' 2x, at least no gain.
    {"fp8_gemm_speedup", &ClusterSpec::fp8GemmSpeedup, 1, 2},
    {"attention_fraction", &ClusterSpec::attentionFraction, 0.02, 1.0},
    // FlashAttention-2 reaches 50-73% of an A100's peak forward and about half of it forward
    // and backward (Dao 2023); below 0.3 a fit would be using flash attention, which only some
    // sources run, as a knob for whatever else slows them, and predict long sequences badly.
    {"flash_attention_fraction", &ClusterSpec::flashAttentionFraction, 0.3, 0.85},
    {"memory_GBps", &ClusterSpec::memoryGBps, 100, 4000},
    // A fixed cost per layer and pass is launch and framework overhead: tens of microseconds
    // at most on either device. Larger values buy in-sample error by standing in for what the
    // model lacks, and predict other runs badly.
    {"op_overhead_us", &ClusterSpec::opOverheadUs, 1, 100},
    // NVLink's collectives (the tp all-reduces) and the network's transfers and collectives
    // (pipeline messages, dp all-reduces) reach different fractions of their nominal bandwidth.
    {"intra_node efficiency", nullptr, 0.2, 1.0, &ClusterSpec::intraNode},
    {"inter_node efficiency", nullptr, 0.2, 1.0, &ClusterSpec::interNode},
    {"message_overhead_us", &ClusterSpec::messageOverheadUs, 1, 100},
    {"p2p_sync_us", &ClusterSpec::p2pSyncUs, 1, 1000},
    // The variability of a pass's time, as waiting neighbours pay it (ClusterSpec::passJitterUs):
    // none is its neutral value, so no pull towards the prior.
    {"pass_jitter_us", &ClusterSpec::passJitterUs, 1, 1000, nullptr, /*pulled=*/false},
};

double get(const ClusterSpec &c, const Factor &f) {
  return f.field ? c.*f.field : (c.*f.link).efficiency;
}
void set(ClusterSpec &c, const Factor &f, double v) {
  v = std::clamp(v, f.lo, f.hi);
  if (f.field)
    c.*f.field = v;
  else
    (c.*f.link).efficiency = v;
}

/// Whether some run in `which` measures factor `f` under `cluster`: an attention kernel's
/// efficiency only where a run uses that kernel, the device synchronisation of Megatron-LM's
/// transfers only where a run makes them (elsewhere no fit may move it; it keeps the spec's
/// value).
bool measured(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
              const ClusterSpec &cluster, const Factor &f) {
  if (f.field == &ClusterSpec::p2pSyncUs)
    return std::any_of(which.begin(), which.end(), [&](size_t i) {
      return clusterFor(runs[i], cluster).p2p == P2p::Megatron && runs[i].options.parallel.pp > 1;
    });
  // FP8's speedup only where both FP8 and BF16 runs are in: FP8 runs alone measure the product
  // of achieved_fraction and the speedup, not either.
  if (f.field == &ClusterSpec::fp8GemmSpeedup)
    return std::any_of(which.begin(), which.end(), [&](size_t i) { return runs[i].fp8; }) &&
           std::any_of(which.begin(), which.end(), [&](size_t i) { return !runs[i].fp8; });
  // Each attention kernel's efficiency only where a run uses that kernel.
  if (f.field != &ClusterSpec::attentionFraction && f.field != &ClusterSpec::flashAttentionFraction)
    return true;
  Attention kind =
      f.field == &ClusterSpec::attentionFraction ? Attention::Materialized : Attention::Flash;
  for (size_t i : which)
    if (runs[i].model.transformer && runs[i].model.transformer->attention == kind)
      return true;
  return false;
}

/// Where the leave-one-source-out fits start: a prior that has seen no run, so that a held-out
/// source never steers its own prediction (starting from the fit on all sources would). A
/// factor the training runs do not measure keeps it: FP8's speedup, when the training runs are
/// all FP8 or all BF16, stays at sqrt(2), the middle of [1, 2] on the fit's logarithmic scale;
/// flash attention's efficiency, when no training run uses it, 0.4. A pass's variability
/// starts at 100 µs for a 1-ms pass (a tenth of it). GEMM efficiency's half
/// intensity (the 0) is the device's ridge point, set per device in main (ridgePoint below).
const double kPrior[] = {0.5, 0, std::sqrt(2.0), 0.3, 0.4, 1500, 10, 0.8, 0.8, 5, 100, 100};
static_assert(std::size(kPrior) == std::size(kFactors));
constexpr size_t kHalfIntensity = 1; // gemm_half_intensity's index in kFactors and kPrior
std::array<double, std::size(kPrior)> gPrior = std::to_array(kPrior);

/// The prior of gemm_half_intensity: the device's ridge point, its datasheet peak over its
/// datasheet memory bandwidth in FLOPs per byte. A GEMM's intensity I (ModelSpec: m·k·n / (m·k +
/// k·n + m·n)) is its FLOPs per byte of operands and result in 16-bit types, so a GEMM that
/// pays its FLOPs at the peak plus its bytes at the bandwidth (the smooth roofline) runs at
/// I / (I + ridge point) of peak: gemm_half_intensity = the ridge point. The fit moves it from
/// there; no training run sets it.
double ridgePoint(const ClusterSpec &c, double datasheetGBps) {
  return c.peakTflops * 1e3 / datasheetGBps;
}

/// How strongly the fit is held to the prior (gPrior): gPriorWeight times the sum over the factors
/// it moves of the squared natural logarithm of (factor / prior) is added to the objective (a
/// factor twice or half its prior costs 0.48 gPriorWeight). A factor the training runs barely pin
/// down then stays near the prior instead of wandering to a bound.
double gPriorWeight = 0;

ClusterSpec neutralStart(ClusterSpec c) {
  // Every factor, measured or not: one the training runs do not measure must not keep the
  // spec's value either, which a fit on every source (the held-out one too) set.
  for (size_t i = 0; i < std::size(kFactors); ++i)
    set(c, kFactors[i], gPrior[i]);
  return c;
}

/// Nelder-Mead on the logarithms of the factors the runs measure, from `start` (initial simplex:
/// each factor `spread` times larger), at most `evaluations` objective evaluations. A factor no
/// run measures is not a dimension of the simplex: it keeps its value.
ClusterSpec nelderMead(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
                       ClusterSpec start, int evaluations, double spread, double &bestError) {
  // Unset factors start from a value the fit can move multiplicatively (those no run measures
  // stay unset).
  for (const Factor &f : kFactors)
    if (get(start, f) <= 0 && measured(runs, which, start, f))
      set(start, f,
          f.field == &ClusterSpec::flashAttentionFraction ? start.achievedFraction : f.lo * 4);
  std::vector<size_t> dims; // the factors (indices into kFactors) the fit moves
  for (size_t i = 0; i < std::size(kFactors); ++i)
    if (measured(runs, which, start, kFactors[i]))
      dims.push_back(i);
  const size_t n = dims.size();
  using Point = std::vector<double>;
  auto specOf = [&](const Point &x) {
    ClusterSpec c = start;
    for (size_t d = 0; d < n; ++d)
      set(c, kFactors[dims[d]], std::exp(x[d]));
    return c;
  };
  int used = 0;
  auto value = [&](const Point &x) {
    ++used;
    double penalty = 0;
    for (size_t d = 0; d < n; ++d) {
      const Factor &f = kFactors[dims[d]];
      double v = std::clamp(std::exp(x[d]), f.lo, f.hi);
      if (f.pulled)
        penalty += std::pow(std::log(v / gPrior[dims[d]]), 2);
    }
    return objective(runs, which, predictAll(which, specOf(x))) + gPriorWeight * penalty;
  };
  std::vector<Point> simplex(n + 1, Point(n));
  std::vector<double> f(n + 1);
  for (size_t d = 0; d < n; ++d)
    simplex[0][d] = std::log(get(start, kFactors[dims[d]]));
  for (size_t j = 1; j <= n; ++j) {
    simplex[j] = simplex[0];
    simplex[j][j - 1] += std::log(1 + spread);
  }
  for (size_t j = 0; j <= n; ++j)
    f[j] = value(simplex[j]);
  while (n > 0 && used < evaluations) {
    std::vector<size_t> idx(n + 1);
    for (size_t j = 0; j <= n; ++j)
      idx[j] = j;
    std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return f[a] < f[b]; });
    size_t best = idx[0], worst = idx[n], second = idx[n - 1];
    Point centroid(n);
    for (size_t j = 0; j < n; ++j)
      for (size_t i = 0; i < n; ++i)
        centroid[i] += simplex[idx[j]][i] / double(n);
    auto along = [&](double t) {
      Point p(n);
      for (size_t i = 0; i < n; ++i)
        p[i] = centroid[i] + t * (simplex[worst][i] - centroid[i]);
      return p;
    };
    Point r = along(-1);
    double fr = value(r);
    if (fr < f[best]) {
      Point e = along(-2);
      double fe = value(e);
      if (fe < fr) {
        simplex[worst] = e;
        f[worst] = fe;
      } else {
        simplex[worst] = r;
        f[worst] = fr;
      }
    } else if (fr < f[second]) {
      simplex[worst] = r;
      f[worst] = fr;
    } else {
      Point k = along(0.5);
      double fk = value(k);
      if (fk < f[worst]) {
        simplex[worst] = k;
        f[worst] = fk;
      } else {
        for (size_t j = 0; j <= n; ++j) {
          if (j == best)
            continue;
          for (size_t i = 0; i < n; ++i)
            simplex[j][i] = simplex[best][i] + 0.5 * (simplex[j][i] - simplex[best][i]);
          f[j] = value(simplex[j]);
        }
      }
    }
  }
  size_t best = size_t(std::min_element(f.begin(), f.end()) - f.begin());
  bestError = f[best];
  return specOf(simplex[best]);
}

/// Nelder-Mead restarted three times from its best point, each with a third of the budget and
/// a simplex half as wide (a simplex that has collapsed along one factor cannot move it again).
/// The orders of the runs that reorder with the costs are those of the cluster they were last
/// prepared under: they are compiled under `start` first and again after each restart, so that
/// the fit ends on the orders its own factors give.
ClusterSpec fit(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
                ClusterSpec start, int evaluations, double spread, double &bestError) {
  ClusterSpec c = start;
  researchAll(runs, which, c);
  for (int round = 0; round < 3; ++round) {
    c = nelderMead(runs, which, c, std::max(1, evaluations / 3), spread, bestError);
    researchAll(runs, which, c);
    spread /= 2;
  }
  bestError = objective(runs, which, predictAll(which, c));
  return c;
}

void printFactors(const ClusterSpec &c) {
  fmt::print("  \"achieved_fraction\": {:.3f}, \"gemm_half_intensity\": {:.0f}, "
             "\"fp8_gemm_speedup\": {:.3f}, \"attention_fraction\": {:.3f},\n"
             "  \"flash_attention_fraction\": {:.3f}, \"memory_GBps\": {:.0f}, "
             "\"op_overhead_us\": {:.0f}, \"message_overhead_us\": {:.0f},\n"
             "  \"p2p_sync_us\": {:.0f}, \"pass_jitter_us\": {:.0f}, intra_node efficiency {:.2f}, "
             "inter_node efficiency {:.2f}\n",
             c.achievedFraction, c.gemmHalfIntensity, c.fp8GemmSpeedup, c.attentionFraction,
             c.flashAttentionFraction, c.memoryGBps, c.opOverheadUs, c.messageOverheadUs,
             c.p2pSyncUs, c.passJitterUs, c.intraNode.efficiency, c.interNode.efficiency);
}

/// Mean absolute error table of `which` under `predicted`, one line per source, or per
/// schedule as published (`bySchedule`: how well each schedule's runs are predicted, over
/// every source that ran it).
void printErrorTable(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
                     const std::vector<double> &predicted, const char *what, bool bySchedule) {
  std::map<std::string, std::vector<double>> byKey;
  for (size_t i = 0; i < which.size(); ++i) {
    const PublishedRun &r = runs[which[i]];
    byKey[bySchedule ? r.publishedSchedule : r.source].push_back(
        predicted[i] > 0 ? throughputError(r.measuredSeconds, predicted[i]) : NAN);
  }
  fmt::print("| {} | runs | {} mean abs error | mean signed | worst |\n|---|---|---|---|---|\n",
             bySchedule ? "schedule" : "source", what);
  double all = 0;
  int n = 0;
  for (auto &[source, errs] : byKey) {
    double abs = 0, signedSum = 0, worst = 0;
    for (double e : errs) {
      double a = std::isnan(e) ? 1.0 : std::abs(e);
      abs += a;
      signedSum += std::isnan(e) ? 0 : e;
      worst = std::max(worst, a);
    }
    all += abs;
    n += int(errs.size());
    fmt::print("| {} | {} | {:.1f}% | {:+.1f}% | {:.1f}% |\n", source, errs.size(),
               100 * abs / errs.size(), 100 * signedSum / errs.size(), 100 * worst);
  }
  fmt::print("| all | {} | {:.1f}% | | |\n\n", n, n ? 100 * all / n : 0.0);
}

/// The cluster spec's "calibration" record (docs/contracts.md#cluster-spec-pipecluster1) from
/// the leave-one-source-out predictions: by schedule as pipec compiles it (the zero-bubble
/// paper's ZB-1p and ZB-2p are zb-auto), the mean absolute throughput error.
void printCalibrationRecord(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
                            const std::vector<double> &loso, size_t sources,
                            const std::string &device) {
  std::vector<std::string> entries;
  for (const auto &[name, sn] :
       absErrorsBy(runs, which, loso, [](const PublishedRun &r) { return r.options.schedule; }))
    entries.push_back(fmt::format("\"{}\": {:.3f}", name, sn.first / sn.second));
  fmt::print("the spec's calibration record (held out by schedule):\n  \"calibration\": "
             "{{\"runs\": \"{} published {} runs from {} sources "
             "(bench/data/published-runs.csv)\", \"held_out_error\": {{{}}}}}\n\n",
             which.size(), device, sources, llvm::join(entries, ", "));
}

/// The peak memory per GPU of the runs whose source reports it, against the compiled plans'
/// (their busiest rank's) under `cluster` with each of the two rules for what the software
/// keeps ("kept_activations": piperun's, then Megatron-LM's). The source's unit is "GB", taken
/// as 10^9 bytes.
void printPeakMemory(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
                     const ClusterSpec &cluster) {
  std::vector<size_t> reported;
  for (size_t i : which)
    if (runs[i].measuredPeakBytes > 0)
      reported.push_back(i);
  if (reported.empty())
    return;
  struct Rule {
    const char *name;
    bool megatron;
    double sumAbs = 0, sumSigned = 0, worst = 0;
    std::vector<double> predicted;
  } rules[] = {{"piperun", false, 0, 0, 0, {}}, {"megatron", true, 0, 0, 0, {}}};
  for (Rule &rule : rules) {
    ClusterSpec c = cluster;
    c.megatronActivations = rule.megatron;
    rule.predicted.assign(reported.size(), NAN);
    parallelFor(reported.size(), [&](size_t k) {
      auto p = prepareRun(runs[reported[k]], c);
      if (p)
        rule.predicted[k] = double(p->plan.stats.maxPeakMemoryBytes());
      else
        llvm::consumeError(p.takeError());
    });
  }
  fmt::print("Peak memory per GPU, where the source reports it (GB, 10^9 bytes; predicted under "
             "each \"kept_activations\" rule, error = predicted / measured - 1):\n\n"
             "| source | run | measured | piperun | error | megatron | error |\n"
             "|---|---|---|---|---|---|---|\n");
  for (size_t k = 0; k < reported.size(); ++k) {
    const PublishedRun &run = runs[reported[k]];
    fmt::print("| {} | {} | {:.0f} |", run.source, run.id, run.measuredPeakBytes / 1e9);
    for (Rule &rule : rules) {
      double error = rule.predicted[k] / run.measuredPeakBytes - 1;
      rule.sumAbs += std::abs(error);
      rule.sumSigned += error;
      rule.worst = std::max(rule.worst, std::abs(error));
      fmt::print(" {:.1f} | {:+.1f}% |", rule.predicted[k] / 1e9, 100 * error);
    }
    fmt::print("\n");
  }
  fmt::print("\n");
  for (const Rule &rule : rules)
    fmt::print("peak memory over {} runs, {} rules: mean absolute error {:.1f}%, mean signed "
               "{:+.1f}%, worst {:.1f}%\n",
               reported.size(), rule.name, 100 * rule.sumAbs / double(reported.size()),
               100 * rule.sumSigned / double(reported.size()), 100 * rule.worst);
  fmt::print("\n");
}

/// Every run ran on its device: under each "kept_activations" rule, the published layouts
/// whose compiled peak (as calibration compiles them) exceeds the spec's device memory.
void printOverMemory(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
                     const ClusterSpec &cluster) {
  fmt::print("Published layouts within the device's {:.2f} GiB as compiled:\n",
             double(cluster.memoryBytes) / 1073741824.0);
  for (bool megatron : {false, true}) {
    ClusterSpec c = cluster;
    c.megatronActivations = megatron;
    std::vector<double> peak(which.size(), NAN);
    parallelFor(which.size(), [&](size_t k) {
      auto p = prepareRun(runs[which[k]], c);
      if (p)
        peak[k] = double(p->plan.stats.maxPeakMemoryBytes());
      else
        llvm::consumeError(p.takeError());
    });
    std::vector<std::string> over;
    for (size_t k = 0; k < which.size(); ++k)
      if (!(peak[k] <= double(clusterFor(runs[which[k]], c).memoryBytes)))
        over.push_back(fmt::format("{} ({:.1f} GiB)", runs[which[k]].id, peak[k] / 1073741824.0));
    fmt::print(
        "  \"kept_activations\": \"{}\"{}: {} of {}{}{}\n", megatron ? "megatron" : "piperun",
        megatron == cluster.megatronActivations ? " (the spec's)" : "", which.size() - over.size(),
        which.size(), over.empty() ? "" : "; over: ", llvm::join(over, ", "));
  }
  fmt::print("\n");
}

/// The zero-bubble paper's Table 4: settings of four schedules each.
void printZeroBubble(const std::vector<PublishedRun> &runs, const std::vector<size_t> &which,
                     const std::vector<double> &predicted) {
  const char *names[] = {"1f1b", "interleaved-1f1b", "zb-1p", "zb-2p"};
  const char *labels[] = {"1F1B", "1F1B-I", "ZB-1p", "ZB-2p"};
  // setting -> schedule index -> (measured, predicted) seconds
  std::map<std::string, std::map<int, std::pair<double, double>>> settings;
  for (size_t i = 0; i < which.size(); ++i) {
    const PublishedRun &r = runs[which[i]];
    if (r.source != "qi2024_zerobubble" || llvm::StringRef(r.id).substr(0, 3) != "T4-")
      continue;
    for (int s = 0; s < 4; ++s)
      if (r.publishedSchedule == names[s])
        settings[fmt::format("{} m={}", r.model.transformer->numLayers,
                             r.options.parallel.microbatches)][s] = {r.measuredSeconds,
                                                                     predicted[i]};
  }
  if (settings.empty())
    return;
  fmt::print("Zero-bubble paper, Table 4 (throughput ranking and gain over 1F1B, measured / "
             "predicted):\n\n| layers, m | measured ranking | predicted ranking | same | ");
  for (int s = 1; s < 4; ++s)
    fmt::print("{} gain | ", labels[s]);
  fmt::print("\n|---|---|---|---|---|---|---|\n");
  int same = 0, within = 0, gains = 0;
  double gainErr = 0;
  for (auto &entry : settings) {
    // (Not a structured binding: clang 14, --config=layering's, cannot capture one in a lambda.)
    const auto &key = entry.first;
    auto &m = entry.second;
    if (m.size() != 4)
      continue;
    std::vector<double> measuredS, predictedS;
    for (int s = 0; s < 4; ++s) {
      measuredS.push_back(m[s].first);
      predictedS.push_back(m[s].second);
    }
    // Fastest first; "=" where the published numbers tie.
    auto ranking = [&](const std::vector<double> &t) {
      std::vector<int> idx = {0, 1, 2, 3};
      std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return t[a] < t[b]; });
      std::string s = labels[idx[0]];
      for (size_t k = 1; k < idx.size(); ++k)
        s += std::string(t[idx[k]] == t[idx[k - 1]] ? " = " : " > ") + labels[idx[k]];
      return s;
    };
    bool agrees = sameRanking(measuredS, predictedS);
    same += agrees;
    fmt::print("| {} | {} | {} | {} | ", key, ranking(measuredS), ranking(predictedS),
               agrees ? "yes" : "no");
    for (int s = 1; s < 4; ++s) {
      double gm = m[0].first / m[s].first - 1, gp = m[0].second / m[s].second - 1;
      ++gains;
      within += std::abs(gp - gm) <= 0.03;
      gainErr += std::abs(gp - gm);
      fmt::print("{:+.1f}% / {:+.1f}% | ", 100 * gm, 100 * gp);
    }
    fmt::print("\n");
  }
  fmt::print("\nrankings equal in {} of {} settings; gains within 3 points: {} of {} (mean gap "
             "{:.1f} points)\n\n",
             same, settings.size(), within, gains, gains ? 100 * gainErr / gains : 0.0);
}

int fail(llvm::Error err) {
  fmt::print(stderr, "calibration_bench: {}\n", takeMessage(std::move(err)));
  return 2;
}

} // namespace

const char kUsage[] =
    R"(usage: calibration_bench [--data bench/data/published-runs.csv]
                         [--a100 examples/a100-selene.json] [--h100 examples/h100-nemo.json]
                         [--device A100-80GB|H100-SXM] [--fit] [--loso] [--evals N]
                         [--prior-weight W] [--weight-power P] [--threads N]

Every published run of the data file compiled as published and its predicted step time set
against the measured one, per device, with the cluster spec given (or shipped).
  --fit            fit one set of factors per device on all of its sources, then report
  --loso           also fit on all sources but one and predict the one left out, each in turn
  --evals N        objective evaluations per fit (default 60; the docs' figures use 2000)
  --prior-weight W pull of the fit towards calibration_bench's neutral prior, GEMMs' half
                   intensity at the device's datasheet ridge point (docs: 0.003)
  --weight-power P a source of n runs weighs n^P in the fit (default 0: every source the same)
  --device NAME    only that device's runs
  --threads N      threads that compile and time runs (default 2)
The tables and how to read them: docs/planner.md, "Calibration out of sample".
)";

int main(int argc, char **argv) {
  for (int i = 1; i < argc; ++i)
    if (llvm::StringRef(argv[i]) == "--help" || llvm::StringRef(argv[i]) == "-h") {
      fmt::print("{}", kUsage);
      return 0;
    }
  auto args = Args::parse(argc, argv, 1,
                          {"--data", "--a100", "--h100", "--threads", "--evals", "--device",
                           "--weight-power", "--prior-weight"},
                          {"--fit", "--loso"}, /*command=*/"");
  if (!args)
    return fail(args.takeError());
  auto threads = args->integer("--threads", 2, 1, 256);
  auto evals = args->integer("--evals", 60, 1, 100000);
  if (!threads)
    return fail(threads.takeError());
  if (!evals)
    return fail(evals.takeError());
  gThreads = unsigned(*threads);
  if (auto w = args->get("--prior-weight")) {
    if (!llvm::to_float(*w, gPriorWeight) || gPriorWeight < 0 || gPriorWeight > 1)
      return fail(inputError("--prior-weight: expected a number in [0, 1], got {}", *w));
  }
  if (auto w = args->get("--weight-power")) {
    if (!llvm::to_float(*w, gWeightPower) || gWeightPower < 0 || gWeightPower > 1)
      return fail(inputError("--weight-power: expected a number in [0, 1], got {}", *w));
  }
  std::vector<PublishedRun> runs;
  std::vector<SkippedRow> skipped;
  if (auto err = loadPublishedRuns(args->path("--data").value_or("bench/data/published-runs.csv"),
                                   runs, skipped))
    return fail(std::move(err));
  fmt::print("{} measured runs; {} rows left out:\n", runs.size(), skipped.size());
  for (const SkippedRow &s : skipped)
    fmt::print("  {} {}: {}\n", s.source, s.id, s.why);
  bool doFit = args->has("--fit") || args->has("--loso");
  // The datasheets' memory bandwidths (NVIDIA A100 80GB SXM: 2,039 GB/s; H100 SXM: 3.35 TB/s)
  // give each device's prior for gemm_half_intensity (ridgePoint).
  struct Device {
    const char *csvName, *flag, *fallback;
    double datasheetGBps;
  } devices[] = {{"A100-80GB", "--a100", "examples/a100-selene.json", 2039},
                 {"H100-SXM", "--h100", "examples/h100-nemo.json", 3350}};
  for (const Device &d : devices) {
    std::string path = args->path(d.flag).value_or(d.fallback);
    auto loaded = loadClusterSpec(path);
    if (!loaded)
      return fail(loaded.takeError());
    ClusterSpec cluster = *loaded;
    gPrior[kHalfIntensity] = ridgePoint(cluster, d.datasheetGBps);
    std::vector<size_t> which;
    for (size_t i = 0; i < runs.size(); ++i)
      if (runs[i].device == d.csvName)
        which.push_back(i);
    if (which.empty() || (args->has("--device") && *args->get("--device") != d.csvName))
      continue;
    fmt::print("\n## {} ({} runs, cluster spec {})\n\n", d.csvName, which.size(), path);
    ClusterSpec other = cluster;
    for (const Factor &f : kFactors)
      if (get(other, f) > 0)
        set(other, f, get(other, f) * 0.9);
    if (auto err = prepareAll(runs, which, cluster, other))
      return fail(std::move(err));
    if (doFit) {
      double e = 0;
      cluster = fit(runs, which, cluster, int(*evals), 0.3, e);
      fmt::print("fitted on all sources (mean of per-source mean absolute errors {:.1f}%):\n",
                 100 * e);
      printFactors(cluster);
      fmt::print("\n");
    }
    std::vector<double> predicted = predictAll(which, cluster);
    fmt::print("| source | run | schedule | tp pp vpp dp | b | measured s | predicted s | error "
               "|\n|---|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < which.size(); ++i) {
      const PublishedRun &r = runs[which[i]];
      const ParallelConfig &pc = r.options.parallel;
      fmt::print("| {} | {} | {} | {} {} {} {} | {} | {:.3f} | {:.3f} | {:+.1f}% |\n", r.source,
                 r.id,
                 r.searchedLimit > 0 ? fmt::format("zb-auto at {}p·M_B", r.searchedLimit)
                                     : r.options.schedule,
                 pc.tp, pc.pp, pc.vpp, pc.dp, r.model.transformer->microbatchSize,
                 r.measuredSeconds, predicted[i],
                 predicted[i] > 0 ? 100 * throughputError(r.measuredSeconds, predicted[i]) : NAN);
    }
    fmt::print("\n");
    printErrorTable(runs, which, predicted, "in-sample", false);
    printErrorTable(runs, which, predicted, "in-sample", true);
    printZeroBubble(runs, which, predicted);
    printPeakMemory(runs, which, cluster);
    printOverMemory(runs, which, cluster);
    if (!args->has("--loso"))
      continue;
    // Leave one source out: fit on the others, from the neutral start with the global fit's
    // budget, and predict the held-out one.
    std::set<std::string> sources;
    for (size_t i : which)
      sources.insert(runs[i].source);
    if (sources.size() < 2)
      continue;
    std::vector<double> loso(which.size(), 0);
    for (const std::string &held : sources) {
      std::vector<size_t> train, test, testPos;
      for (size_t i = 0; i < which.size(); ++i) {
        if (runs[which[i]].source == held) {
          test.push_back(which[i]);
          testPos.push_back(i);
        } else {
          train.push_back(which[i]);
        }
      }
      double e = 0;
      ClusterSpec c = fit(runs, train, neutralStart(cluster), int(*evals), 0.3, e);
      researchAll(runs, test, c);
      std::vector<double> p = predictAll(test, c);
      for (size_t j = 0; j < test.size(); ++j)
        loso[testPos[j]] = p[j];
      fmt::print("held out {}: fitted on the others to {:.1f}%:\n", held, 100 * e);
      printFactors(c);
    }
    fmt::print("\n");
    printErrorTable(runs, which, loso, "leave-one-source-out", false);
    printErrorTable(runs, which, loso, "leave-one-source-out", true);
    printZeroBubble(runs, which, loso);
    printCalibrationRecord(runs, which, loso, sources.size(), d.csvName);
  }
  return 0;
}
