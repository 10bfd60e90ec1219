#include "ir/Plan.h"

#include "llvm/Support/ErrorHandling.h"

#include <fmt/format.h>

#include <algorithm>

namespace pipec {

llvm::StringRef toString(Placement p) {
  switch (p) {
  case Placement::Loop:
    return "loop";
  case Placement::VShape:
    return "v-shape";
  }
  llvm_unreachable("unknown Placement");
}

bool placementFromString(llvm::StringRef name, Placement &out) {
  for (Placement p : {Placement::Loop, Placement::VShape}) {
    if (toString(p) == name) {
      out = p;
      return true;
    }
  }
  return false;
}

int rankOfStage(Placement p, int stage, int pp) {
  switch (p) {
  case Placement::Loop:
    return stage % pp;
  case Placement::VShape:
    return stage < pp ? stage : 2 * pp - 1 - stage;
  }
  llvm_unreachable("unknown Placement");
}

int64_t Plan::tiedEmbeddingBytes() const {
  if (!transformer)
    return 0;
  return transformer->vocabSize * transformer->hiddenSize * transformer->dtypeBytes() / parallel.tp;
}

int64_t Plan::tpAllReduceBytes(int stage, int slice, OpKind phase, int part) const {
  const StageInfo &st = stages[size_t(stage)];
  if (!transformer)
    return st.outputBytes[size_t(slice)];
  const TransformerConfig &t = *transformer;
  auto [begin, end] = seqSlices[size_t(slice)];
  // (A rank of cp context-parallel ones holds 1/cp of the tokens: a plan with cp > 1 has one
  // slice, the whole sequence, a multiple of 2·cp.)
  const int64_t tokens = t.microbatchSize * (end - begin) / std::max(1, parallel.cp);
  // Layer l of the compiled model: 0 the embedding, 1..numLayers the blocks, then the head.
  const int head = int(t.numLayers) + 1;
  auto partsOf = [&](int layer) { return layer == 0 || layer == head ? 1 : 2; };
  const bool forward = phase == OpKind::Forward;
  int layer = forward ? st.layerBegin : st.layerEnd - 1;
  for (int seen = 0; layer >= st.layerBegin && layer < st.layerEnd; layer += forward ? 1 : -1) {
    seen += partsOf(layer);
    if (part < seen)
      break;
  }
  if (layer == head && forward)
    return tokens * (2 * int64_t(parallel.tp) + 1) * 4;
  if (layer == 0 && !forward)
    return 0;
  return tokens * t.hiddenSize * t.dtypeBytes();
}

std::optional<StepThroughput> stepThroughput(const ModelSpec &model, const ParallelConfig &pc,
                                             double stepMs, double peakTflops) {
  if (!model.transformer || !(stepMs > 0))
    return std::nullopt;
  const TransformerConfig &t = *model.transformer;
  double seconds = stepMs / 1000, sequences = double(pc.microbatches) * pc.dp * t.microbatchSize;
  double gpus = double(pc.tp) * pc.cp * pc.pp * pc.dp;
  StepThroughput out;
  out.tokensPerSecond = sequences * double(t.seqLength) / seconds;
  out.tokensPerSecondPerGpu = out.tokensPerSecond / gpus;
  out.modelFlops = model.modelFlopsPerMicrobatch() * pc.microbatches * pc.dp;
  double perGpu = out.modelFlops / seconds / gpus;
  out.tflopsPerGpu = perGpu / 1e12;
  out.mfu = peakTflops > 0 ? perGpu / (peakTflops * 1e12) : 0;
  return out;
}

std::optional<std::string> contextParallelProblem(const std::optional<TransformerConfig> &t,
                                                  const ParallelConfig &pc, int &fits,
                                                  int64_t divides) {
  fits = 1;
  if (pc.cp <= 1)
    return std::nullopt;
  if (!t)
    return std::string("needs a transformer model: an abstract model's layers have no sequence "
                       "to share");
  const int64_t seq = t->seqLength;
  const bool split = pc.sequenceParallel && pc.tp > 1;
  auto passes = [&](int64_t c) { return seq % (2 * c) == 0 && (!split || (seq / c) % pc.tp == 0); };
  if (passes(pc.cp))
    return std::nullopt;
  // (Only a refusal looks for the size to suggest.)
  for (int c = 1; c <= pc.cp && c <= seq; ++c)
    if (passes(c) && (divides <= 0 || divides % c == 0))
      fits = c;
  if (seq % (2 * int64_t(pc.cp)) != 0)
    return fmt::format("needs seq_length ({}) to be a multiple of 2 x {} (each rank holds two of "
                       "its 2 x cp chunks)",
                       seq, pc.cp);
  return fmt::format("with sequence parallelism needs each rank's {} tokens to split into tp {} "
                     "parts",
                     seq / pc.cp, pc.tp);
}

size_t Plan::numInstructions() const {
  size_t n = 0;
  for (const auto &r : ranks)
    n += r.size();
  return n;
}

} // namespace pipec
