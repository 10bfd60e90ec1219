//===- TorchCsv.h - PyTorch pipelining schedule CSV, both ways --*- C++ -*-===//
//
// PyTorch's torch.distributed.pipelining (pinned: 2.15.0) keeps a schedule as a CSV with one row
// per pipeline rank and one action per cell, which `_PipelineScheduleRuntime._load_csv` reads
// and `_dump_csv` writes:
//   compute:     <stage><F|I|W|B><mb>        (I = input gradient, W = weight gradient,
//                                             B = both, fused)
//   overlapped:  (<compute>;<compute>)OVERLAP_F_B     a forward and a backward run as one action
//   comms:       <stage>SEND_F<mb> <stage>RECV_F<mb> <stage>SEND_B<mb> <stage>RECV_B<mb>
//                (the stage that acts: the producer sends, the consumer receives),
//                <stage>WAIT_SEND_F<mb> <stage>WAIT_SEND_B<mb> (retire a send),
//                <stage>REDUCE_GRAD <stage>WAIT_REDUCE_GRAD (finish a stage's gradients: the
//                data-parallel reduction and the 1/microbatches scaling),
//                <stage>UNSHARD <stage>RESHARD (FSDP parameter residency)
//   idle:        an empty cell (compute-only form only)
// Rows end with "\r\n", as Python's csv module writes them.
//
// Two forms: compute-only (PyTorch lowers it to comms itself) and compute+comms, which carries
// pipec's own send/recv order and every action PyTorch's loader needs there. The comms form is a
// lowering of the plan, so this package sits above the compiler and asks its rules (where
// the dp reductions go: compiler/LowerCollectives.h) instead of restating them; the reader
// lexes pipec's text form with the text form's own lexer (ir/PlanText.h).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_TORCH_TORCHCSV_H
#define PIPEC_COMPILER_TORCH_TORCHCSV_H

#include "compiler/Import.h"
#include "ir/Instruction.h"
#include "ir/Plan.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <string>
#include <vector>

namespace pipec {

enum class TorchCsvForm : uint8_t {
  ComputeOnly,  // --format torch-csv
  ComputeComms, // --format torch-csv-comms
};
llvm::StringRef toString(TorchCsvForm form);
/// "torch-csv" or "torch-csv-comms"; false for anything else.
bool torchCsvFormFromString(llvm::StringRef name, TorchCsvForm &out);

/// An InputError naming the feature and the flag to change when PyTorch's CSV cannot express
/// the plan: sub-sequences (--seq-splits), tensor-parallel parts (--tp), the tied-embedding
/// all-reduce ("tie_embeddings", unless `tiedByCaller`: the caller sums the tied copies'
/// gradients itself, as pipec.torch's PipelineRunner does). Success otherwise.
llvm::Error checkTorchExpressible(const Plan &plan, bool tiedByCaller = false);

/// The plan as PyTorch's CSV. Compute-only: the compute ops of each rank in stream order.
/// Compute+comms: pipec's stream with its sends and recvs in PyTorch's spelling, plus
///  - WAIT_SEND_F right after the local backward of the same (stage, mb) (which proves the
///    peer has received it), WAIT_SEND_B and any other pending wait at the end of the row;
///  - REDUCE_GRAD, WAIT_REDUCE_GRAD of every stage where pipec's dp all-reduce of that stage
///    is (with dp = 1: where lower-collectives would put it, dpAllReducePoints);
///  - UNSHARD/RESHARD around compute as PyTorch's own lowering places them (three stages
///    resident, three looked ahead), so FSDP-wrapped stages run too;
///  - no optimizer step (the optimizer is the caller's).
/// In both forms a dualpipe-v plan's F&B pairs are OVERLAP_F_B actions, paired as PyTorch's
/// ScheduleDualPipeV pairs them. Errors as checkTorchExpressible; with `tiedByCaller` the
/// tied-embedding all-reduce is left out (the caller sums the two copies' gradients).
llvm::Expected<std::string> writeTorchCsv(const Plan &plan, TorchCsvForm form,
                                          bool tiedByCaller = false);

/// Positions i in a rank's compute ops where ops i and i+1 are a dualpipe-v F&B pair.
std::vector<bool> overlappedPairStarts(const Plan &plan, int rank,
                                       const std::vector<Instruction> &compute);

/// Read PyTorch's CSV (either form) or pipec's text form (`pipec show --text`, "rank N: ..."
/// lines). A malformed cell or token is an InputError naming `source`, its row and column.
llvm::Expected<ImportedOrder> parseSchedule(llvm::StringRef text, llvm::StringRef source);

} // namespace pipec

#endif // PIPEC_COMPILER_TORCH_TORCHCSV_H
