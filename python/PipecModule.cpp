//===- PipecModule.cpp - The _pipec extension: pipec's library for Python --===//
//
// The thin layer under the `pipec` package (python/pipec/__init__.py): it takes flags the way
// the CLI does (so the one-line errors are the CLI's, word for word), runs the same code
// (tools/Driver.h), and turns errors into Python exceptions: bad input (an InputError) raises
// ValueError with its one line, a finding raises pipec.PlanError with the verifier's diagnostic.
// Nothing is printed; long work runs without the GIL.
//
//===----------------------------------------------------------------------===//
#include "compiler/Pass.h"
#include "compiler/Planner.h"
#include "compiler/TraceJson.h"
#include "compiler/Verifier.h"
#include "compiler/torch/TorchCsv.h"
#include "ir/PlanText.h"
#include "ir/formats/Costs.h"
#include "ir/formats/HfConfig.h"
#include "ir/formats/PlanJson.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "schedules/Policy.h"
#include "tools/Args.h"
#include "tools/Driver.h"
#include "tools/Options.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;
using namespace pipec;

namespace {

/// A finding (exit code 1 in the CLI); raised in Python as pipec.PlanError.
struct FindingException : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Rethrow an llvm::Error as the Python exception for its kind: a finding as PlanError with the
/// verifier's diagnostic, bad input as ValueError with the CLI's one line.
[[noreturn]] void raise(llvm::Error err) {
  bool isFinding = exitCodeFor(err) == 1;
  std::string msg = printableMessage(takeMessage(std::move(err)));
  if (isFinding)
    throw FindingException(msg);
  std::replace(msg.begin(), msg.end(), '\n', ' ');
  throw py::value_error(msg);
}

template <typename T> T unwrap(llvm::Expected<T> value) {
  if (!value)
    raise(value.takeError());
  return std::move(*value);
}

void check(llvm::Error err) {
  if (err)
    raise(std::move(err));
}

/// Parse `flags` ("--pp", "4", ...) as the pipec command `command` would, by its table (with
/// the flags only Python gives, such as --model-json).
Args parseFlags(const std::vector<std::string> &flags, llvm::StringRef command) {
  std::vector<char *> argv;
  for (const std::string &f : flags)
    argv.push_back(const_cast<char *>(f.c_str()));
  return unwrap(
      Args::parse(int(argv.size()), argv.data(), 0, *findPipecCommand(command), OptionUse::Python));
}

/// The one-line report of an import, kept with the plan it made.
struct PyPlan {
  Plan plan;
  std::string importReport;
  /// What compile, import and plan compiled it from (none for a plan read from JSON): the
  /// model, as that plan's microbatches ran it, and the device's peak, for its throughput.
  std::shared_ptr<const ModelSpec> modelSpec;
  double peakTflops = 0;
};

/// The files a Python call read, as (argument, path) pairs, for the check of its outputs.
using PyInputs = std::vector<std::pair<std::string, std::string>>;
std::vector<InputFile> inputFiles(const PyInputs &inputs) {
  std::vector<InputFile> out;
  for (const auto &[name, path] : inputs)
    out.push_back({name, path});
  return out;
}

/// Re-run memory and timing on a plan, as `pipec simulate` does; the trace if asked for.
PyPlan simulatePlan(const PyPlan &in, const std::optional<std::string> &tracePath,
                    const PyInputs &inputs) {
  if (tracePath)
    check(checkOutputPath("trace", *tracePath, inputFiles(inputs)));
  PyPlan out = in;
  std::string trace;
  {
    py::gil_scoped_release release;
    check(verifyPlan(out.plan));
    PassContext ctx;
    ctx.commsLowered = ctx.collectivesLowered = ctx.scheduled = true;
    check(runPipeline({"memory"}, out.plan, ctx));
    Timeline tl;
    check(simulateStep(out.plan, &tl));
    if (tracePath)
      trace = chromeTrace(out.plan, tl);
  }
  if (tracePath) {
    check(writeFilesAtomically({OutputFile{"trace", *tracePath, trace}}, inputFiles(inputs)));
  }
  return out;
}

std::string traceOf(const PyPlan &p) {
  py::gil_scoped_release release;
  check(verifyPlan(p.plan));
  Timeline tl;
  check(simulateTimeline(p.plan, tl));
  return chromeTrace(p.plan, tl);
}

const char *kindName(OptionKind k) {
  switch (k) {
  case OptionKind::Switch:
    return "switch";
  case OptionKind::Int:
    return "int";
  case OptionKind::Bytes:
    return "bytes";
  case OptionKind::Double:
    return "double";
  case OptionKind::Path:
    return "path";
  case OptionKind::String:
    return "string";
  case OptionKind::Enum:
    return "enum";
  case OptionKind::IntList:
    return "int_list";
  case OptionKind::StringList:
    return "string_list";
  }
  llvm_unreachable("every kind is named");
}

/// A command's table as Python reads it: the flags Python may give (not the command line's
/// printing and outputs), each a dict.
py::list optionsOf(const std::string &command) {
  const Command *cmd = findPipecCommand(command);
  if (!cmd)
    throw py::value_error("options: unknown command '" + command + "'");
  py::list out;
  for (const Option &o : cmd->options) {
    if (!o.shownIn(OptionUse::Python))
      continue;
    py::dict d;
    d["name"] = o.name;
    d["python"] = o.pythonName();
    d["kind"] = kindName(o.kind);
    d["value"] = o.value;
    d["help"] = o.help;
    d["required"] = o.required;
    if (o.kind == OptionKind::Int) {
      d["min"] = o.min;
      d["max"] = o.max;
    }
    out.append(d);
  }
  return out;
}

/// A step's throughput (Plan.throughput, a ranked layout's "throughput"), or None.
py::object throughputDict(const std::optional<StepThroughput> &th) {
  if (!th)
    return py::none();
  py::dict d;
  d["tokens_per_second"] = th->tokensPerSecond;
  d["tokens_per_second_per_gpu"] = th->tokensPerSecondPerGpu;
  d["tflops_per_gpu"] = th->tflopsPerGpu;
  d["mfu"] = th->mfu;
  return d;
}

/// One ranked layout of `pipec plan`, as its table row says it.
py::dict rankedDict(const PlanSearch &s, size_t i) {
  const PlannerResult &r = s.result;
  const PlanCandidate &c = r.candidates[r.ranked[i]];
  const ParallelConfig &pc = c.parallel;
  py::dict d;
  d["schedule"] = scheduleLabel(c);
  d["tp"] = pc.tp;
  d["pp"] = pc.pp;
  d["vpp"] = pc.vpp;
  d["dp"] = pc.dp;
  d["cp"] = pc.cp;
  d["microbatch_size"] = c.microbatchSize;
  d["microbatches"] = pc.microbatches;
  d["seq_splits"] = pc.seqSplits;
  d["recompute"] = toString(c.recompute).str();
  d["sequence_parallel"] = pc.sequenceParallel;
  d["distributed_optimizer"] = pc.distributedOptimizer;
  d["costs"] = c.measured ? "measured" : "model";
  d["step_time"] = c.stepTime;
  d["bubble"] = c.bubble;
  d["peak_memory_bytes"] = c.peakMemoryBytes;
  d["headroom_bytes"] = r.memoryLimit - c.peakMemoryBytes;
  // The table's tokens/s, TFLOP/s and MFU columns, and the step's model FLOPs.
  auto th = stepThroughput(modelVariant(s.model, c.microbatchSize, c.recompute), pc, c.stepTime,
                           s.cluster.peakTflops);
  if (th)
    d["model_flops"] = th->modelFlops;
  d["throughput"] = throughputDict(th);
  if (c.zbAutoLimit)
    d["zb_auto_limit"] = c.zbAutoLimit;
  // The cluster spec's calibration record for this schedule (pipec plan's "calibration:" line).
  if (auto error = s.cluster.heldOutError(c.schedule))
    d["held_out_error"] = *error;
  else
    d["held_out_error"] = py::none();
  return d;
}

/// What pipec.plan returns: the ranked layouts, what was dropped, the best plan.
py::dict planDict(PlanSearch &search) {
  const PlannerResult &r = search.result;
  py::dict out;
  py::list ranked;
  for (size_t i = 0; i < r.ranked.size(); ++i)
    ranked.append(rankedDict(search, i));
  out["ranked"] = ranked;
  std::map<Outcome, size_t> count;
  for (const PlanCandidate &c : r.candidates)
    ++count[c.outcome];
  py::dict dropped;
  dropped["divisibility"] = count[Outcome::Divisibility];
  dropped["constraint"] = count[Outcome::Constraint];
  dropped["memory"] = count[Outcome::Memory];
  dropped["pruned"] = count[Outcome::Pruned];
  out["dropped"] = dropped;
  out["searched"] = r.candidates.size();
  out["memory_limit"] = r.memoryLimit;
  out["min_headroom"] = r.minHeadroom;
  out["tokens_per_step"] = r.tokensPerStep;
  std::shared_ptr<const ModelSpec> bestModel;
  if (!r.ranked.empty()) {
    const PlanCandidate &best = r.candidates[r.ranked.front()];
    bestModel = std::make_shared<const ModelSpec>(
        modelVariant(search.model, best.microbatchSize, best.recompute));
  }
  out["best"] =
      PyPlan{std::move(search.result.best), "", std::move(bestModel), search.cluster.peakTflops};
  return out;
}

/// The Plan class: a compiled, imported or loaded plan and what can be asked of it.
void bindPlan(py::module_ &m) {
  py::class_<PyPlan>(m, "Plan")
      .def_property_readonly("schedule", [](const PyPlan &p) { return p.plan.schedule; })
      .def_property_readonly("model", [](const PyPlan &p) { return p.plan.model; })
      .def_property_readonly("time_unit", [](const PyPlan &p) { return p.plan.timeUnit; })
      .def_property_readonly("placement",
                             [](const PyPlan &p) { return toString(p.plan.placement).str(); })
      .def("header_json", [](const PyPlan &p) { return planHeaderJson(p.plan); })
      .def_property_readonly("num_instructions",
                             [](const PyPlan &p) { return p.plan.numInstructions(); })
      .def_property_readonly("import_report", [](const PyPlan &p) { return p.importReport; })
      .def_property_readonly("throughput",
                             [](const PyPlan &p) -> py::object {
                               if (!p.modelSpec || p.plan.timeUnit != "ms")
                                 return py::none();
                               return throughputDict(stepThroughput(*p.modelSpec, p.plan.parallel,
                                                                    p.plan.stats.stepTime,
                                                                    p.peakTflops));
                             })
      .def("json", [](const PyPlan &p) { return writePlanJson(p.plan); })
      .def(
          "text",
          [](const PyPlan &p, bool computeOnly) { return formatStreams(p.plan, computeOnly); },
          py::arg("compute_only") = false)
      .def(
          "grid",
          [](const PyPlan &p, bool computeOnly) { return formatGrid(p.plan, {}, computeOnly); },
          py::arg("compute_only") = false)
      .def("trace", &traceOf)
      .def(
          "torch_csv",
          [](const PyPlan &p, bool comms, bool tiedByCaller) {
            // As `pipec export`: a schedule leaves pipec only from a verified plan.
            py::gil_scoped_release release;
            check(verifyPlan(p.plan));
            return unwrap(writeTorchCsv(
                p.plan, comms ? TorchCsvForm::ComputeComms : TorchCsvForm::ComputeOnly,
                tiedByCaller));
          },
          py::arg("comms"), py::arg("tied_by_caller") = false)
      .def("save", [](const PyPlan &p, const std::string &path) {
        check(writeFilesAtomically({OutputFile{"path", path, writePlanJson(p.plan)}}, {}));
      });
}

/// The commands: compile, plan, import, and the option tables they take.
void bindCommands(py::module_ &m) {
  m.def(
      "compile",
      [](const std::vector<std::string> &flags) {
        Args args = parseFlags(flags, "compile");
        py::gil_scoped_release release;
        ClusterSpec cluster;
        auto model = std::make_shared<ModelSpec>();
        Plan plan = unwrap(compileWithFlags(args, &cluster, model.get()));
        return PyPlan{std::move(plan), "", std::move(model), cluster.peakTflops};
      },
      "compile(flags): `pipec compile` with CLI flags; --model-json/--cluster-json take JSON text");

  m.def(
      "plan",
      [](const std::vector<std::string> &flags) {
        Args args = parseFlags(flags, "plan");
        std::optional<PlanSearch> search;
        {
          py::gil_scoped_release release;
          search = unwrap(planWithFlags(args));
        }
        return planDict(*search);
      },
      "plan(flags): `pipec plan` with CLI flags: the ranked layouts, what was dropped, the best "
      "plan");

  m.def("options", &optionsOf,
        "options(command): the flags of a pipec command Python may give, from its table");

  m.def(
      "import_schedule",
      [](const std::string &text, const std::string &source,
         const std::vector<std::string> &flags) {
        Args args = parseFlags(flags, "import");
        py::gil_scoped_release release;
        ImportedOrder order;
        ClusterSpec cluster;
        auto model = std::make_shared<ModelSpec>();
        ImportResult result =
            unwrap(importWithFlags(args, text, source, &cluster, &order, model.get()));
        std::string report = importReport(order, result, source);
        if (!report.empty() && report.back() == '\n')
          report.pop_back();
        return PyPlan{std::move(result.plan), report, std::move(model), cluster.peakTflops};
      },
      "import_schedule(text, source, flags): `pipec import` of text read from source");
}

/// Reading, checking, simulating and writing files.
void bindFiles(py::module_ &m) {
  m.def(
      "read_text",
      [](const std::string &path) {
        std::string text;
        {
          py::gil_scoped_release release;
          text = unwrap(readFile(path, kTextInput));
        }
        return py::bytes(text);
      },
      "read_text(path): the bytes of a schedule text file, read by the command's input rules "
      "(a regular file or a pipe, at most 1 GiB; a device or directory is refused unread)");
  m.attr("TEXT_INPUT_LIMIT") = kTextInput.maxBytes;

  m.def(
      "load_plan",
      [](const std::string &path) {
        py::gil_scoped_release release;
        return PyPlan{unwrap(loadPlan(path)), "", nullptr, 0};
      },
      "load_plan(path): a pipeplan/1 file (its streams are checked by validate, not here)");

  m.def(
      "parse_plan",
      [](const std::string &text, const std::string &source) {
        py::gil_scoped_release release;
        return PyPlan{unwrap(parsePlanJson(text, source)), "", nullptr, 0};
      },
      "parse_plan(text, source): pipeplan/1 JSON text");

  m.def(
      "validate",
      [](const PyPlan &p) {
        py::gil_scoped_release release;
        check(verifyPlan(p.plan));
      },
      "validate(plan): raises PlanError with the verifier's diagnostic if the plan is wrong");

  m.def("simulate", &simulatePlan, py::arg("plan"), py::arg("trace") = std::nullopt,
        py::arg("inputs") = PyInputs(),
        "simulate(plan, trace=None, inputs=[]): memory and timing again, as `pipec simulate`; "
        "the trace is never one of inputs, the (argument, path) pairs the call read");

  m.def(
      "spec_from_hf",
      [](const std::string &text, const std::string &source, const std::string &name,
         int64_t seqLength, int64_t microbatchSize) {
        HfModel hf = unwrap(parseHfConfig(text, source));
        return unwrap(hfModelSpecJson(hf, name.empty() ? hf.modelType : name, seqLength,
                                      microbatchSize, source));
      },
      "spec_from_hf(config_json, source, name, seq_length, microbatch_size): the pipemodel/1 "
      "spec text of a Hugging Face config, as `pipec spec --from-hf`");

  m.def(
      "spec_from_hf_file",
      [](const std::string &path, const std::string &name, int64_t seqLength,
         int64_t microbatchSize) {
        // The command's reader: a regular file (or a pipe) of at most a config's size, a
        // directory or device refused unread.
        HfModel hf = unwrap(loadHfConfig(path));
        return unwrap(hfModelSpecJson(hf, name.empty() ? hfDefaultName(hf, path) : name, seqLength,
                                      microbatchSize, path));
      },
      "spec_from_hf_file(path, name, seq_length, microbatch_size): spec_from_hf of a "
      "config.json read by `pipec spec --from-hf`'s input rules");

  m.def(
      "write_file",
      [](const std::string &flag, const std::string &path, const std::string &text,
         const PyInputs &inputs) {
        check(writeFilesAtomically({OutputFile{flag, path, text}}, inputFiles(inputs)));
      },
      py::arg("flag"), py::arg("path"), py::arg("text"), py::arg("inputs") = PyInputs(),
      "write_file(flag, path, text, inputs=[]): a temporary file beside path, then a rename; "
      "never onto one of inputs, the (argument, path) pairs the call read");

  m.def(
      "check_output",
      [](const std::string &flag, const std::string &path, const PyInputs &inputs) {
        check(checkOutputPath(flag, path, inputFiles(inputs)));
      },
      py::arg("flag"), py::arg("path"), py::arg("inputs") = PyInputs(),
      "check_output(flag, path, inputs=[]): the checks write_file makes before it writes (a "
      "regular file or a new name in an existing directory, none of inputs), made up front");

  m.def(
      "write_costs",
      [](const std::string &text, const std::string &path, const PyInputs &inputs) {
        // The C++ reader checks every field first: the file written is one --costs reads.
        MeasuredCosts costs = unwrap(parseCostsJson(text, "pipec.torch.profile"));
        check(writeCosts(path, costs, inputFiles(inputs)));
      },
      py::arg("text"), py::arg("path"), py::arg("inputs") = PyInputs(),
      "write_costs(text, path, inputs=[]): measured costs (pipecost/1 JSON text), checked by the "
      "reader and written whole (a temporary beside path, then a rename); never onto one of "
      "inputs, the (argument, path) pairs the call read");

  m.def(
      "list_schedules",
      []() {
        py::list out;
        for (const SchedulePolicy *p : allPolicies()) {
          py::dict d;
          d["name"] = p->name().str();
          d["summary"] = p->summary().str();
          d["constraints"] = p->constraints().str();
          d["placement"] = toString(p->placement()).str();
          out.append(d);
        }
        return out;
      },
      "list_schedules(): name, summary, constraints and placement of every schedule");
}

} // namespace

PYBIND11_MODULE(_pipec, m) {
  m.doc() = "pipec's C++ library (the pipec package wraps it; use that)";
  py::register_exception<FindingException>(m, "PlanError");

  bindPlan(m);
  bindCommands(m);
  bindFiles(m);
}
