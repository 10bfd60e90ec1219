#include "ir/Plan.h"

#include "llvm/Support/ErrorHandling.h"

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
  const int64_t tokens = t.microbatchSize * (end - begin);
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

size_t Plan::numInstructions() const {
  size_t n = 0;
  for (const auto &r : ranks)
    n += r.size();
  return n;
}

} // namespace pipec
