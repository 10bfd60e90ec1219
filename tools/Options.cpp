#include "tools/Options.h"

#include "ir/support/Limits.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallVector.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <iterator>

namespace pipec {

const char *const kExitCodes =
    "exit codes: 0 ok, 1 the plan or schedule is wrong, 2 bad usage or input\n";
static const char *const kPiperunExitCodes =
    "exit codes: 0 ok, 1 a finding (a wrong plan, a gradient mismatch, a stall), 2 bad usage or "
    "input\n";

std::string Option::pythonName() const {
  llvm::StringRef n(name);
  if (!n.startswith("--"))
    return "";
  std::string out = n.drop_front(2).str();
  std::replace(out.begin(), out.end(), '-', '_');
  return out;
}

const Option *Command::find(llvm::StringRef flag) const {
  for (const Option &o : options)
    if (flag == o.name || (o.alias && flag == o.alias))
      return &o;
  return nullptr;
}

std::string Command::errorPrefix() const {
  return *name ? std::string(name) + ": " : std::string();
}

namespace {

// The tables' builders: a kind and its fields, then what sets it apart.
struct Opt : Option {
  constexpr Opt(const char *name, OptionKind kind, const char *value, const char *help)
      : Option{name, kind, value, help} {}
  constexpr Opt bounds(int64_t lo, int64_t hi, int64_t absent) const {
    Opt o = *this;
    o.min = lo, o.max = hi, o.fallback = absent;
    return o;
  }
  constexpr Opt req() const {
    Opt o = *this;
    o.required = true;
    return o;
  }
  constexpr Opt cli() const {
    Opt o = *this;
    o.use = OptionUse::Cli;
    return o;
  }
  constexpr Opt py() const {
    Opt o = *this;
    o.use = OptionUse::Python;
    return o;
  }
  constexpr Opt aka(const char *other) const {
    Opt o = *this;
    o.alias = other;
    return o;
  }
  constexpr Opt in(const char *parent) const {
    Opt o = *this;
    o.within = parent;
    return o;
  }
  constexpr Opt eg(const char *value) const {
    Opt o = *this;
    o.example = value;
    return o;
  }
};

constexpr Opt sw(const char *name, const char *help) {
  return Opt(name, OptionKind::Switch, "", help);
}
/// A count in [1, kMaxFlagCount], `absent` when not given.
constexpr Opt count(const char *name, const char *value, const char *help, int64_t absent = 1) {
  return Opt(name, OptionKind::Int, value, help).bounds(1, kMaxFlagCount, absent);
}
constexpr Opt integer(const char *name, const char *value, const char *help, int64_t lo, int64_t hi,
                      int64_t absent) {
  return Opt(name, OptionKind::Int, value, help).bounds(lo, hi, absent);
}
constexpr Opt path(const char *name, const char *value, const char *help) {
  return Opt(name, OptionKind::Path, value, help);
}
constexpr Opt text(const char *name, const char *value, const char *help) {
  return Opt(name, OptionKind::String, value, help);
}
constexpr Opt choice(const char *name, const char *choices, const char *help) {
  return Opt(name, OptionKind::Enum, choices, help);
}
constexpr Opt bytes(const char *name, const char *help) {
  return Opt(name, OptionKind::Bytes, "BYTES", help);
}
constexpr Opt real(const char *name, const char *value, const char *help, int64_t most) {
  return Opt(name, OptionKind::Double, value, help).bounds(0, most, 0);
}

// The flags several commands share, worded once.
constexpr Opt kPartition =
    choice("--partition", "balanced|even",
           "layers into stages: balanced by time (default) or the same blocks in every stage, "
           "as Megatron-LM splits them")
        .eg("even");
constexpr Opt kModel =
    path("--model", "M.json", "the model: a pipemodel/1 JSON file (docs/contracts.md)").req();
constexpr Opt kModelJson = text("--model-json", "JSON", "the model as pipemodel/1 JSON text").py();
constexpr Opt kCluster =
    path("--cluster", "C.json", "the cluster: a pipecluster/1 JSON file (default: H100 nodes)");
constexpr Opt kClusterJson =
    text("--cluster-json", "JSON", "the cluster as pipecluster/1 JSON text").py();
constexpr Opt kCosts =
    path("--costs", "FILE", "measured op costs (piperun --profile) in place of the cost model's");
constexpr Opt kMemoryLimit =
    bytes("--memory-limit", "every rank's peak activations at most this (80GiB, 512MiB, ...)");
constexpr Opt kGroupSize =
    count("--microbatch-group-size", "G", "microbatches per group of an interleaved schedule", 0);
// (At most what tp x dp may reach: a larger one's suggested bound would be refused next.)
constexpr Opt kTp = integer("--tp", "T", "tensor-parallel ranks per stage", 1, kMaxTpDp, 1);
constexpr Opt kDp = integer("--dp", "D", "data-parallel replicas", 1, kMaxTpDp, 1);
constexpr Opt kCp =
    integer("--cp", "C", "context-parallel ranks sharing each sequence (transformer models)", 1,
            kMaxTpDp, 1);
constexpr Opt kSequenceParallel =
    sw("--sequence-parallel", "Megatron's sequence parallelism (with --tp)");
constexpr Opt kDistributedOptimizer =
    sw("--distributed-optimizer", "ZeRO-1: the optimizer state sharded over --dp (x --cp)");
constexpr Opt kMicrobatchSize =
    integer("--microbatch-size", "B",
            "sequences per microbatch (transformer models; default: the model spec's "
            "microbatch_size)",
            1, kMaxMicrobatchSize, 0)
        .eg("2");
constexpr Opt kShow = sw("--show", "print the rank x step grid after the summary").cli();
constexpr Opt kTrace =
    path("--trace", "trace.json", "write the simulated timeline as a Chrome/Perfetto trace").cli();
constexpr Opt kQuiet = sw("--quiet", "print nothing on success").cli();

/// A table from its parts, in order, so that a run of flags several tables list is written once.
template <size_t... N> constexpr auto join(const Option (&...parts)[N]) {
  std::array<Option, (N + ...)> out{};
  size_t at = 0;
  ((std::copy(std::begin(parts), std::end(parts), out.begin() + at), at += N), ...);
  return out;
}

// What compile and import read after their schedule's own counts: the layout and its limits.
constexpr Option kLayoutFlags[] = {kTp,          kDp,    kCp,          kCluster,
                                   kClusterJson, kCosts, kMemoryLimit, kGroupSize};

constexpr auto kCompile = join(
    {
        kModel,
        kModelJson,
        text("--schedule", "NAME", "the schedule (pipec list-schedules)").req(),
        count("--pp", "P", "pipeline ranks").req(),
        count("--microbatches", "N", "microbatches per step").req(),
        count("--vpp", "V", "virtual stages (model chunks) per rank"),
        count("--seq-splits", "K", "sub-sequences per microbatch (the seq1f1b schedules)"),
    },
    kLayoutFlags,
    {
        path("-o", "plan.json", "write the plan (- for standard output)").aka("--output").cli(),
        choice("--recompute", "none|selective|full",
               "activation recomputation (transformer models)")
            .eg("full"),
        kMicrobatchSize,
        kSequenceParallel,
        kDistributedOptimizer,
        choice(
            "--seq-split-by", "time|flops",
            "cut sub-sequences to equal time (default) or equal FLOPs (the Seq1F1B paper's rule)")
            .eg("flops"),
        kPartition,
        kShow,
        kTrace,
        path("--svg", "figure.svg", "draw the schedule figure over the simulated time").cli(),
        kQuiet,
    });

const Option kSimulate[] = {kTrace};

const Option kShowFlags[] = {
    sw("--compute-only", "leave the transfers out"),
    sw("--text", "one line per rank in the text form"),
    path("--svg", "figure.svg", "draw the figure over the simulated time instead"),
};

const Option kExport[] = {
    choice("--format", "torch-csv|torch-csv-comms",
           "compute only, or with sends, receives, waits and reductions")
        .req(),
    path("-o", "sched.csv", "write the CSV there (default: standard output)").aka("--output"),
};

constexpr auto kImport = join(
    {
        kModel,
        kModelJson,
        count("--vpp", "V", "virtual stages per rank, checked against the file's", 0),
    },
    kLayoutFlags,
    {
        text("--schedule", "NAME", "the schedule the order must be (else whichever it is)"),
        kMicrobatchSize,
        path("-o", "plan.json", "write the plan").aka("--output").cli(),
        kShow,
        kTrace,
        kQuiet,
    });

const Option kPlan[] = {
    kModel,
    integer("--gpus", "N", "GPUs to plan for", 1, kMaxGpus, 1).req(),
    integer("--global-batch", "B", "sequences per step (microbatches for an abstract model)", 1,
            kMaxGlobalBatch, 1)
        .req(),
    kCluster,
    Opt("--schedules", OptionKind::StringList, "a,b,...", "the schedules to try (default: all)")
        .eg("1f1b,zb-h1"),
    bytes("--memory-limit", "memory per GPU (default: the cluster device's)"),
    text("--min-headroom", "BYTES|P%", "memory every ranked plan leaves free (default 5%)"),
    integer("--top", "K", "layouts to list (default 5)", 1, kMaxTop, 5),
    path("-o", "best.json", "write the best plan").aka("--output").cli(),
    path("--csv", "all.csv", "write every candidate and what became of it").cli(),
    Opt("--recompute", OptionKind::StringList, "none,selective,full",
        "the recomputation settings to try (default: all three)"),
    Opt("--microbatch-sizes", OptionKind::IntList, "1,2,4",
        "microbatch sizes to try (default: every divisor up to 16)"),
    Opt("--seq-splits", OptionKind::IntList, "1,2,4,8",
        "sub-sequence counts to try (default 1,2,4,8)"),
    integer("--max-vpp", "V", "most virtual stages per rank to try (default 8)", 1, kMaxSearchVpp,
            8),
    Opt("--tp", OptionKind::IntList, "1,2,...", "tensor-parallel sizes to try (default: all)"),
    Opt("--pp", OptionKind::IntList, "1,2,...", "pipeline sizes to try (default: all)"),
    Opt("--cp", OptionKind::IntList, "1,2,...",
        "context-parallel sizes to try (default 1: none; transformer models)"),
    sw("--tp-across-nodes", "let tp exceed a node's GPUs"),
    sw("--sequence-parallel", "every candidate with sequence parallelism (default: both tried)"),
    sw("--no-sequence-parallel", "no candidate with sequence parallelism"),
    sw("--distributed-optimizer", "every candidate with ZeRO-1 (default: both tried)"),
    sw("--no-distributed-optimizer", "no candidate with ZeRO-1"),
    kPartition,
    kCosts,
    integer("--threads", "T", "worker threads (default: the machine's cores)", 1, kMaxThreads, 0),
    kQuiet,
};

const Option kSpec[] = {
    path("--from-hf", "config.json", "a Hugging Face model's config.json").req(),
    integer("--seq-length", "T", "tokens per sequence (default: the config's context)", 1,
            kMaxSpecSeqLength, 0),
    integer("--microbatch-size", "B", "sequences per microbatch (default 1)", 1,
            kMaxSpecMicrobatchSize, 1),
    text("--name", "NAME", "the model's name (default: the config's directory)"),
    path("-o", "spec.json", "write the spec there (default: standard output)"),
};

const Option kPiperun[] = {
    choice("--backend", "cpu|cuda|nccl", "where to run (default cpu)").eg("cpu"),
    choice("--dtype", "fp32|bf16", "the GPU backends' compute type (default: the model's)"),
    integer("--steps", "N", "the step the job ends at (default 1)", 1, kMaxSteps, 1),
    sw("--check-reference", "compare gradients and weights with the single-rank reference"),
    integer("--seed", "S", "the seed of the weights and the synthetic data (default 1)", 0,
            INT64_MAX, 1),
    path("--data", "FILE", "train on a token file (default: synthetic tokens)"),
    choice("--data-dtype", "uint16|uint32", "the token file's integer type (default uint16)")
        .in("--data")
        .eg("uint16"),
    real("--lr", "LR", "AdamW's learning rate (at most 10)", 10).eg("1e-3"),
    real("--timeout", "SECONDS", "a step waiting longer than this is a stall", 0).eg("30"),
    path("--save-dir", "DIR", "save a checkpoint there after the last step"),
    integer("--save-every", "N", "and after every N-th step", 1, kMaxSteps, 0).in("--save-dir"),
    integer("--keep", "K", "keep the K newest checkpoints", 1, kMaxSteps, 0).in("--save-dir"),
    path("--resume", "DIR", "continue from DIR's newest complete checkpoint"),
    path("--init-from", "FILE|DIR", "initial weights: safetensors, or a Hugging Face directory"),
    path("--export-hf", "DIR", "write the final weights as a Hugging Face directory"),
    bytes("--export-hf-shard-size", "shard the export past this size (default 5GB)")
        .in("--export-hf"),
    path("--profile", "FILE", "write the measured op costs there (pipec --costs reads them)"),
};

const Command kPipecCommands[] = {
    {"pipec", "compile", "", "compile, verify and simulate a plan; print its summary", kCompile},
    {"pipec",
     "validate",
     "plan.json",
     "re-check a plan from disk (exit 1 with a diagnostic if "
     "wrong)",
     {}},
    {"pipec", "simulate", "plan.json", "timed simulation; optional Chrome/Perfetto trace",
     kSimulate},
    {"pipec", "show", "plan.json",
     "the rank x step grid (or, with --text, one line per rank; with --svg, the papers' figure "
     "over simulated time)",
     kShowFlags},
    {"pipec", "list-schedules", "", "the schedules, their constraints and a line on each", {}},
    {"pipec", "export", "plan.json",
     "the plan as PyTorch pipelining's schedule CSV (compute only, or with its sends, recvs, "
     "waits and gradient reductions)",
     kExport},
    {"pipec", "import", "sched.csv|sched.txt",
     "a PyTorch schedule CSV or pipec's text form, compiled, verified and simulated as pipec's "
     "own (pp, microbatches, placement inferred)",
     kImport},
    {"pipec", "plan", "",
     "search tp, pp, vpp, dp, microbatch size and count, seq-splits and schedules for the "
     "fastest step that fits the device's memory, less --min-headroom (default 5% of it; 0 to "
     "use it all)",
     kPlan},
    {"pipec", "spec", "", "the model spec of a Hugging Face GPT-2, Llama or Mistral config", kSpec},
};

const Command kPiperunCommand = {
    "piperun", "", "plan.json",
    "run a plan's schedule: train on the cpu backend (the fp32 reference), one GPU (cuda) or one "
    "process per GPU (nccl), printing each step's loss",
    kPiperun};

/// The usage form of one flag and the flags shown within it: "[--data FILE [--data-dtype ...]]".
std::string usageToken(const Command &cmd, const Option &o) {
  std::string t = o.name;
  if (o.alias)
    t += std::string("|") + o.alias;
  if (!o.isSwitch())
    t += std::string(" ") + o.value;
  for (const Option &inner : cmd.options)
    if (inner.within && llvm::StringRef(inner.within) == o.name)
      t += " " + usageToken(cmd, inner);
  return o.required ? t : "[" + t + "]";
}

/// `words` after `lead`, wrapped at `width` columns with continuation lines under `indent`.
std::string wrap(std::string line, llvm::ArrayRef<std::string> words, size_t indent,
                 unsigned width) {
  std::string out;
  bool fresh = true; // nothing but the lead or the indent on the line
  for (const std::string &w : words) {
    if (!fresh && line.size() + 1 + w.size() > width) {
      out += line + "\n";
      line = std::string(indent, ' ');
      fresh = true;
    }
    if (!fresh)
      line += ' ';
    line += w;
    fresh = false;
  }
  return out + line + "\n";
}

std::vector<std::string> usageTokens(const Command &cmd) {
  std::vector<std::string> tokens;
  for (bool required : {true, false})
    for (const Option &o : cmd.options)
      if (o.required == required && o.shownIn(OptionUse::Cli) && !o.within)
        tokens.push_back(usageToken(cmd, o));
  return tokens;
}

std::vector<std::string> splitWords(llvm::StringRef text) {
  llvm::SmallVector<llvm::StringRef, 32> parts;
  text.split(parts, ' ', -1, false);
  return {parts.begin(), parts.end()};
}

} // namespace

llvm::ArrayRef<Command> pipecCommands() { return kPipecCommands; }

const Command *findPipecCommand(llvm::StringRef name) {
  for (const Command &c : kPipecCommands)
    if (name == c.name)
      return &c;
  return nullptr;
}

const Command &piperunCommand() { return kPiperunCommand; }

/// The synopsis after `lead` ("usage: "), continuation lines under the command's first word.
static std::string synopsisAfter(llvm::StringRef lead, const Command &cmd, unsigned width) {
  std::string line = lead.str() + cmd.tool;
  if (*cmd.name)
    line += std::string(" ") + cmd.name;
  size_t indent = line.size() + 1;
  std::vector<std::string> tokens;
  if (*cmd.positional)
    tokens.push_back(cmd.positional);
  for (std::string &t : usageTokens(cmd))
    tokens.push_back(std::move(t));
  if (tokens.empty())
    return line + "\n";
  return wrap(line + " ", tokens, indent, width);
}

std::string synopsis(const Command &cmd, unsigned width) { return synopsisAfter("", cmd, width); }

std::string commandHelp(const Command &cmd) {
  std::string out =
      synopsisAfter("usage: ", cmd, 98) + "\n" + wrap("", splitWords(cmd.summary), 0, 98);
  bool any = false;
  for (const Option &o : cmd.options) {
    if (!o.shownIn(OptionUse::Cli))
      continue;
    if (!any)
      out += "\nflags:\n";
    any = true;
    std::string form = std::string(o.name) + (o.alias ? std::string(", ") + o.alias : "") +
                       (o.isSwitch() ? "" : std::string(" ") + o.value);
    std::string help = o.help;
    if (o.required)
      help += " (required)";
    if (o.within)
      help += fmt::format(" (with {})", o.within);
    std::string lead = fmt::format("  {:<30}", form);
    if (lead.size() > 32)
      lead += " ";
    out += wrap(lead, splitWords(help), 33, 98);
  }
  return out + "\n" + (llvm::StringRef(cmd.tool) == "piperun" ? kPiperunExitCodes : kExitCodes);
}

std::string pipecHelp() {
  std::string out = "usage: pipec <command> [flags]   (pipec <command> --help: that command's)\n"
                    "\ncommands:\n";
  for (const Command &c : kPipecCommands) {
    // "pipec compile ..." less the tool's name: "  compile ...".
    out += "  " + llvm::StringRef(synopsisAfter("", c, 96)).drop_front(6).str();
    out += wrap(std::string(22, ' '), splitWords(c.summary), 22, 98);
  }
  return out + "\n" + kExitCodes;
}

} // namespace pipec
