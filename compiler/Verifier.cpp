#include "compiler/Verifier.h"

#include "compiler/Semantics.h"
#include "ir/PlanText.h"
#include "ir/support/Error.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/SmallVector.h"

#include <algorithm>

namespace pipec {

namespace {

constexpr uint32_t kAbsent = UINT32_MAX;

/// Identity of a p2p tensor: (producer stage, mb, slice, kind).
struct TensorId {
  int stage, mb, slice;
  TensorKind kind;
  bool operator==(const TensorId &o) const = default;
};

class Verifier {
public:
  Verifier(const Plan &plan, const VerifyOptions &options)
      : plan(plan), options(options), keys(plan) {}

  llvm::Error run() {
    if (auto err = checkStages())
      return err;
    if (auto err = checkInstructions())
      return err;
    if (auto err = checkCompleteness())
      return err;
    if (auto err = checkDependencies())
      return err;
    if (auto err = checkMatching())
      return err;
    if (auto err = checkDeadlock())
      return err;
    return checkCollectives();
  }

private:
  const Plan &plan;
  VerifyOptions options;
  KeySpace keys;
  // Position of each compute op's first and last part: (rank, step); kAbsent if none.
  std::vector<uint32_t> firstStep, lastStep;
  // For each p2p op, the step of its partner on the peer (filled by checkMatching).
  std::vector<std::vector<uint32_t>> partner;

  std::string tok(int r, size_t step) const {
    const auto &stream = plan.ranks[size_t(r)];
    return step < stream.size() ? formatToken(plan, stream[step]) : std::string("end of stream");
  }

  template <typename... Args>
  llvm::Error failAt(int r, size_t step, fmt::format_string<Args...> f, Args &&...args) const {
    std::string what = fmt::format(f, std::forward<Args>(args)...);
    return finding("rank {} step {} ({}): {}\n{}", r, step, tok(r, step), what,
                   formatGrid(plan, {GridMark{r, step}}));
  }

  /// The compute part a tp all-reduce sums.
  static Instruction partOf(const Instruction &ar) {
    Instruction i = Instruction::compute(ar.phase, ar.stage, ar.mb, ar.slice);
    i.part = ar.part;
    i.parts = ar.parts;
    return i;
  }

  static std::string describe(const TensorId &t) {
    return fmt::format("{}({},{},{})", toString(t.kind).str(), t.stage, t.mb, t.slice);
  }

  llvm::Error checkStages() {
    const ParallelConfig &pc = plan.parallel;
    if (plan.numStages() != pc.numStages())
      return finding("plan has {} stages but pp·vpp = {}", plan.numStages(), pc.numStages());
    if (plan.numRanks() != pc.pp)
      return finding("plan has {} rank streams but pp = {}", plan.numRanks(), pc.pp);
    if (int(plan.seqSlices.size()) != pc.seqSplits)
      return finding("plan has {} seq_slices but seq_splits = {}", plan.seqSlices.size(),
                     pc.seqSplits);
    for (size_t k = 0; k < plan.seqSlices.size(); ++k) {
      auto [b, e] = plan.seqSlices[k];
      int64_t expect = k == 0 ? 0 : plan.seqSlices[k - 1].second;
      if (b != expect || e <= b)
        return finding("seq_slices[{}] = [{}, {}) does not continue the previous slice at {}", k, b,
                       e, expect);
    }
    if (plan.transformer && !plan.stages.empty() && !plan.seqSlices.empty()) {
      // What a runtime builds from the plan: the whole model and the whole sequence.
      const TransformerConfig &t = *plan.transformer;
      if (plan.seqSlices.back().second != t.seqLength)
        return finding("seq_slices end at token {} but the model's seq_length is {}",
                       plan.seqSlices.back().second, t.seqLength);
      if (plan.stages.back().layerEnd != t.numLayers + 2)
        return finding("the stages hold layers [0, {}) but the transformer has {} (embedding, "
                       "{} blocks, head)",
                       plan.stages.back().layerEnd, t.numLayers + 2, t.numLayers);
    }
    for (const StageInfo &s : plan.stages) {
      int want = rankOfStage(plan.placement, s.stage, pc.pp);
      if (s.rank != want)
        return finding("stage {} is on rank {} but {} placement puts it on rank {}", s.stage,
                       s.rank, toString(plan.placement).str(), want);
      int expectBegin = s.stage == 0 ? 0 : plan.stages[size_t(s.stage - 1)].layerEnd;
      if (s.layerBegin != expectBegin || s.layerEnd <= s.layerBegin)
        return finding("stage {} holds layers [{}, {}); stages must hold contiguous, non-empty "
                       "layer ranges starting where the previous one ends ({})",
                       s.stage, s.layerBegin, s.layerEnd, expectBegin);
      size_t k = size_t(pc.seqSplits);
      if (s.forward.size() != k || s.backwardInput.size() != k || s.backwardWeight.size() != k ||
          s.activationBytes.size() != k || s.weightGradBytes.size() != k ||
          s.outputBytes.size() != k || s.activationTransferTime.size() != k ||
          s.gradientTransferTime.size() != k || s.tpAllReduceTime.size() != k ||
          (!s.fusedBackwardPeakBytes.empty() && s.fusedBackwardPeakBytes.size() != k))
        return finding("stage {}: per-slice arrays must have seq_splits = {} entries", s.stage, k);
      if (plan.transformer && pc.tp > 1) {
        // The kernels reduce once per embedding and head and twice per block.
        int head = int(plan.transformer->numLayers) + 1, parts = 0;
        for (int l = s.layerBegin; l < s.layerEnd; ++l)
          parts += l == 0 || l == head ? 1 : 2;
        if (s.tpAllReduces != parts)
          return finding("stage {} has tp_allreduces {} but its layers [{}, {}) have {} "
                         "tensor-parallel reduction points",
                         s.stage, s.tpAllReduces, s.layerBegin, s.layerEnd, parts);
      }
    }
    return llvm::Error::success();
  }

  llvm::Error checkInstructions() {
    const ParallelConfig &pc = plan.parallel;
    int numStages = plan.numStages();
    for (int r = 0; r < plan.numRanks(); ++r) {
      const auto &stream = plan.ranks[size_t(r)];
      for (size_t n = 0; n < stream.size(); ++n) {
        const Instruction &i = stream[n];
        if (i.op == OpKind::OptimizerStep)
          continue;
        if (i.stage < 0 || i.stage >= numStages)
          return failAt(r, n, "stage outside 0..{}", numStages - 1);
        bool needsMb = i.isCompute() || i.isP2P() ||
                       (i.op == OpKind::AllReduce && i.collective == CollectiveGroup::Tp);
        if (needsMb &&
            (i.mb < 0 || i.mb >= pc.microbatches || i.slice < 0 || i.slice >= pc.seqSplits))
          return failAt(r, n, "microbatch or slice out of range");
        if (i.isCompute()) {
          if (plan.rankOf(i.stage) != r)
            return failAt(r, n, "stage {} lives on rank {}, not here", i.stage,
                          plan.rankOf(i.stage));
          if (i.part >= 0) {
            int want = plan.stages[size_t(i.stage)].tpAllReduces;
            if (pc.tp == 1 || i.op == OpKind::BackwardWeight)
              return failAt(r, n,
                            "only forward and input-gradient ops are split into parts, "
                            "and only with tp > 1");
            if (i.parts != want || i.part >= i.parts)
              return failAt(r, n, "stage {} has {} tp parts, got part {} of {}", i.stage, want,
                            i.part, i.parts);
          }
          continue;
        }
        if (i.isP2P()) {
          int consumer = consumerStage(i.tensor, i.stage);
          if (consumer < 0 || consumer >= numStages)
            return failAt(r, n, "stage {} has no {} consumer", i.stage, toString(i.tensor).str());
          int producerRank = plan.rankOf(i.stage), consumerRank = plan.rankOf(consumer);
          int self = i.op == OpKind::Send ? producerRank : consumerRank;
          int peer = i.op == OpKind::Send ? consumerRank : producerRank;
          if (self != r)
            return failAt(r, n, "this {} belongs on rank {}", toString(i.op).str(), self);
          if (producerRank == consumerRank)
            return failAt(r, n,
                          "stages {} and {} are both on rank {}: no send/recv between "
                          "stages of one rank",
                          i.stage, consumer, r);
          if (i.peer != peer)
            return failAt(r, n, "peer is {} but the {} of stage {} lives on rank {}", i.peer,
                          i.op == OpKind::Send ? "consumer" : "producer",
                          i.op == OpKind::Send ? consumer : i.stage, peer);
          int64_t bytes = tensorBytes(plan, i.tensor, i.stage, i.slice);
          if (i.bytes != bytes)
            return failAt(r, n, "carries {} bytes but the tensor has {}", i.bytes, bytes);
          continue;
        }
        // AllReduce.
        if (plan.rankOf(i.stage) != r)
          return failAt(r, n, "all-reduce of stage {} belongs on rank {}", i.stage,
                        plan.rankOf(i.stage));
        if (i.collective == CollectiveGroup::Tp) {
          if (pc.tp == 1)
            return failAt(r, n, "tp all-reduce in a plan with tp = 1");
          if (i.mb < 0 || i.mb >= pc.microbatches || i.slice < 0 || i.slice >= pc.seqSplits)
            return failAt(r, n, "microbatch or slice out of range");
          if (i.part < 0 || i.parts != plan.stages[size_t(i.stage)].tpAllReduces ||
              i.part >= i.parts)
            return failAt(r, n, "tp all-reduce names part {} of {} but stage {} has {} parts",
                          i.part, i.parts, i.stage, plan.stages[size_t(i.stage)].tpAllReduces);
          if (i.phase != OpKind::Forward && i.phase != OpKind::BackwardInput &&
              i.phase != OpKind::Backward)
            return failAt(r, n,
                          "tp all-reduce of a {} op: only forward, backward_input and fused "
                          "backward ops have tp reductions",
                          toString(i.phase).str());
          // Exactly one reduction per part: right after the part it sums (the check below in
          // checkCompleteness asks the converse), so an extra or misplaced copy is refused
          // rather than summing a buffer that no longer holds that part's output.
          const Instruction *prev = n > 0 ? &stream[n - 1] : nullptr;
          if (!prev || prev->op != i.phase || prev->stage != i.stage || prev->mb != i.mb ||
              prev->slice != i.slice || prev->part != i.part || prev->parts != i.parts)
            return failAt(r, n,
                          "a tp all-reduce must come right after the part it reduces ({}); "
                          "every part has exactly one",
                          formatToken(plan, partOf(i)));
          int64_t want = plan.tpAllReduceBytes(i.stage, i.slice, i.phase, i.part);
          if (i.bytes != want)
            return failAt(r, n, "carries {} bytes but this reduction sums {}", i.bytes, want);
        } else if (i.collective == CollectiveGroup::Dp && pc.gradReduceRanks() == 1) {
          return failAt(r, n, "dp all-reduce in a plan with dp = 1");
        } else if (i.collective == CollectiveGroup::Embedding) {
          int last = numStages - 1;
          if (!plan.tiedEmbeddings())
            return failAt(r, n,
                          "embedding all-reduce in a plan without tied embeddings across "
                          "stages");
          if (i.stage != 0 && i.stage != last)
            return failAt(r, n,
                          "embedding all-reduce of stage {}: only the first (0) and last "
                          "({}) stage hold embedding copies",
                          i.stage, last);
          if (i.bytes != plan.tiedEmbeddingBytes())
            return failAt(r, n, "carries {} bytes but the tied embedding has {}", i.bytes,
                          plan.tiedEmbeddingBytes());
        }
      }
    }
    return llvm::Error::success();
  }

  /// Parts of a compute op expected: 0 means unsplit.
  int expectedParts(const Instruction &i) const {
    // Compute is split at tp reductions by the collectives lowering.
    if (plan.parallel.tp == 1 || i.op == OpKind::BackwardWeight || !options.requireCollectives)
      return 0;
    return plan.stages[size_t(i.stage)].tpAllReduces;
  }

  llvm::Error checkCompleteness() {
    // Record positions; a second occurrence is an error.
    firstStep.assign(keys.size(), kAbsent);
    lastStep.assign(keys.size(), kAbsent);
    std::vector<uint32_t> nextPart(keys.size(), 0);
    std::vector<int32_t> rankOfKey(keys.size(), -1);
    std::vector<uint8_t> fused(keys.size() / kNumSlots, 0), split(keys.size() / kNumSlots, 0);
    bool tp = plan.parallel.tp > 1;
    for (int r = 0; r < plan.numRanks(); ++r) {
      const auto &stream = plan.ranks[size_t(r)];
      for (size_t n = 0; n < stream.size(); ++n) {
        const Instruction &i = stream[n];
        if (!i.isCompute())
          continue;
        size_t key = keys.key(i);
        size_t op = key / kNumSlots;
        if (i.op == OpKind::Backward)
          fused[op] = 1;
        else if (i.op != OpKind::Forward)
          split[op] = 1;
        if (fused[op] && split[op])
          return failAt(r, n,
                        "mixes a fused backward with backward_input/backward_weight for "
                        "the same (stage, mb, slice)");
        int want = expectedParts(i);
        int part = std::max(i.part, 0);
        if (want > 0 && i.part < 0)
          return failAt(r, n, "with tp > 1 this op must be split into {} parts", want);
        if (want == 0 && i.part >= 0)
          return failAt(r, n, "this op must not be split into parts");
        if (uint32_t(part) != nextPart[key]) {
          if (uint32_t(part) < nextPart[key])
            return failAt(r, n, "appears twice");
          return failAt(r, n, "parts out of order (expected part {})", nextPart[key]);
        }
        if (part == 0)
          firstStep[key] = uint32_t(n);
        if (i.isLastPart())
          lastStep[key] = uint32_t(n);
        nextPart[key] = uint32_t(part + 1);
        rankOfKey[key] = r;
        if (i.op == OpKind::Backward && i.isLastPart()) {
          if (firstStep[key + 1] != kAbsent)
            return failAt(r, n, "fused backward of an op that also has a backward_weight");
          firstStep[key + 1] = firstStep[key];
          lastStep[key + 1] = lastStep[key];
          nextPart[key + 1] = 1;
        }
        // A tp part must be followed directly by its all-reduce: the part's output is only
        // whole (and usable by a send or the next part) once it is reduced.
        if (tp && want > 0) {
          size_t m = n + 1;
          const Instruction *ar = m < stream.size() ? &stream[m] : nullptr;
          OpKind phase = i.op;
          if (!ar || ar->op != OpKind::AllReduce || ar->collective != CollectiveGroup::Tp ||
              ar->stage != i.stage || ar->mb != i.mb || ar->slice != i.slice ||
              ar->part != i.part || ar->phase != phase)
            return failAt(r, n, "tp part must be followed directly by its tp all-reduce");
        }
      }
    }
    // Every op present once and whole.
    for (int s = 0; s < plan.numStages(); ++s)
      for (int m = 0; m < plan.parallel.microbatches; ++m)
        for (int k = 0; k < plan.parallel.seqSplits; ++k) {
          for (Slot slot : {Slot::F, Slot::B, Slot::W}) {
            size_t key = keys.key(s, m, k, slot);
            Instruction want = Instruction::compute(slot == Slot::F   ? OpKind::Forward
                                                    : slot == Slot::B ? OpKind::Backward
                                                                      : OpKind::BackwardWeight,
                                                    s, m, k);
            if (firstStep[key] == kAbsent || lastStep[key] == kAbsent) {
              int r = plan.rankOf(s);
              return finding("rank {}: {} is missing (every stage, microbatch and slice needs "
                             "one forward and one backward){}\n{}",
                             r, formatToken(plan, want),
                             slot == Slot::W ? " (a backward_weight, or a fused B)" : "",
                             formatGrid(plan, {GridMark{r, plan.ranks[size_t(r)].size()}}));
            }
          }
        }
    return llvm::Error::success();
  }

  /// Index of p2p ops by tensor: step of the send on the producer rank and of the recv on the
  /// consumer rank.
  std::vector<uint32_t> sendStep, recvStep;

  size_t tensorIndex(const TensorId &t) const {
    return keys.key(t.stage, t.mb, t.slice, t.kind == TensorKind::Activation ? Slot::F : Slot::B);
  }

  llvm::Error checkDependencies() {
    sendStep.assign(keys.size(), kAbsent);
    recvStep.assign(keys.size(), kAbsent);
    for (int r = 0; r < plan.numRanks(); ++r) {
      const auto &stream = plan.ranks[size_t(r)];
      for (size_t n = 0; n < stream.size(); ++n) {
        const Instruction &i = stream[n];
        if (!i.isP2P())
          continue;
        TensorId t{i.stage, i.mb, i.slice, i.tensor};
        auto &steps = i.op == OpKind::Send ? sendStep : recvStep;
        size_t idx = tensorIndex(t);
        if (steps[idx] != kAbsent)
          return failAt(r, n, "{} of {} appears twice (first at step {})", toString(i.op).str(),
                        describe(t), steps[idx]);
        steps[idx] = uint32_t(n);
        if (i.op == OpKind::Send) {
          // The producer (its last part) must come first on this rank.
          size_t producer = idx; // slot F for activations, B for gradients
          if (lastStep[producer] == kAbsent || lastStep[producer] > n)
            return failAt(r, n, "sends {} before its producer {} has run", describe(t),
                          formatToken(plan, Instruction::compute(i.tensor == TensorKind::Activation
                                                                     ? OpKind::Forward
                                                                     : OpKind::BackwardInput,
                                                                 i.stage, i.mb, i.slice)));
        }
      }
    }
    for (int r = 0; r < plan.numRanks(); ++r) {
      const auto &stream = plan.ranks[size_t(r)];
      for (size_t n = 0; n < stream.size(); ++n) {
        const Instruction &i = stream[n];
        if (!i.isCompute() || !i.isFirstPart())
          continue;
        llvm::Error err = llvm::Error::success();
        forEachInput(plan, i, [&](const Input &in) {
          if (err)
            return;
          size_t key = keys.key(in.stage, in.mb, in.slice, in.slot);
          int producerRank = plan.rankOf(in.stage);
          std::string need =
              formatToken(plan, Instruction::compute(in.slot == Slot::F   ? OpKind::Forward
                                                     : in.slot == Slot::B ? OpKind::BackwardInput
                                                                          : OpKind::BackwardWeight,
                                                     in.stage, in.mb, in.slice));
          if (producerRank == r) {
            if (lastStep[key] >= n)
              err = failAt(r, n, "runs before its input {} (later on this rank)", need);
            return;
          }
          if (!options.requireComms)
            return;
          TensorId t{in.stage, in.mb, in.slice, in.tensor};
          size_t idx = tensorIndex(t);
          if (recvStep[idx] == kAbsent)
            err = failAt(r, n, "needs {} from rank {} but no recv of it precedes it", describe(t),
                         producerRank);
          else if (recvStep[idx] > n)
            err = failAt(r, n, "needs {} from rank {} but its recv comes later (step {})",
                         describe(t), producerRank, recvStep[idx]);
          else if (sendStep[idx] == kAbsent)
            err = failAt(producerRank, plan.ranks[size_t(producerRank)].size(),
                         "never sends {} that rank {} receives at step {}", describe(t), r,
                         recvStep[idx]);
        });
        if (err)
          return err;
      }
    }
    // A send nobody receives.
    for (size_t idx = 0; idx < sendStep.size(); ++idx) {
      if (sendStep[idx] == kAbsent || recvStep[idx] != kAbsent)
        continue;
      size_t rest = idx / kNumSlots;
      int s = int(rest / keys.numSlices / keys.numMb);
      int r = plan.rankOf(s);
      const Instruction &i = plan.ranks[size_t(r)][sendStep[idx]];
      return failAt(r, sendStep[idx], "rank {} never receives this tensor (a missing recv)",
                    i.peer);
    }
    return llvm::Error::success();
  }

  llvm::Error checkMatching() {
    // Per ordered pair (a -> b): the sequence of tensors a sends and b receives must agree.
    size_t p = size_t(plan.numRanks());
    // Lists only for the pairs that talk (a sparse map, not p^2 vectors).
    llvm::DenseMap<uint64_t, std::vector<uint32_t>> sends, recvs;
    std::vector<uint64_t> pairs;
    for (size_t r = 0; r < p; ++r) {
      const auto &stream = plan.ranks[r];
      for (size_t n = 0; n < stream.size(); ++n) {
        const Instruction &i = stream[n];
        if (!i.isP2P())
          continue;
        bool send = i.op == OpKind::Send;
        uint64_t pair = send ? uint64_t(r) * p + uint64_t(i.peer) : uint64_t(i.peer) * p + r;
        pairs.push_back(pair);
        (send ? sends : recvs)[pair].push_back(uint32_t(n));
      }
    }
    std::sort(pairs.begin(), pairs.end());
    pairs.erase(std::unique(pairs.begin(), pairs.end()), pairs.end());
    const std::vector<uint32_t> none;
    partner.assign(p, {});
    for (size_t r = 0; r < p; ++r)
      partner[r].assign(plan.ranks[r].size(), kAbsent);
    for (uint64_t pair : pairs) {
      size_t a = size_t(pair / p), b = size_t(pair % p);
      auto si = sends.find(pair), ri = recvs.find(pair);
      const auto &ss = si == sends.end() ? none : si->second;
      const auto &rs = ri == recvs.end() ? none : ri->second;
      size_t n = std::min(ss.size(), rs.size());
      for (size_t i = 0; i < n; ++i) {
        const Instruction &s = plan.ranks[a][ss[i]], &rv = plan.ranks[b][rs[i]];
        if (s.tensor != rv.tensor || s.stage != rv.stage || s.mb != rv.mb || s.slice != rv.slice ||
            s.bytes != rv.bytes) {
          TensorId st{s.stage, s.mb, s.slice, s.tensor}, rt{rv.stage, rv.mb, rv.slice, rv.tensor};
          return finding("FIFO mismatch between rank {} and rank {}: message {} is {} on the "
                         "sender (rank {} step {}: {}) but {} on the receiver (rank {} step {}: "
                         "{}); NCCL matches sends and recvs of a rank pair in order, so the "
                         "tensors would be swapped\n{}",
                         a, b, i, describe(st), a, ss[i], tok(int(a), ss[i]), describe(rt), b,
                         rs[i], tok(int(b), rs[i]),
                         formatGrid(plan, {GridMark{int(a), ss[i]}, GridMark{int(b), rs[i]}}));
        }
        partner[a][ss[i]] = rs[i];
        partner[b][rs[i]] = ss[i];
      }
      if (ss.size() != rs.size()) {
        bool moreSends = ss.size() > rs.size();
        size_t r = moreSends ? a : b;
        uint32_t step = moreSends ? ss[n] : rs[n];
        return failAt(int(r), step,
                      "rank {} sends {} messages to rank {} but rank {} posts {} "
                      "recvs from it",
                      a, ss.size(), b, b, rs.size());
      }
    }
    return llvm::Error::success();
  }

  llvm::Error checkDeadlock() {
    // Execute the comm ops of all ranks under NCCL's rules. postedFrom[r] .. postedTo[r] is the
    // group rank r has posted and waits on (compute and collectives never block here: the
    // collectives of a group run the same stream on every member).
    size_t p = size_t(plan.numRanks());
    std::vector<size_t> from(p, 0), to(p, 0);
    std::vector<bool> atEnd(p, false);
    auto groupEnd = [&](size_t r, size_t n) {
      const auto &stream = plan.ranks[r];
      int32_t g = stream[n].group;
      size_t e = n + 1;
      if (g == kNoGroup)
        return e;
      while (e < stream.size() && stream[e].isP2P() && stream[e].group == g)
        ++e;
      return e;
    };
    // Advance rank r to its next p2p op and post the group there.
    auto advance = [&](size_t r, size_t n) {
      const auto &stream = plan.ranks[r];
      while (n < stream.size() && !stream[n].isP2P())
        ++n;
      from[r] = n;
      if (n == stream.size()) {
        atEnd[r] = true;
        to[r] = n;
        return;
      }
      to[r] = groupEnd(r, n);
    };
    // The partner of op n on rank r is posted once the peer has reached its group.
    auto matched = [&](size_t r, size_t n) {
      size_t peer = size_t(plan.ranks[r][n].peer);
      return partner[r][n] < to[peer];
    };
    for (size_t r = 0; r < p; ++r)
      advance(r, 0);
    bool progress = true;
    while (progress) {
      progress = false;
      for (size_t r = 0; r < p; ++r) {
        while (!atEnd[r]) {
          bool all = true;
          for (size_t n = from[r]; n < to[r] && all; ++n)
            all = matched(r, n);
          if (!all)
            break;
          advance(r, to[r]);
          progress = true;
        }
      }
    }
    std::vector<size_t> stuck;
    for (size_t r = 0; r < p; ++r)
      if (!atEnd[r])
        stuck.push_back(r);
    if (stuck.empty())
      return llvm::Error::success();
    // Each stuck rank waits for the peer of its first unmatched op: follow to a cycle.
    std::vector<size_t> waitsFor(p, SIZE_MAX), waitStep(p, 0);
    for (size_t r : stuck)
      for (size_t n = from[r]; n < to[r]; ++n)
        if (!matched(r, n)) {
          waitsFor[r] = size_t(plan.ranks[r][n].peer);
          waitStep[r] = n;
          break;
        }
    std::vector<int> seenAt(p, -1);
    llvm::SmallVector<size_t, 8> path;
    size_t cur = stuck.front();
    while (cur != SIZE_MAX && seenAt[cur] < 0) {
      seenAt[cur] = int(path.size());
      path.push_back(cur);
      cur = waitsFor[cur];
    }
    std::string cycle, detail;
    if (cur != SIZE_MAX) {
      for (size_t i = size_t(seenAt[cur]); i < path.size(); ++i)
        cycle += fmt::format("rank {} -> ", path[i]);
      cycle += fmt::format("rank {}", cur);
    }
    std::vector<GridMark> marks;
    for (size_t r : stuck) {
      size_t n = waitStep[r], peer = waitsFor[r];
      detail += fmt::format("\n  rank {} is stuck at step {} ({}){}: waits for rank {} to post "
                            "step {} ({})",
                            r, n, tok(int(r), n),
                            to[r] - from[r] > 1 ? fmt::format(" in a group of {}", to[r] - from[r])
                                                : std::string(" ungrouped"),
                            peer, partner[r][n], tok(int(peer), partner[r][n]));
      marks.push_back(GridMark{int(r), n});
    }
    return finding("deadlock under NCCL's blocking rules: {} rank(s) cannot finish; cycle: {}{}\n"
                   "group the ops that must be posted together (the same integer \"group\"), or "
                   "reorder them\n{}",
                   stuck.size(), cycle.empty() ? std::string("none") : cycle, detail,
                   formatGrid(plan, marks));
  }

  llvm::Error checkCollectives() {
    const ParallelConfig &pc = plan.parallel;
    for (int r = 0; r < plan.numRanks(); ++r) {
      const auto &stream = plan.ranks[size_t(r)];
      // Stages of this rank, and the step of each one's last weight-gradient op.
      llvm::SmallDenseMap<int, size_t, 8> lastWeightGrad;
      llvm::SmallDenseMap<int, size_t, 8> dpStep;
      for (size_t n = 0; n < stream.size(); ++n) {
        const Instruction &i = stream[n];
        if ((i.op == OpKind::BackwardWeight || i.op == OpKind::Backward) && i.isLastPart())
          lastWeightGrad[i.stage] = n;
      }
      llvm::SmallDenseMap<int, size_t, 2> embStep;
      size_t optimizer = kAbsent;
      size_t lastAllReduce = 0;
      bool anyAllReduce = false;
      for (size_t n = 0; n < stream.size(); ++n) {
        const Instruction &i = stream[n];
        if (i.op == OpKind::OptimizerStep) {
          if (optimizer != kAbsent)
            return failAt(r, n, "second optimizer step (first at step {})", optimizer);
          optimizer = n;
          continue;
        }
        if (i.op != OpKind::AllReduce || i.collective == CollectiveGroup::Tp)
          continue;
        anyAllReduce = true;
        lastAllReduce = n;
        if (i.collective == CollectiveGroup::Embedding) {
          if (embStep.count(i.stage))
            return failAt(r, n, "second embedding all-reduce of stage {}", i.stage);
          embStep[i.stage] = n;
          auto it = lastWeightGrad.find(i.stage);
          if (it != lastWeightGrad.end() && it->second > n)
            return failAt(r, n,
                          "all-reduces stage {}'s embedding gradients before its last "
                          "weight gradient (step {})",
                          i.stage, it->second);
          for (size_t m = n + 1; m < stream.size(); ++m)
            if (stream[m].isP2P())
              return failAt(r, n,
                            "embedding all-reduce before a send/recv (step {}): the two "
                            "ranks could wait for each other across communicators",
                            m);
        }
        if (i.collective == CollectiveGroup::Dp) {
          if (dpStep.count(i.stage))
            return failAt(r, n, "second dp all-reduce of stage {}", i.stage);
          dpStep[i.stage] = n;
          auto it = lastWeightGrad.find(i.stage);
          if (it != lastWeightGrad.end() && it->second > n)
            return failAt(r, n,
                          "all-reduces stage {}'s gradients before its last weight "
                          "gradient (step {})",
                          i.stage, it->second);
          if (i.bytes != plan.stages[size_t(i.stage)].paramBytes)
            return failAt(r, n, "carries {} bytes but stage {} has {} bytes of gradients", i.bytes,
                          i.stage, plan.stages[size_t(i.stage)].paramBytes);
        }
      }
      if (optimizer != kAbsent) {
        if (anyAllReduce && lastAllReduce > optimizer)
          return failAt(r, optimizer, "optimizer step before the all-reduce at step {}",
                        lastAllReduce);
        for (auto [stage, n] : lastWeightGrad)
          if (n > optimizer)
            return failAt(r, optimizer,
                          "optimizer step before stage {}'s last weight gradient "
                          "(step {})",
                          stage, n);
      }
      if (!options.requireCollectives)
        continue;
      if (optimizer == kAbsent)
        return failAt(r, stream.size(), "no optimizer step at the end of the stream");
      if (plan.tiedEmbeddings())
        for (int s : {0, plan.numStages() - 1})
          if (plan.rankOf(s) == r && !embStep.count(s))
            return failAt(r, optimizer,
                          "embeddings are tied but stage {}'s copy is never "
                          "all-reduced with the other",
                          s);
      if (pc.gradReduceRanks() > 1)
        for (const StageInfo &s : plan.stages)
          if (s.rank == r && !dpStep.count(s.stage))
            return failAt(r, optimizer,
                          "dp x cp = {} but stage {}'s gradients are never "
                          "all-reduced",
                          pc.gradReduceRanks(), s.stage);
    }
    return llvm::Error::success();
  }
};

} // namespace

llvm::Error verifyPlan(const Plan &plan, const VerifyOptions &options) {
  return Verifier(plan, options).run();
}

} // namespace pipec
