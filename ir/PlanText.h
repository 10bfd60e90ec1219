//===- PlanText.h - Text form of instruction streams ------------*- C++ -*-===//
//
// Tokens in PyTorch's spelling (docs/contracts.md#plan-pipeplan1), one rank per line:
//   rank 1: 1RECV_F0 1F0 1SEND_F0 ...
// Compute: <stage><F|I|W|B><mb>[.<slice>][:<part>/<parts>]   (I = backward_input, B = fused)
// P2P (PyTorch's convention: the stage is the one that sends or receives):
//   <s>SEND_F<mb>   activation of stage s, to the rank of s+1
//   <s>RECV_F<mb>   activation of stage s-1, received by stage s
//   <s>SEND_B<mb>   input gradient made by stage s, to the rank of s-1
//   <s>RECV_B<mb>   gradient made by stage s+1, received by stage s
//   with the same [.<slice>] and an optional #<group>.
// Collectives: <s>ALLREDUCE_DP, <s>ALLREDUCE_EMB, <s>ALLREDUCE_TP_<F|I|B><mb>[.<k>]:<p>/<n>;
// OPTIMIZER_STEP. Peers and byte counts are not spelled: they follow from the stage table, so
// the text parses back exactly into the streams of a plan whose stages are known.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_PLANTEXT_H
#define PIPEC_IR_PLANTEXT_H

#include "ir/Plan.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <string>

namespace pipec {

std::string formatToken(const Plan &plan, const Instruction &ins);

/// Consume a decimal number of at most 9 digits from the front of `s` (the text form's stage,
/// microbatch, slice, part, group and rank numbers; PyTorch's schedule CSV spells them alike).
bool consumeNumber(llvm::StringRef &s, int32_t &out);
/// The text form's one lexer: one token into an instruction as the grammar above spells it (op,
/// stage, with a send's or recv's turned back into the producer's, microbatch, slice, part and
/// parts, group, collective and phase). Nothing is checked against a plan and peers and bytes
/// stay unset: they need the stage table (parseToken). An InputError saying what was expected
/// where the token breaks the grammar, or where a part is not below its parts.
llvm::Expected<Instruction> lexToken(llvm::StringRef token);
/// Parse one token as an instruction of `rank`: lexToken, then its stage, microbatch and slice
/// checked against the plan and its peer and bytes derived from the stage table.
llvm::Expected<Instruction> parseToken(const Plan &plan, int rank, llvm::StringRef token);

/// All streams, one "rank N: ..." line each.
std::string formatStreams(const Plan &plan, bool computeOnly = false);
/// Replace plan.ranks with the streams in `text` (the stage table must already be set).
llvm::Error parseStreams(llvm::StringRef text, Plan &plan);

/// A step of a rank to point at in a grid.
struct GridMark {
  int rank = 0;
  size_t step = 0;
};

/// The rank x step grid (rows are steps, columns ranks, as PyTorch prints it); marked steps get
/// "<-- here (rank r)" at the end of their row; a long grid with marks shows only the rows
/// near them. With computeOnly, comm ops are left out (steps
/// then count compute ops only; marks are still given in full-stream steps).
std::string formatGrid(const Plan &plan, llvm::ArrayRef<GridMark> marks = {},
                       bool computeOnly = false);

} // namespace pipec

#endif // PIPEC_IR_PLANTEXT_H
