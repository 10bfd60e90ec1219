//===- Partition.cpp - Layers into stages, exactly ------------------------===//
//
// Establishes: P·V stages, each a contiguous non-empty layer range, placed on ranks by the
// plan's placement (its policy's, set by the caller that resolved the policy), with per-slice
// costs, bytes and transfer times filled in.
// The split minimises the largest stage time (F + B + W of its layers over the whole sequence)
// exactly, by dynamic programming over prefix sums (the classic linear-partition recurrence);
// among the splits that reach that optimum it takes the one with the least sum of squared stage
// times (the most even), again exactly, so uniform models split as evenly as integers allow.
//
//===----------------------------------------------------------------------===//
#include "compiler/Partition.h"

#include "compiler/Pass.h"
#include "ir/support/Error.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace pipec {

std::vector<int> exactPartition(llvm::ArrayRef<double> cost, int parts) {
  size_t n = cost.size();
  std::vector<double> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i)
    prefix[i + 1] = prefix[i] + cost[i];
  auto range = [&](size_t a, size_t b) { return prefix[b] - prefix[a]; };
  const double inf = std::numeric_limits<double>::infinity();
  // best[s][l]: least possible max stage time for the first l layers in s stages.
  std::vector<std::vector<double>> best(size_t(parts) + 1, std::vector<double>(n + 1, inf));
  best[0][0] = 0;
  for (size_t s = 1; s <= size_t(parts); ++s)
    for (size_t l = s; l + (size_t(parts) - s) <= n; ++l)
      for (size_t j = s - 1; j < l; ++j)
        best[s][l] = std::min(best[s][l], std::max(best[s - 1][j], range(j, l)));
  double limit = best[size_t(parts)][n];
  double slack = limit * 1e-12 + 1e-300;
  // Among splits with every stage <= limit: least sum of squares, earliest cut on ties.
  std::vector<std::vector<double>> sq(size_t(parts) + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<size_t>> cut(size_t(parts) + 1, std::vector<size_t>(n + 1, 0));
  sq[0][0] = 0;
  for (size_t s = 1; s <= size_t(parts); ++s)
    for (size_t l = s; l + (size_t(parts) - s) <= n; ++l)
      for (size_t j = s - 1; j < l; ++j) {
        double c = range(j, l);
        if (c > limit + slack || sq[s - 1][j] == inf)
          continue;
        // (In units of the limit: a square of times near the largest double would overflow.)
        const double x = limit > 0 ? c / limit : c;
        double v = sq[s - 1][j] + x * x;
        if (v < sq[s][l] * (1 - 1e-12) || sq[s][l] == inf) {
          sq[s][l] = v;
          cut[s][l] = j;
        }
      }
  std::vector<int> ends(static_cast<size_t>(parts));
  size_t l = n;
  for (size_t s = size_t(parts); s >= 1; --s) {
    ends[s - 1] = int(l);
    l = cut[s][l];
  }
  return ends;
}

std::vector<double> layerTimes(const ModelSpec &model, const ClusterSpec &cluster, int64_t seq,
                               int tp, int cp) {
  std::vector<double> whole(model.layers.size());
  for (size_t l = 0; l < model.layers.size(); ++l) {
    SliceCost c = model.sliceCost(cluster, l, 0, seq, 0, 1, tp, false, cp);
    whole[l] = c.forward + c.backwardInput + c.backwardWeight;
  }
  return whole;
}

llvm::Error checkLayerTimesAddUp(const ModelSpec &model, llvm::ArrayRef<double> times) {
  double total = 0;
  for (size_t l = 0; l < times.size(); ++l) {
    total += times[l];
    if (!std::isfinite(total))
      return inputError("layer {} (\"{}\") brings the model's time to {} ms, past what pipec "
                        "can add up: the --cluster's rates are too small for this model (raise "
                        "$.device.memory_GBps or peak_tflops)",
                        l, model.layers[l].name, total);
  }
  return llvm::Error::success();
}

namespace {

/// Which link joins two pipeline ranks (Megatron's tp-cp-dp-pp order of global ranks).
const Link &linkBetween(const ClusterSpec &c, const ParallelConfig &pc, int a, int b) {
  int64_t stride = int64_t(pc.dp) * pc.tp * pc.cp;
  bool sameNode = (int64_t(a) * stride) / c.gpusPerNode == (int64_t(b) * stride) / c.gpusPerNode;
  return sameNode ? c.intraNode : c.interNode;
}

/// Ring all-reduce over n members: 2(n-1)/n of the bytes cross each link. A reduce-scatter
/// followed by an all-gather (sequence parallelism, the distributed optimizer) moves the same
/// bytes in two messages.
double allReduceMs(const ClusterSpec &c, const Link &l, double bytes, int n, int messages = 1) {
  if (n <= 1)
    return 0;
  return messages * c.messageMs(l) + 2.0 * (n - 1) / n * bytes / l.bytesPerMs();
}

/// A ring reduce-scatter (or all-gather) of `bytes` over n ranks: half an all-reduce's traffic.
static double reduceScatterMs(const ClusterSpec &c, const Link &l, double bytes, int n) {
  if (n <= 1)
    return 0;
  return c.messageMs(l) + (n - 1.0) / n * bytes / l.bytesPerMs();
}

/// Bytes an Adam step reads and writes per parameter in mixed precision: the fp32 gradient
/// (read twice: the norm, then the step), master weight, first and second moments (read and
/// written), the bf16 weight written back.
constexpr double kAdamBytesPerParam = 4 + 4 + 8 + 8 + 8 + 2;

int blocksOf(const ModelSpec &model, const StageInfo &st) {
  int n = 0;
  for (int l = st.layerBegin; l < st.layerEnd; ++l)
    n += model.layers[size_t(l)].kind == LayerKind::Block;
  return n;
}

void fillTransferTimes(Plan &plan, const ModelSpec &model, const ClusterSpec &cluster) {
  const ParallelConfig &pc = plan.parallel;
  size_t k = size_t(pc.seqSplits);
  int numStages = plan.numStages();
  const Link &tpLink = cluster.groupLink(1, pc.tp);
  // The gradients reduce over the dp replicas and, with context parallelism, the cp ranks that
  // share each sequence: dp·cp ranks tp apart.
  const int dpGroup = pc.gradReduceRanks();
  const Link &dpLink = cluster.groupLink(pc.tp, dpGroup);
  int tpMessages = pc.sequenceParallel ? 2 : 1, dpMessages = pc.distributedOptimizer ? 2 : 1;
  for (int s = 0; s < numStages; ++s) {
    StageInfo &st = plan.stages[size_t(s)];
    st.activationTransferTime.assign(k, 0);
    st.gradientTransferTime.assign(k, 0);
    st.tpAllReduceTime.assign(k, 0);
    // Megatron-LM's transfers (Narayanan et al. 2021, section 4.1): without sequence
    // parallelism every tp rank holds the whole activation, sends 1/tp of it on its own link
    // and the receiving tp ranks all-gather the rest.
    bool scatter = cluster.synchronousP2p() && pc.tp > 1 && !pc.sequenceParallel;
    // Megatron-LM synchronises the device after each batch of transfers (batch_p2p_sync).
    double sync = cluster.p2p == P2p::Megatron ? cluster.p2pSyncUs / 1000.0 : 0.0;
    auto p2pMs = [&](int to, double bytes) {
      const Link &link = linkBetween(cluster, pc, st.rank, to);
      if (!scatter)
        return sync + cluster.transferMs(link, bytes);
      double gather =
          cluster.messageMs(tpLink) + (pc.tp - 1.0) / pc.tp * bytes / tpLink.bytesPerMs();
      return sync + cluster.transferMs(link, bytes / pc.tp) + gather;
    };
    for (size_t i = 0; i < k; ++i) {
      if (s + 1 < numStages && plan.rankOf(s + 1) != st.rank)
        st.activationTransferTime[i] = model.isTransformer()
                                           ? p2pMs(plan.rankOf(s + 1), double(st.outputBytes[i]))
                                           : model.p2pTime;
      if (s > 0 && plan.rankOf(s - 1) != st.rank)
        st.gradientTransferTime[i] =
            model.isTransformer()
                ? p2pMs(plan.rankOf(s - 1), double(plan.stages[size_t(s - 1)].outputBytes[i]))
                : model.p2pTime;
      if (pc.tp > 1 && st.tpAllReduces > 0) {
        if (model.isTransformer()) {
          const TransformerConfig &t = *model.transformer;
          auto [b, e] = plan.seqSlices[i];
          double hidden = double(t.microbatchSize) * double(e - b) / pc.cp * double(t.hiddenSize) *
                          double(t.dtypeBytes());
          st.tpAllReduceTime[i] = allReduceMs(cluster, tpLink, hidden, pc.tp, tpMessages);
          // Full recomputation repeats each block's forward, and its two reductions, in the
          // input-gradient backward.
          if (t.recompute == Recompute::Full)
            st.backwardInput[i] += 2 * blocksOf(model, st) * st.tpAllReduceTime[i];
        } else {
          st.tpAllReduceTime[i] = model.allReduceTime;
        }
      }
      // Megatron-LM's send is synchronous: it holds the sender until the receiver has the
      // tensor, so the transfer is part of the op that produced it and the receiver can start
      // when that op ends.
      if (cluster.synchronousP2p() && model.isTransformer()) {
        st.forward[i] += st.activationTransferTime[i];
        st.backwardInput[i] += st.gradientTransferTime[i];
        st.activationTransferTime[i] = st.gradientTransferTime[i] = 0;
      }
    }
    // ZeRO-1 reduce-scatters the gradients and all-gathers the updated parameters; with the
    // all-gather overlapped with the next step's forward only the reduce-scatter is exposed.
    if (dpGroup > 1)
      st.dpAllReduceTime =
          !model.isTransformer() ? model.allReduceTime
          : pc.distributedOptimizer && cluster.overlapParamGather
              ? reduceScatterMs(cluster, dpLink, double(st.paramBytes), dpGroup)
              : allReduceMs(cluster, dpLink, double(st.paramBytes), dpGroup, dpMessages);
    // The optimizer step: memory-bound, over the rank's share of the stage's parameters.
    st.optimizerTime = 0;
    if (model.isTransformer() && cluster.memoryBytesPerMs() > 0) {
      double params = double(st.paramBytes) / double(model.transformer->dtypeBytes());
      double shards = pc.distributedOptimizer ? double(pc.gradReduceRanks()) : 1.0;
      st.optimizerTime = params * kAdamBytesPerParam / shards / cluster.memoryBytesPerMs();
    }
  }
  // Before the step, the gradient norm and the finite check: two scalar all-reduces over the
  // pipeline ranks (across nodes once the pipeline leaves one).
  plan.optimizerSyncTime = 0;
  plan.overlapGradReduce = model.isTransformer() && cluster.overlapGradReduce;
  plan.blockingP2p = model.isTransformer() && cluster.p2p == P2p::Blocking;
  if (model.isTransformer() && cluster.memoryBytesPerMs() > 0 && pc.pp > 1) {
    const Link &ppLink = cluster.groupLink(int64_t(pc.tp) * pc.cp * pc.dp, pc.pp);
    plan.optimizerSyncTime = 2 * allReduceMs(cluster, ppLink, 8, pc.pp);
  }
}

double stateBytesPerParamByte(const ModelSpec &model, const ParallelConfig &pc) {
  double all = model.stateBytesPerParamByte;
  if (!pc.distributedOptimizer || pc.gradReduceRanks() <= 1)
    return all;
  // Weights and gradients stay on every dp rank (3 bytes per bf16 parameter byte, 2 in
  // fp32); master weights and Adam's moments are sharded.
  double kept = model.transformer && model.transformer->dtype == "fp32" ? 2.0 : 3.0;
  kept = std::min(kept, all);
  return kept + (all - kept) / double(pc.gradReduceRanks());
}

class PartitionPass final : public Pass {
public:
  llvm::StringRef name() const override { return "partition"; }

  llvm::Expected<bool> run(Plan &plan, PassContext &ctx) override {
    const ModelSpec &model = *ctx.model;
    const ClusterSpec &cluster = *ctx.cluster;
    const ParallelConfig &pc = plan.parallel;
    int numStages = pc.numStages();
    int numLayers = int(model.layers.size());
    if (auto err = checkStageCount(model, pc))
      return err;
    if (double(numStages) * numLayers * numLayers > 4e9)
      return inputError("the model has {} layers: too many to partition exactly into {} stages "
                        "here; merge layers with \"count\" into coarser ones",
                        numLayers, numStages);
    int64_t seq = model.sequenceLength(pc.seqSplits);
    std::vector<double> times = layerTimes(model, cluster, seq, pc.tp, pc.cp);
    if (auto err = checkLayerTimesAddUp(model, times))
      return err;
    std::vector<int> given = ctx.options.stageEnds;
    if (given.empty() && ctx.options.evenPartition) {
      auto even = evenStageEnds(model, numStages);
      if (!even) {
        const int64_t units = evenSplitUnits(model);
        return inputError("--partition even: the model's {} {} do not split evenly into {} "
                          "stages (--pp {} x --vpp {}); try --partition balanced, or a --pp and "
                          "--vpp whose product divides {}",
                          units, model.isTransformer() ? "blocks" : "layers", numStages, pc.pp,
                          pc.vpp, units);
      }
      given = *even;
    }
    if (!given.empty()) {
      bool valid = int(given.size()) == numStages && given.back() == numLayers;
      for (size_t s = 0; valid && s < given.size(); ++s)
        valid = given[s] > (s == 0 ? 0 : given[s - 1]);
      if (!valid)
        return inputError("the stage split gives {} stage ends for {} stages of {} layers; "
                          "give one increasing end per stage, the last {}",
                          given.size(), numStages, numLayers, numLayers);
      buildStages(plan, model, cluster, given);
      return true;
    }
    buildStages(plan, model, cluster, exactPartition(times, numStages));
    return true;
  }
};

} // namespace

int64_t evenSplitUnits(const ModelSpec &model) {
  // A transformer's layer list is the embedding, its blocks and the head.
  return int64_t(model.layers.size()) - (model.isTransformer() ? 2 : 0);
}

std::optional<std::vector<int>> evenStageEnds(const ModelSpec &model, int stages, bool unitsRule) {
  const int64_t layers = int64_t(model.layers.size());
  const bool transformer = model.isTransformer();
  const int64_t units = unitsRule ? layers : evenSplitUnits(model);
  if (stages < 1 || units < stages || units % stages != 0)
    return std::nullopt;
  const int64_t per = units / stages, offset = transformer && !unitsRule ? 1 : 0;
  std::vector<int> ends;
  for (int64_t s = 1; s <= stages; ++s)
    ends.push_back(int(offset + per * s));
  ends.back() = int(layers); // the head closes the last stage
  return ends;
}

std::vector<SliceCost> layerSliceCosts(const ModelSpec &model, const ClusterSpec &cluster,
                                       const ParallelConfig &pc,
                                       llvm::ArrayRef<std::pair<int64_t, int64_t>> slices) {
  const size_t k = slices.size();
  std::vector<SliceCost> costs(model.layers.size() * k);
  for (size_t l = 0; l < model.layers.size(); ++l)
    for (size_t i = 0; i < k; ++i)
      costs[l * k + i] = model.sliceCost(cluster, l, slices[i].first, slices[i].second, int(i),
                                         int(k), pc.tp, pc.sequenceParallel, pc.cp);
  return costs;
}

void buildStages(Plan &plan, const ModelSpec &model, const ClusterSpec &cluster,
                 llvm::ArrayRef<int> ends) {
  llvm::ArrayRef<std::pair<int64_t, int64_t>> slices(plan.seqSlices);
  buildStages(plan, model, cluster, ends,
              layerSliceCosts(model, cluster, plan.parallel,
                              slices.take_front(size_t(plan.parallel.seqSplits))));
}

void buildStages(Plan &plan, const ModelSpec &model, const ClusterSpec &cluster,
                 llvm::ArrayRef<int> ends, llvm::ArrayRef<SliceCost> costs) {
  const ParallelConfig &pc = plan.parallel;
  int numStages = pc.numStages();
  assert(int(ends.size()) == numStages && "one layer range end per stage");
  plan.stages.assign(size_t(numStages), StageInfo{});
  size_t k = size_t(pc.seqSplits);
  assert(costs.size() == model.layers.size() * k && "layerSliceCosts' table for the slices");
  for (int s = 0; s < numStages; ++s) {
    StageInfo &st = plan.stages[size_t(s)];
    st.stage = s;
    st.rank = rankOfStage(plan.placement, s, pc.pp);
    st.layerBegin = s == 0 ? 0 : ends[size_t(s - 1)];
    st.layerEnd = ends[size_t(s)];
    st.forward.assign(k, 0);
    st.backwardInput.assign(k, 0);
    st.backwardWeight.assign(k, 0);
    st.activationBytes.assign(k, 0);
    st.weightGradBytes.assign(k, 0);
    st.outputBytes.assign(k, 0);
    st.backwardPeakBytes.assign(k, 0);
    st.fusedBackwardPeakBytes.clear();
    if (cluster.megatronActivations && model.isTransformer())
      st.fusedBackwardPeakBytes.assign(k, 0);
    st.workspaceBytes.assign(k, 0);
    st.sequenceKvBytes.assign(k, 0);
    st.sequenceGradBytes = 0;
    for (int l = st.layerBegin; l < st.layerEnd; ++l) {
      const Layer &layer = model.layers[size_t(l)];
      st.paramBytes += layer.paramBytes / pc.tp;
      st.tpAllReduces += pc.tp > 1 ? layer.tpAllReduces : 0;
      for (size_t i = 0; i < k; ++i) {
        const SliceCost &c = costs[size_t(l) * k + i];
        st.forward[i] += c.forward;
        st.backwardInput[i] += c.backwardInput;
        st.backwardWeight[i] += c.backwardWeight;
        st.activationBytes[i] += c.activationBytes;
        st.weightGradBytes[i] += c.weightGradBytes;
        st.backwardPeakBytes[i] += c.backwardPeakBytes;
        if (!st.fusedBackwardPeakBytes.empty())
          st.fusedBackwardPeakBytes[i] =
              std::max({st.fusedBackwardPeakBytes[i], c.backwardPeakBytes,
                        c.weightGradBytes - c.activationBytes});
        st.workspaceBytes[i] = std::max(st.workspaceBytes[i], c.workspaceBytes);
        st.sequenceKvBytes[i] += c.sequenceKvBytes;
        st.sequenceGradBytes += c.sequenceGradBytes;
      }
    }
    // The variability of the stage's passes (ClusterSpec::passJitterUs), on their own times.
    if (cluster.passJitterUs > 0 && model.isTransformer())
      for (size_t i = 0; i < k; ++i)
        for (double *t : {&st.forward[i], &st.backwardInput[i], &st.backwardWeight[i]})
          *t += cluster.passJitterUs / 1000 * std::sqrt(*t);
    // The stage's residual stream: its input (or the embedding's output) from the forward to
    // the backward, then its gradient until the weight gradient.
    for (size_t i = 0; i < k; ++i) {
      auto [b, e] = plan.seqSlices[i];
      int64_t residual = model.residualBytes(b, e, (pc.sequenceParallel ? pc.tp : 1) * pc.cp);
      st.activationBytes[i] += residual;
      st.weightGradBytes[i] += residual;
    }
    // What leaves the stage is its last layer's output.
    for (size_t i = 0; i < k; ++i)
      st.outputBytes[i] = costs[size_t(st.layerEnd - 1) * k + i].outputBytes;
  }
  fillTransferTimes(plan, model, cluster);
  plan.stateBytesPerParamByte = stateBytesPerParamByte(model, pc);
}

std::unique_ptr<Pass> createPartitionPass() { return std::make_unique<PartitionPass>(); }

} // namespace pipec
