//===- Verifier.h - Proves a plan correct or says where it is not -*- C++ -*-===//
//
// Checks, in order, stopping at the first failure (a Finding naming the rank, the step and the
// instruction, with the rank x step grid and "<-- here"):
//  1. structure: stage table (placement, contiguous non-empty layer ranges, slices), every
//     instruction on the rank that owns its stage, peers and byte counts consistent;
//  2. completeness: every (stage, mb, slice) has one F and either one fused B or one I and
//     one W (each tp part once, in order, each followed by its tp all-reduce);
//  3. dependencies: a same-rank input earlier in the stream; a cross-rank input received
//     earlier in the consumer's stream, sent after its producer in the producer's stream;
//  4. matching: per ordered rank pair, the sends and recvs list the same tensors in the same
//     (FIFO) order, as NCCL matches them;
//  5. deadlock freedom under NCCL's blocking rules: a rank posts its comm ops in stream order,
//     a group (consecutive ops with one `group`) or a lone op completes only once every op in
//     it has its partner posted; a stuck state is reported with the wait-for cycle;
//  6. collectives: a dp all-reduce per stage (dp > 1) after all its weight gradients; with tied
//     embeddings one embedding all-reduce for the first and for the last stage, after their
//     weight gradients and every send/recv; then one optimizer step after every all-reduce.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_VERIFIER_H
#define PIPEC_COMPILER_VERIFIER_H

#include "ir/Plan.h"

#include "llvm/Support/Error.h"

namespace pipec {

struct VerifyOptions {
  /// Cross-rank inputs must be received (false between scheduling and comm lowering).
  bool requireComms = true;
  /// dp all-reduces and the optimizer step must be present, and with tp > 1 compute split at
  /// the tp all-reduces (false before collective lowering).
  bool requireCollectives = true;
};

llvm::Error verifyPlan(const Plan &plan, const VerifyOptions &options = {});

} // namespace pipec

#endif // PIPEC_COMPILER_VERIFIER_H
