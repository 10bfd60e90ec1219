#include "runtime/cpu/Reference.h"

#include <cassert>
#include <cmath>
#include <span>

namespace pipec {

std::vector<std::vector<int32_t>> stepBatch(const DataSource &data, const kernels::GptConfig &cfg,
                                            const ParallelConfig &pc, int step, int replica) {
  std::vector<std::vector<int32_t>> out;
  for (int m = 0; m < pc.microbatches; ++m) {
    uint64_t global =
        (uint64_t(step) * uint64_t(pc.dp) + uint64_t(replica)) * uint64_t(pc.microbatches) +
        uint64_t(m);
    out.push_back(microbatchTokens(data, global, cfg.microbatch, cfg.seqLen));
  }
  return out;
}

std::vector<std::pair<int, int>> slicesOf(const Plan &plan) {
  std::vector<std::pair<int, int>> s;
  for (auto [b, e] : plan.seqSlices)
    s.emplace_back(int(b), int(e));
  return s;
}

float lossScaleOf(const Plan &plan, const kernels::GptConfig &cfg) {
  const ParallelConfig &pc = plan.parallel;
  return 1.0f / float(int64_t(pc.microbatches) * pc.dp * cfg.microbatch * cfg.seqLen);
}

ReferenceRun::ReferenceRun(const Plan &plan, const kernels::GptConfig &cfg, const DataSource &data,
                           uint64_t seed, float lr)
    : plan(plan), cfg(cfg), data(data), lr(lr),
      sc(cfg, 0, cfg.numLayers(), 0, 1, seed, {{0, cfg.seqLen}}, lossScaleOf(plan, cfg)) {}

double ReferenceRun::step(int index) {
  const ParallelConfig &pc = plan.parallel;
  std::vector<std::vector<int32_t>> batch;
  for (int d = 0; d < pc.dp; ++d)
    for (auto &mb : stepBatch(data, cfg, pc, index, d))
      batch.push_back(std::move(mb));
  sc.zeroGrads();
  sc.setBatch(batch);
  double loss = 0;
  for (int m = 0; m < int(batch.size()); ++m) {
    for (int p = 0; p < sc.parts(); ++p)
      sc.forward(m, 0, p, {});
    loss += sc.loss(m, 0);
    for (int p = 0; p < sc.parts(); ++p)
      sc.backwardInput(m, 0, p, {});
    sc.backwardWeight(m, 0);
  }
  return loss; // (one stage holding both tied copies sums their gradients itself)
}

void ReferenceRun::compare(const GradSnapshot &snapshot, GradCheck &check, int step) {
  const int tp = plan.parallel.tp;
  // Per tensor: its largest difference and reference gradient, and where the difference was.
  struct Tensor {
    double diff, scale;
    GradDiffPlace place;
  };
  std::vector<Tensor> tensors;
  double stepScale = 0;
  for (const StageInfo &st : plan.stages)
    for (int t = 0; t < tp; ++t) {
      auto it = snapshot.byStageAndTp.find({st.stage, t});
      assert(it != snapshot.byStageAndTp.end() && "every stage and tp rank is snapshotted");
      const std::vector<float> &mine = it->second;
      size_t offset = 0;
      for (int l = st.layerBegin; l < st.layerEnd; ++l) {
        auto [b, e] = sc.layerRange(l);
        std::vector<float> want = kernels::shardLayer(cfg, l, t, tp, sc.grads().subspan(b, e - b));
        assert(offset + want.size() <= mine.size() && "snapshot shorter than the stage");
        const std::vector<size_t> bounds = kernels::paramTensorOffsets(cfg, l, tp);
        auto placeOf = [&](size_t k) {
          return GradDiffPlace{
              step, st.stage, t, l, kernels::paramName(cfg, l, tp, k), mine[offset + k], want[k]};
        };
        for (size_t i = 0; i + 1 < bounds.size(); ++i) {
          double tensorDiff = 0, tensorScale = 0;
          size_t worstAt = bounds[i];
          for (size_t k = bounds[i]; k < bounds[i + 1]; ++k) {
            tensorScale = std::max(tensorScale, double(std::fabs(want[k])));
            double diff = std::fabs(double(want[k]) - double(mine[offset + k]));
            if (std::isnan(diff))
              diff = INFINITY;
            if (diff > tensorDiff) {
              tensorDiff = diff;
              worstAt = k;
            }
          }
          stepScale = std::max(stepScale, tensorScale);
          if (bounds[i] == bounds[i + 1])
            continue;
          if (tensorDiff > check.maxAbsDiff) {
            check.maxAbsDiff = tensorDiff;
            check.worst = placeOf(worstAt);
          }
          tensors.push_back({tensorDiff, tensorScale, placeOf(worstAt)});
        }
        offset += want.size();
      }
    }
  check.scale = std::max(check.scale, stepScale);
  for (Tensor &t : tensors) {
    const double relative = t.diff / std::max(t.scale, 1e-3 * stepScale);
    if (relative > check.maxTensorDiff) {
      check.maxTensorDiff = relative;
      check.worstTensor = std::move(t.place);
    }
  }
}

void ReferenceRun::adopt(const GradSnapshot &snapshot) {
  const int tp = plan.parallel.tp;
  std::span<float> grads = sc.grads();
  for (const StageInfo &st : plan.stages)
    for (int t = 0; t < tp; ++t) {
      auto it = snapshot.byStageAndTp.find({st.stage, t});
      assert(it != snapshot.byStageAndTp.end() && "every stage and tp rank is snapshotted");
      std::span<const float> mine = it->second;
      size_t offset = 0;
      for (int l = st.layerBegin; l < st.layerEnd; ++l) {
        auto [b, e] = sc.layerRange(l);
        const size_t n = kernels::layerParamCount(cfg, l, tp);
        assert(offset + n <= mine.size() && "snapshot shorter than the stage");
        kernels::unshardLayer(cfg, l, t, tp, mine.subspan(offset, n), grads.subspan(b, e - b));
        offset += n;
      }
    }
}

void ReferenceRun::update() { sc.adamStep(lr, kAdamBeta1, kAdamBeta2, kAdamEps, kAdamWeightDecay); }

} // namespace pipec
