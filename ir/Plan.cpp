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

size_t Plan::numInstructions() const {
  size_t n = 0;
  for (const auto &r : ranks)
    n += r.size();
  return n;
}

} // namespace pipec
