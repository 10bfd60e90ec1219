//===- DependencyCheckTest.cpp - Every schedule against docs/contracts.md#semantics, read a second
// time --===//
//
// The verifier, the comm lowering and the simulator share one reading of
// docs/contracts.md#semantics (ir/Semantics.h, ir/CostModel.h): a wrong rule there would pass all
// three. This file is a second reading, written from docs/contracts.md#semantics and
// docs/contracts.md alone, without those headers, and run against every registered schedule on
// random abstract models (random F, B, W per layer, activation and weight-gradient bytes, transfer
// and all-reduce times) with pp, vpp, microbatches, sub-sequences, tp and dp varied. For each
// compiled plan and the simulator's timeline it checks:
//  - completeness and placement: every (s, m, k) has one F and one fused B or one I and one W,
//    on the rank docs/contracts.md#parallel-configuration's placement gives stage s;
//  - dependencies: F(s,m,k) after F(s-1,m,k) and F(s,m,k-1); B or I(s,m,k) after F(s,m,k),
//    B(s+1,m,k) and B(s,m,k+1); W after its I: same-rank inputs earlier in the stream,
//    cross-rank ones received earlier in the consumer's stream from a send placed after the
//    producer in the producer's stream; no send or recv without such an edge;
//  - NCCL's rules: per ordered rank pair the sends and the recvs list the same tensors in the
//    same order, and executing every rank with groups (and lone ops) that complete only when
//    each op's partner is posted reaches every rank's end;
//  - collectives: a dp all-reduce per stage after all its weight gradients; the optimizer step
//    last, after every all-reduce;
//  - the timing model: each op starts exactly at the later of its rank's previous op's end
//    and each input's arrival (producer's end, plus p2p_time across ranks), lasts the sum of its
//    stage's layer costs over K (its share when split into tp parts); tp all-reduces occupy
//    the rank for allreduce_time; busy, span, makespan and bubble ratio as docs/contracts.md
//    defines them;
//  - the memory model: each rank's peak activation from stream order.
// And that this checker can fail: planted faults in a good plan are each reported.
//
//===----------------------------------------------------------------------===//
#include "tests/TestUtil.h"

#include "ir/CostModel.h"
#include "ir/PlanText.h"
#include "schedules/Policy.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace pipec::test {
namespace {

/// A compute op by docs/contracts.md#plan-pipeplan1's identity: (stage, microbatch, slice) and
/// which of F, B (the input-gradient backward, fused or not) or W (weight gradient; a fused
/// backward is one too).
using OpId = std::tuple<int, int, int, char>;

struct Where {
  int rank = -1;
  size_t first = 0, last = 0; // first and last part in the rank's stream
  bool fused = false;
  int count = 0; // how many times the op (its first part) appears
};

/// What one input of an op is and where it comes from.
struct Need {
  OpId producer;
  bool crossRank;
  bool activation; // the tensor a cross-rank input travels as: activation or gradient
};

class Checker {
public:
  Checker(const Plan &plan, const ModelSpec &model, const Timeline &timeline)
      : plan(plan), model(model), t(timeline) {}

  std::vector<std::string> run() {
    collectOps();
    if (!problems.empty())
      return problems;
    checkDependencies();
    checkMatching();
    // What follows assumes a plan that is whole (and the timeline of it).
    if (problems.empty())
      checkDeadlock();
    if (problems.empty())
      checkCollectives();
    if (problems.empty())
      checkTiming();
    if (problems.empty())
      checkMemory();
    return problems;
  }

private:
  const Plan &plan;
  const ModelSpec &model;
  const Timeline &t;
  std::vector<std::string> problems;
  std::map<OpId, Where> ops;
  /// The partner of every send and recv (rank, step) under FIFO matching.
  std::map<std::pair<int, size_t>, std::pair<int, size_t>> partner;

  template <typename... A> void fail(fmt::format_string<A...> f, A &&...a) {
    if (problems.size() < 20)
      problems.push_back(fmt::format(f, std::forward<A>(a)...));
  }

  int numStages() const { return plan.parallel.pp * plan.parallel.vpp; }
  int numSlices() const { return plan.parallel.seqSplits; }

  /// docs/contracts.md#parallel-configuration: loop placement s % P; V-shape s < P ? s : 2P-1-s.
  int rankOfStage(int s) const {
    int p = plan.parallel.pp;
    if (plan.placement == Placement::VShape)
      return s < p ? s : 2 * p - 1 - s;
    return s % p;
  }

  static char letterOf(OpKind op) {
    return op == OpKind::Forward ? 'F' : op == OpKind::BackwardWeight ? 'W' : 'B';
  }

  void collectOps() {
    if (int(plan.stages.size()) != numStages())
      return fail("{} stages, pp x vpp = {}", plan.stages.size(), numStages());
    for (int s = 0; s < numStages(); ++s)
      if (plan.stages[size_t(s)].rank != rankOfStage(s))
        fail("stage {} is on rank {}; the placement puts it on {}", s, plan.stages[size_t(s)].rank,
             rankOfStage(s));
    for (int r = 0; r < plan.numRanks(); ++r) {
      const auto &stream = plan.ranks[size_t(r)];
      for (size_t i = 0; i < stream.size(); ++i) {
        const Instruction &ins = stream[i];
        if (!ins.isCompute())
          continue;
        if (rankOfStage(ins.stage) != r)
          fail("rank {} step {} runs stage {}, which lives on rank {}", r, i, ins.stage,
               rankOfStage(ins.stage));
        std::vector<char> letters = {letterOf(ins.op)};
        if (ins.op == OpKind::Backward)
          letters.push_back('W');
        for (char c : letters) {
          Where &w = ops[{ins.stage, ins.mb, ins.slice, c}];
          if (ins.part <= 0) {
            ++w.count;
            w.rank = r;
            w.first = i;
            w.fused = ins.op == OpKind::Backward;
          }
          if (ins.part < 0 || ins.part == ins.parts - 1)
            w.last = i;
        }
      }
    }
    for (int s = 0; s < numStages(); ++s)
      for (int m = 0; m < plan.parallel.microbatches; ++m)
        for (int k = 0; k < numSlices(); ++k)
          for (char c : {'F', 'B', 'W'}) {
            auto it = ops.find({s, m, k, c});
            int n = it == ops.end() ? 0 : it->second.count;
            if (n != 1)
              fail("{}({},{},{}) appears {} times", c, s, m, k, n);
          }
    if (ops.size() != size_t(numStages()) * plan.parallel.microbatches * numSlices() * 3)
      fail("{} distinct compute ops, expected {}", ops.size(),
           size_t(numStages()) * plan.parallel.microbatches * numSlices() * 3);
  }

  /// docs/contracts.md#semantics' inputs of op `id`.
  std::vector<Need> needsOf(const OpId &id) const {
    auto [s, m, k, c] = id;
    std::vector<OpId> in;
    if (c == 'F') {
      if (s > 0)
        in.push_back({s - 1, m, k, 'F'});
      if (k > 0)
        in.push_back({s, m, k - 1, 'F'});
    } else if (c == 'B') {
      in.push_back({s, m, k, 'F'});
      if (s < numStages() - 1)
        in.push_back({s + 1, m, k, 'B'});
      if (k < numSlices() - 1)
        in.push_back({s, m, k + 1, 'B'});
    } else {
      in.push_back({s, m, k, 'B'});
    }
    std::vector<Need> out;
    for (const OpId &p : in)
      out.push_back(Need{p, rankOfStage(std::get<0>(p)) != rankOfStage(s), std::get<3>(p) == 'F'});
    return out;
  }

  /// Where in `rank`'s stream the p2p op moving (activation?, producer stage, m, k) to/from
  /// `peer` is; SIZE_MAX if nowhere.
  size_t findComm(int rank, OpKind op, bool activation, int stage, int m, int k, int peer) const {
    const auto &stream = plan.ranks[size_t(rank)];
    for (size_t i = 0; i < stream.size(); ++i) {
      const Instruction &c = stream[i];
      if (c.op == op && (c.tensor == TensorKind::Activation) == activation && c.stage == stage &&
          c.mb == m && c.slice == k && c.peer == peer)
        return i;
    }
    return SIZE_MAX;
  }

  void checkDependencies() {
    size_t edges = 0;
    for (const auto &[id, where] : ops) {
      if (std::get<3>(id) == 'W' && where.fused)
        continue; // a fused backward's needs are its B's
      for (const Need &n : needsOf(id)) {
        const Where &p = ops.at(n.producer);
        auto name = [](const OpId &o) {
          return fmt::format("{}({},{},{})", std::get<3>(o), std::get<0>(o), std::get<1>(o),
                             std::get<2>(o));
        };
        if (!n.crossRank) {
          if (p.last >= where.first)
            fail("{} at rank {} step {} runs before its input {} (step {})", name(id), where.rank,
                 where.first, name(n.producer), p.last);
          continue;
        }
        ++edges;
        auto [ps, pm, pk, pc] = n.producer;
        size_t recv = findComm(where.rank, OpKind::Recv, n.activation, ps, pm, pk, p.rank);
        size_t send = findComm(p.rank, OpKind::Send, n.activation, ps, pm, pk, where.rank);
        if (recv == SIZE_MAX || recv >= where.first)
          fail("{} on rank {} (step {}) has no recv of {}'s output before it", name(id), where.rank,
               where.first, name(n.producer));
        if (send == SIZE_MAX || send <= p.last)
          fail("{} on rank {} (step {}) has no send of its output after it", name(n.producer),
               p.rank, p.last);
      }
    }
    size_t sends = 0, recvs = 0;
    for (const auto &stream : plan.ranks)
      for (const Instruction &i : stream) {
        sends += i.op == OpKind::Send;
        recvs += i.op == OpKind::Recv;
      }
    if (sends != edges || recvs != edges)
      fail("{} sends and {} recvs for {} cross-rank inputs", sends, recvs, edges);
  }

  void checkMatching() {
    const int n = plan.numRanks();
    // FIFO: the k-th send a -> b meets the k-th recv on b from a, and carries its tensor.
    std::map<std::pair<int, int>, std::vector<size_t>> sends, recvs;
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < plan.ranks[size_t(r)].size(); ++i) {
        const Instruction &c = plan.ranks[size_t(r)][i];
        if (c.op == OpKind::Send)
          sends[{r, c.peer}].push_back(i);
        if (c.op == OpKind::Recv)
          recvs[{c.peer, r}].push_back(i);
      }
    for (const auto &[pair, list] : sends) {
      const auto &other = recvs[pair];
      if (other.size() != list.size()) {
        fail("{} sends from rank {} to {} but {} recvs", list.size(), pair.first, pair.second,
             other.size());
        continue;
      }
      for (size_t j = 0; j < list.size(); ++j) {
        const Instruction &s = plan.ranks[size_t(pair.first)][list[j]];
        const Instruction &r = plan.ranks[size_t(pair.second)][other[j]];
        if (s.tensor != r.tensor || s.stage != r.stage || s.mb != r.mb || s.slice != r.slice)
          fail("rank {} step {} sends what rank {} step {} does not expect (FIFO order)",
               pair.first, list[j], pair.second, other[j]);
        partner[{pair.first, list[j]}] = {pair.second, other[j]};
        partner[{pair.second, other[j]}] = {pair.first, list[j]};
      }
    }
    for (const auto &[pair, list] : recvs)
      if (!sends.count(pair) && !list.empty())
        fail("rank {} receives from rank {}, which sends it nothing", pair.second, pair.first);
  }

  void checkDeadlock() {
    const int n = plan.numRanks();
    // Execute: a group (consecutive p2p ops of one integer group) or a lone p2p op completes
    // when each of its ops has been matched, and an op is matched once it and its partner are
    // both posted; compute ops and one-rank collectives complete alone; the embedding
    // all-reduce, between two ranks, when both have reached theirs.
    std::vector<size_t> pos(size_t(n), 0);
    std::vector<std::vector<bool>> matched(plan.ranks.size());
    for (int r = 0; r < n; ++r)
      matched[size_t(r)].assign(plan.ranks[size_t(r)].size(), false);
    auto unitEnd = [&](int r, size_t at) {
      const auto &stream = plan.ranks[size_t(r)];
      size_t e = at + 1;
      if (stream[at].isP2P() && stream[at].group != kNoGroup)
        while (e < stream.size() && stream[e].isP2P() && stream[e].group == stream[at].group)
          ++e;
      return e;
    };
    auto posted = [&](int r, size_t i) {
      return pos[size_t(r)] <= i &&
             i < (pos[size_t(r)] < plan.ranks[size_t(r)].size() ? unitEnd(r, pos[size_t(r)]) : 0);
    };
    auto embeddingPeer = [&](int r) {
      int a = rankOfStage(0), b = rankOfStage(numStages() - 1);
      return r == a ? b : a;
    };
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < n; ++r) {
        const auto &stream = plan.ranks[size_t(r)];
        size_t &at = pos[size_t(r)];
        if (at >= stream.size())
          continue;
        const Instruction &c = stream[at];
        if (c.isP2P()) {
          size_t e = unitEnd(r, at);
          bool all = true;
          for (size_t i = at; i < e; ++i) {
            auto [pr, pi] = partner.at({r, i});
            if (!matched[size_t(r)][i] && posted(pr, pi))
              matched[size_t(r)][i] = matched[size_t(pr)][pi] = true;
            all = all && matched[size_t(r)][i];
          }
          if (all) {
            at = e;
            progress = true;
          }
          continue;
        }
        if (c.op == OpKind::AllReduce && c.collective == CollectiveGroup::Embedding &&
            embeddingPeer(r) != r) {
          int peer = embeddingPeer(r);
          size_t pa = pos[size_t(peer)];
          const auto &ps = plan.ranks[size_t(peer)];
          if (pa < ps.size() && ps[pa].op == OpKind::AllReduce &&
              ps[pa].collective == CollectiveGroup::Embedding) {
            ++at;
            ++pos[size_t(peer)];
            progress = true;
          }
          continue;
        }
        ++at;
        progress = true;
      }
    }
    for (int r = 0; r < n; ++r)
      if (pos[size_t(r)] < plan.ranks[size_t(r)].size())
        fail("deadlock: rank {} cannot get past step {}", r, pos[size_t(r)]);
  }

  void checkCollectives() {
    for (int r = 0; r < plan.numRanks(); ++r) {
      const auto &stream = plan.ranks[size_t(r)];
      if (stream.empty() || stream.back().op != OpKind::OptimizerStep)
        fail("rank {} does not end with its optimizer step", r);
      int steps = 0;
      for (const Instruction &i : stream)
        steps += i.op == OpKind::OptimizerStep;
      if (steps != 1)
        fail("rank {} has {} optimizer steps", r, steps);
      for (int s = 0; s < numStages(); ++s) {
        if (rankOfStage(s) != r || plan.parallel.dp == 1)
          continue;
        size_t at = SIZE_MAX;
        int count = 0;
        for (size_t i = 0; i < stream.size(); ++i)
          if (stream[i].op == OpKind::AllReduce && stream[i].collective == CollectiveGroup::Dp &&
              stream[i].stage == s) {
            at = i;
            ++count;
          }
        if (count != 1) {
          fail("stage {} has {} dp all-reduces", s, count);
          continue;
        }
        for (int m = 0; m < plan.parallel.microbatches; ++m)
          for (int k = 0; k < numSlices(); ++k)
            if (ops.at({s, m, k, 'W'}).last > at)
              fail("stage {}'s dp all-reduce (step {}) comes before W({},{},{})", s, at, s, m, k);
      }
    }
  }

  /// Time of the whole op `c` of stage s, slice k: the sum over its layers, shared by K.
  double wholeTime(OpKind op, int s) const {
    const StageInfo &st = plan.stages[size_t(s)];
    double f = 0, b = 0, w = 0;
    for (int l = st.layerBegin; l < st.layerEnd; ++l) {
      f += model.layers[size_t(l)].forward;
      b += model.layers[size_t(l)].backwardInput;
      w += model.layers[size_t(l)].backwardWeight;
    }
    const double k = numSlices();
    if (op == OpKind::Forward)
      return f / k;
    if (op == OpKind::BackwardInput)
      return b / k;
    if (op == OpKind::BackwardWeight)
      return w / k;
    if (op == OpKind::Backward)
      return (b + w) / k;
    return 0; // sends, receives, all-reduces and the optimizer step compute no layer
  }

  static bool same(double a, double b) {
    return std::fabs(a - b) <= 1e-9 * std::max({1.0, std::fabs(a), std::fabs(b)});
  }

  void checkTiming() {
    double first = 1e300, last = 0, maxSpan = 0, sumBusy = 0;
    for (int r = 0; r < plan.numRanks(); ++r) {
      const auto &stream = plan.ranks[size_t(r)];
      double clock = 0, busy = 0, start = 1e300, end = 0;
      for (size_t i = 0; i < stream.size(); ++i) {
        const Instruction &c = stream[i];
        const OpTime &got = t.ops[size_t(r)][i];
        double want = clock, duration = 0;
        if (c.isCompute()) {
          if (c.part <= 0) {
            OpId id{c.stage, c.mb, c.slice, letterOf(c.op)};
            for (const Need &n : needsOf(id)) {
              const Where &p = ops.at(n.producer);
              double arrival = t.ops[size_t(p.rank)][p.last].end;
              if (n.crossRank)
                arrival += model.p2pTime;
              want = std::max(want, arrival);
            }
          }
          duration = wholeTime(c.op, c.stage) / (c.parts > 0 ? c.parts : 1);
        } else if (c.op == OpKind::AllReduce && c.collective == CollectiveGroup::Tp) {
          duration = model.allReduceTime;
        } else {
          continue;
        }
        if (!same(got.start, want) || !same(got.end, want + duration)) {
          fail("rank {} step {}: simulated [{}, {}], docs/contracts.md#semantics gives [{}, {}]", r,
               i, got.start, got.end, want, want + duration);
          return;
        }
        clock = got.end;
        if (c.isCompute()) {
          busy += duration;
          start = std::min(start, got.start);
          end = std::max(end, got.end);
        }
      }
      const RankStats &rs = plan.stats.ranks[size_t(r)];
      if (!same(rs.busy, busy) || !same(rs.span, end - start))
        fail("rank {}: busy {} span {}, docs/contracts.md#semantics gives {} and {}", r, rs.busy,
             rs.span, busy, end - start);
      first = std::min(first, start);
      last = std::max(last, end);
      maxSpan = std::max(maxSpan, end - start);
      sumBusy += busy;
    }
    if (!same(plan.stats.makespan, last - first))
      fail("makespan {}, docs/contracts.md#semantics gives {}", plan.stats.makespan, last - first);
    double bubble = 1 - sumBusy / plan.numRanks() / maxSpan;
    if (!same(plan.stats.bubbleRatio, bubble))
      fail("bubble ratio {}, docs/contracts.md#semantics gives {}", plan.stats.bubbleRatio, bubble);
  }

  void checkMemory() {
    for (int r = 0; r < plan.numRanks(); ++r) {
      int64_t live = 0, peak = 0;
      for (const Instruction &c : plan.ranks[size_t(r)]) {
        if (!c.isCompute())
          continue;
        const StageInfo &st = plan.stages[size_t(c.stage)];
        int64_t a = st.activationBytes[size_t(c.slice)], w = st.weightGradBytes[size_t(c.slice)];
        if (c.op == OpKind::Forward && c.part <= 0)
          live += a;
        peak = std::max(peak, live);
        if (c.part >= 0 && c.part != c.parts - 1)
          continue;
        if (c.op == OpKind::BackwardInput)
          live -= a - w;
        else if (c.op == OpKind::BackwardWeight)
          live -= w;
        else if (c.op == OpKind::Backward)
          live -= a;
      }
      if (live != 0)
        fail("rank {} ends with {} activation bytes alive", r, live);
      if (plan.stats.ranks[size_t(r)].peakActivationBytes != peak)
        fail("rank {}: peak activation {}, docs/contracts.md#semantics gives {}", r,
             plan.stats.ranks[size_t(r)].peakActivationBytes, peak);
    }
  }
};

/// An abstract model of `layers` layers with random costs, bytes and transfer times.
ModelSpec randomModel(std::mt19937 &rng, int layers) {
  std::uniform_real_distribution<double> cost(0.25, 2.0), comm(0.0, 0.5);
  std::uniform_int_distribution<int64_t> bytes(1 << 16, 1 << 22);
  ModelSpec m;
  m.name = "random";
  for (int l = 0; l < layers; ++l) {
    Layer layer;
    layer.name = fmt::format("l{}", l);
    layer.forward = cost(rng);
    layer.backwardInput = cost(rng);
    layer.backwardWeight = cost(rng);
    layer.activationBytes = bytes(rng);
    layer.weightGradBytes = layer.activationBytes / 2;
    layer.outputBytes = bytes(rng) / 16;
    layer.paramBytes = bytes(rng);
    m.layers.push_back(layer);
  }
  m.p2pTime = comm(rng);
  m.allReduceTime = comm(rng);
  return m;
}

std::vector<std::string> check(const Plan &plan, const ModelSpec &model) {
  Timeline t;
  if (llvm::Error err = simulateTimeline(plan, t))
    return {takeMessage(std::move(err))};
  return Checker(plan, model, t).run();
}

std::string joined(const std::vector<std::string> &lines) {
  std::string s;
  for (const std::string &l : lines)
    s += l + "\n";
  return s;
}

class EverySchedule : public ::testing::TestWithParam<const SchedulePolicy *> {};

TEST_P(EverySchedule, MeetsDesignSection6OnRandomCosts) {
  const SchedulePolicy *policy = GetParam();
  std::mt19937 rng(0x5eed + unsigned(policy->name().size()) * 131 + unsigned(policy->name()[0]));
  std::uniform_int_distribution<int> pp(1, 5), vpp(1, 3), mb(1, 12), k(1, 3), two(1, 2);
  int compiled = 0, attempts = 0;
  while (compiled < 12 && attempts < 400) {
    ++attempts;
    CompileOptions o =
        options(policy->name(), pp(rng), mb(rng), vpp(rng), k(rng), two(rng), two(rng));
    if (policy->check(o.parallel)) // a configuration the policy refuses: try another
      continue;
    int stages = o.parallel.pp * o.parallel.vpp;
    ModelSpec model = randomModel(rng, stages + int(rng() % unsigned(stages + 1)));
    // zb-auto's limit: between one microbatch and 2p of the heaviest stage (as layers go).
    int64_t heaviest = 0;
    for (const Layer &l : model.layers)
      heaviest = std::max(heaviest, l.activationBytes);
    o.memoryLimit = heaviest * int64_t(model.layers.size()) * (1 + int64_t(rng() % 8));
    auto plan = compilePlan(model, ClusterSpec::defaults(), o);
    if (!plan) {
      ADD_FAILURE() << fmt::format("{} pp={} vpp={} m={} K={} tp={} dp={}: ", o.schedule,
                                   o.parallel.pp, o.parallel.vpp, o.parallel.microbatches,
                                   o.parallel.seqSplits, o.parallel.tp, o.parallel.dp)
                    << takeMessage(plan.takeError());
      continue;
    }
    ++compiled;
    std::vector<std::string> problems = check(*plan, model);
    EXPECT_TRUE(problems.empty()) << fmt::format("{} pp={} vpp={} m={} K={} tp={} dp={}:\n{}",
                                                 o.schedule, o.parallel.pp, o.parallel.vpp,
                                                 o.parallel.microbatches, o.parallel.seqSplits,
                                                 o.parallel.tp, o.parallel.dp, joined(problems));
  }
  EXPECT_GE(compiled, 12) << policy->name().str() << ": too few configurations it accepts";
}

INSTANTIATE_TEST_SUITE_P(Random, EverySchedule, ::testing::ValuesIn(allPolicies()),
                         [](const auto &info) {
                           std::string n = info.param->name().str();
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

/// A good plan and what the checker says of it after `plant` breaks it.
std::vector<std::string> planted(void (*plant)(Plan &, Timeline &),
                                 CompileOptions o = options("1f1b", 4, 6, 1, 1, 1, /*dp=*/2)) {
  std::mt19937 rng(7);
  ModelSpec model = randomModel(rng, 8);
  Plan plan = compileOrFail(model, o);
  Timeline t;
  llvm::Error err = simulateTimeline(plan, t);
  EXPECT_FALSE(bool(err)) << takeMessage(std::move(err));
  EXPECT_TRUE(Checker(plan, model, t).run().empty());
  plant(plan, t);
  return Checker(plan, model, t).run();
}

size_t indexOf(const Plan &plan, int r, OpKind op, int from = 0) {
  const auto &s = plan.ranks[size_t(r)];
  for (size_t i = size_t(from); i < s.size(); ++i)
    if (s[i].op == op)
      return i;
  return SIZE_MAX;
}

/// Moves rank `r`'s first `op` to the front of its stream.
void moveFirstToFront(Plan &plan, int r, OpKind op) {
  auto &s = plan.ranks[size_t(r)];
  size_t at = indexOf(plan, r, op);
  Instruction moved = s[at];
  s.erase(s.begin() + std::ptrdiff_t(at));
  s.insert(s.begin(), moved);
}

TEST(DependencyCheckerTest, ReportsAStartEarlierThanAnInputsArrival) {
  auto problems = planted([](Plan &plan, Timeline &t) {
    size_t i = indexOf(plan, 1, OpKind::Forward);
    t.ops[1][i].start -= 0.01;
  });
  ASSERT_FALSE(problems.empty());
  EXPECT_NE(problems[0].find("docs/contracts.md#semantics gives"), std::string::npos)
      << problems[0];
}

TEST(DependencyCheckerTest, ReportsAMissingRecv) {
  auto problems = planted([](Plan &plan, Timeline &) {
    auto &s = plan.ranks[1];
    s.erase(s.begin() + std::ptrdiff_t(indexOf(plan, 1, OpKind::Recv)));
  });
  ASSERT_FALSE(problems.empty());
  EXPECT_NE(joined(problems).find("no recv"), std::string::npos) << joined(problems);
}

TEST(DependencyCheckerTest, ReportsSendsOutOfFifoOrder) {
  auto problems = planted([](Plan &plan, Timeline &) {
    // Rank 0's first two sends swap places (each still after its producer).
    auto &s = plan.ranks[0];
    size_t a = indexOf(plan, 0, OpKind::Send), b = indexOf(plan, 0, OpKind::Send, int(a) + 1);
    std::swap(s[a].mb, s[b].mb);
  });
  ASSERT_FALSE(problems.empty());
  EXPECT_NE(joined(problems).find("FIFO"), std::string::npos) << joined(problems);
}

TEST(DependencyCheckerTest, ReportsASendBeforeItsProducer) {
  auto problems = planted([](Plan &plan, Timeline &) { moveFirstToFront(plan, 0, OpKind::Send); });
  ASSERT_FALSE(problems.empty());
  EXPECT_NE(joined(problems).find("no send of its output after it"), std::string::npos)
      << joined(problems);
}

TEST(DependencyCheckerTest, ReportsAnUngroupedSendSendDeadlock) {
  // Both ranks send before they receive, each op on its own: NCCL hangs (nccl#479). Every
  // dependency and the FIFO order hold.
  auto problems = planted(
      [](Plan &plan, Timeline &) {
        llvm::Error err = parseStreams(
            "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 OPTIMIZER_STEP\n"
            "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 OPTIMIZER_STEP\n",
            plan);
        EXPECT_FALSE(bool(err)) << takeMessage(std::move(err));
      },
      options("1f1b", 2, 2));
  ASSERT_EQ(problems.size(), 2u) << joined(problems);
  EXPECT_EQ(problems[0], "deadlock: rank 0 cannot get past step 3");
  EXPECT_EQ(problems[1], "deadlock: rank 1 cannot get past step 3");
}

TEST(DependencyCheckerTest, ReportsAWrongPeakAndAWrongBubble) {
  auto peak = planted([](Plan &plan, Timeline &) { plan.stats.ranks[2].peakActivationBytes += 1; });
  ASSERT_FALSE(peak.empty());
  EXPECT_NE(peak[0].find("peak activation"), std::string::npos) << peak[0];
  auto bubble = planted([](Plan &plan, Timeline &) { plan.stats.bubbleRatio *= 1.001; });
  ASSERT_FALSE(bubble.empty());
  EXPECT_NE(bubble[0].find("bubble ratio"), std::string::npos) << bubble[0];
}

TEST(DependencyCheckerTest, ReportsADpAllReduceBeforeTheLastWeightGradient) {
  auto problems =
      planted([](Plan &plan, Timeline &) { moveFirstToFront(plan, 2, OpKind::AllReduce); });
  ASSERT_FALSE(problems.empty());
  EXPECT_NE(joined(problems).find("dp all-reduce"), std::string::npos) << joined(problems);
}

} // namespace
} // namespace pipec::test
