//===- Backend.h - What the interpreter asks of a backend -------*- C++ -*-===//
//
// One backend object per thread (pipeline rank x dp replica x tp rank). The interpreter owns
// the order and the transport; the backend owns the math and the buffers.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_BACKEND_H
#define PIPEC_RUNTIME_BACKEND_H

#include "ir/Instruction.h"
#include "runtime/Tensor.h"

#include "llvm/Support/Error.h"

namespace pipec {

class Backend {
public:
  virtual ~Backend() = default;
  /// Start training step `step` (load its batch, zero gradients).
  virtual llvm::Error beginStep(int step) = 0;
  /// Run a compute op (one part of it when split).
  virtual llvm::Error compute(const Instruction &i) = 0;
  /// The tensor a send carries (read until the send completes).
  virtual TensorView sendData(const Instruction &i) = 0;
  /// Where a recv writes (valid until its consumer has run).
  virtual TensorView recvData(const Instruction &i) = 0;
  /// The buffer an all-reduce sums in place.
  virtual TensorView reduceData(const Instruction &i) = 0;
  /// After an all-reduce of this rank has completed (the reduced data is in place).
  virtual llvm::Error afterAllReduce(const Instruction &i) = 0;
  /// Tied embeddings whose two copies live on this one rank: sum them locally.
  virtual void sumLocalEmbeddingCopies() = 0;
  virtual llvm::Error optimizerStep() = 0;
  /// --profile: wait until the work of the ops run so far is done, so that the host clock
  /// times it (a GPU backend synchronises its stream; the cpu backend's work is done on return).
  virtual llvm::Error awaitCompute() { return llvm::Error::success(); }
};

} // namespace pipec

#endif // PIPEC_RUNTIME_BACKEND_H
