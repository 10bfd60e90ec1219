//===- Driver.h - The work behind pipec's commands, flags in -----*- C++ -*-===//
//
// What `pipec compile`, `export` and `import` do between parsing their flags and printing, so
// that the CLI and the Python module (python/) give the same plans and the same one-line errors.
// Besides the CLI's flags, the Python module passes a model or cluster as JSON text with
// --model-json and --cluster-json (they stand for --model and --cluster).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TOOLS_DRIVER_H
#define PIPEC_TOOLS_DRIVER_H

#include "compiler/Import.h"
#include "compiler/Planner.h"
#include "ir/Model.h"
#include "ir/Plan.h"
#include "ir/support/Files.h"
#include "tools/Args.h"
#include "tools/Options.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <string>
#include <vector>

namespace pipec {

/// The files a pipec command reads, for the check of its outputs (ir/support/Files.h): its
/// positional arguments (named `positionalName` in messages: "plan", "schedule") and the input
/// files its flags give (--model, --cluster). Every writer of every command is handed this list.
std::vector<InputFile> commandInputs(const Args &args, llvm::StringRef positionalName);

/// Whether one of `flags` names standard output ("-"): the command then prints nothing else
/// there, since its summary and "wrote" lines would corrupt that file.
bool writesStandardOutput(const Args &args, std::initializer_list<llvm::StringRef> flags);

/// --model or --model-json (required).
llvm::Expected<ModelSpec> modelFromFlags(const Args &args);
/// --cluster or --cluster-json; the embedded default when neither is given.
llvm::Expected<ClusterSpec> clusterFromFlags(const Args &args);

/// The compile flags' options: --schedule, --pp and --microbatches (required), --vpp,
/// --seq-splits, --tp, --dp, --microbatch-group-size and --memory-limit, each checked, in
/// that order, with the CLI's one-line errors. The schedule's name is resolved to its policy
/// once, by compilePlan.
llvm::Expected<CompileOptions> compileOptionsFromFlags(const Args &args);

/// `pipec compile`: a verified, simulated plan (the model under --recompute where given), or
/// the CLI's error (an InputError for bad flags, a Finding for a plan over --memory-limit).
llvm::Expected<Plan> compileWithFlags(const Args &args, ClusterSpec *clusterOut = nullptr,
                                      ModelSpec *modelOut = nullptr);

/// `pipec import`: `text` (read from `source`) compiled for --model with the other flags.
llvm::Expected<ImportResult> importWithFlags(const Args &args, llvm::StringRef text,
                                             llvm::StringRef source,
                                             ClusterSpec *clusterOut = nullptr,
                                             ImportedOrder *orderOut = nullptr,
                                             ModelSpec *modelOut = nullptr);

/// `pipec plan`'s options: --gpus and --global-batch (required), --top, --max-vpp, --threads,
/// --memory-limit, the lists to try and the switches, each checked.
llvm::Expected<PlannerOptions> plannerOptionsFromFlags(const Args &args);

/// What `pipec plan` searched and found.
struct PlanSearch {
  ModelSpec model;
  ClusterSpec cluster;
  PlannerOptions options; // --min-headroom resolved against the memory limit
  PlannerResult result;
};

/// `pipec plan`: the layouts for --model (or --model-json) on --gpus, ranked; a Finding when
/// none fits in memory.
llvm::Expected<PlanSearch> planWithFlags(const Args &args);

/// One line on what import inferred and which policy the order is, e.g.
/// "imported s.csv (PyTorch CSV, compute only): pp=4 vpp=1 microbatches=8, loop placement;
/// the order is pipec's 1f1b".
std::string importReport(const ImportedOrder &order, const ImportResult &result,
                         llvm::StringRef source);

/// The one sentence compile, import and plan print of a transformer timed (not from --costs)
/// on a cluster spec without a calibration record: "the cluster spec carries no calibration
/// record, so these step times rest on factors no published run has checked; --cluster ...
/// (docs/planner.md#calibration-out-of-sample)", naming the embedded default when
/// `defaultCluster` (no --cluster given). No newline.
std::string uncalibratedClusterSentence(bool defaultCluster);

/// Under the summary of compile and import: a transformer plan timed (not from --costs) on a
/// cluster spec without a calibration record, the embedded default among them, says so in one
/// note ("note: " and uncalibratedClusterSentence).
void printCalibrationNote(const Args &args, const Plan &plan, const ClusterSpec &cluster);

/// The summary `pipec compile` prints (pipec.cpp's printSummary), passed in so that export
/// and import live outside pipec.cpp.
using SummaryPrinter = void (*)(const Plan &, const ClusterSpec *, const ModelSpec *);

/// pipec export plan.json --format torch-csv|torch-csv-comms [-o sched.csv]
llvm::Error cmdExport(int argc, char **argv);
/// pipec import sched.csv|sched.txt --model M.json [--vpp V] [...] [-o plan.json]
llvm::Error cmdImport(int argc, char **argv, SummaryPrinter printSummary);

} // namespace pipec

#endif // PIPEC_TOOLS_DRIVER_H
