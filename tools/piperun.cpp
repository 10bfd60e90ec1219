//===- piperun.cpp - Run a compiled plan ----------------------------------===//
//
//   piperun plan.json --backend cpu|cuda|nccl [--dtype fp32|bf16] [--steps N]
//           [--check-reference] [--seed S] [--data FILE [--data-dtype uint16|uint32]] [--lr LR]
//           [--timeout SECONDS]
// Prints "step N loss X" per step; with --check-reference also the single-rank reference's
// loss, "max_abs_grad_diff=<value>" and "max_tensor_grad_diff=<value>" with the places of both
// (runtime/Reference.h, GradCheck), and exits 1 when the first exceeds 1e-5 of the largest
// reference gradient (1e-4 on the GPU backends in fp32: another summation order; 5e-2 in bf16)
// or the second 1e-3 of a tensor's own (0.15 in bf16). After the last step it compares the
// weights, which took the same AdamW steps from the same gradients ("max_weight_diff=", of each
// weight's bound: 1e-3 of lr, plus per step 1e-5 of lr and 2^-20 of the weight; WeightCheck),
// and exits 1 past the bound: the optimizer steps differ; also when the tp ranks' copies of a
// tensor they all hold whole ("tp_copies=") or the dp replicas' weights ("dp_copies=") are not
// equal bit for bit. --dtype is the GPU backends' compute type
// (default: the plan's model's "dtype", fp32 or bf16); the cpu backend is the fp32 reference and
// refuses bf16. A plan that fails verification is refused (exit 1). --backend cuda needs a build
// with CUDA and a GPU; without either it exits 2 saying which. --backend nccl runs ONE rank per
// process (one process per GPU, started by torchrun, srun or an MPI's mpirun, whose variables it
// reads (RANK, WORLD_SIZE, LOCAL_RANK or the launcher's own: runtime/cuda/NcclLayout.h), with
// NCCL_COMM_ID=host:port when there are several; runtime/cuda/NcclRun.h); RANK 0 prints the
// losses and, with --check-reference, compares every process's gradients and last weights
// (gathered to it) with the single-rank reference. Both GPU backends size each rank's
// activation arena before step 0 with a host-only pass over its stream (runtime/cuda/CudaRun.h:
// nothing runs on the device, nothing trains), and print, before step 0, what each rank holds
// ("weights, gradients and optimizer state MiB ...", `pipec compile`'s static bytes) and its
// arena ("activation arena MiB ...").
// Every backend runs under the one training driver (runtime/Train.h). Checkpoints
// (runtime/Checkpoint.h, docs/reliability.md): --save-dir DIR saves after every --save-every
// N-th step and after the last, each crash-safe; --resume DIR continues from DIR's newest
// complete checkpoint (its step numbers, seed and data position), under this plan's layout and
// backend, whichever it was saved under, or starts at step 0 (saying so) where DIR holds none
// yet. --steps N is the step the job ends at: a resumed run continues to step N, and one
// resumed at or past it says so and exits 0, so the same command line relaunched after a kill
// finishes the job. --keep K keeps the newest K checkpoints (default: all), removing older ones
// once a newer one is committed. Each save prints "saved D/step-<8 digits> (step N, X MiB, Y s)";
// a save that cannot write (a full disk) removes what it wrote, leaves the earlier checkpoints
// whole and exits 2 naming the file and the bytes the checkpoint needs.
// Preemption (docs/reliability.md): on SIGTERM or SIGUSR1 every rank finishes the step in
// flight, they stop after the same step, save (with --save-dir), print one line and exit
// 128 + the signal (143 for SIGTERM, 138 for SIGUSR1); a second signal ends the process at once
// (the signal's default action).
// --init-from FILE|DIR (runtime/SafeTensors.h): the initial weights from a safetensors file in
// Hugging Face's GPT-2 or Llama names, or a Hugging Face model directory (config.json checked
// against the model, one or several shards), checked before step 0, on every backend.
// --export-hf DIR (runtime/HfExport.h): after the last step, the weights as a Hugging Face
// directory that transformers loads (sharded past --export-hf-shard-size, default 5GB).
// --profile FILE (runtime/Profile.h): every instruction timed, the first step dropped, and the
// measured costs written as pipecost/1 (ir/formats/Costs.h) for `pipec compile --costs`. With
// --steps N (N >= 3) the last line is "step time: measured median X ms over K steps, predicted Y ms
// (D%)", the prediction being the plan's streams as this runtime executes them
// (simulateExecutedStep). Exit codes: 0 ok, 1 a finding (wrong plan, gradient mismatch, stall), 2
// bad usage or input.
//
//===----------------------------------------------------------------------===//
#include "compiler/Verifier.h"
#include "ir/CostModel.h"
#include "ir/formats/HfConfig.h"
#include "ir/formats/PlanJson.h"
#include "ir/support/Bytes.h"
#include "ir/support/Error.h"
#include "ir/support/Files.h"
#include "ir/support/Stdout.h"
#include "runtime/Checkpoint.h"
#include "runtime/Data.h"
#include "runtime/HfExport.h"
#include "runtime/SafeTensors.h"
#include "runtime/Train.h"
#include "runtime/cpu/CpuRun.h"
#ifdef PIPEC_HAS_CUDA
#include "runtime/cuda/CudaRun.h"
#include "runtime/cuda/NcclRun.h"
#endif
#include "runtime/cuda/NcclLayout.h"
#include "tools/Args.h"
#include "tools/KernelEnv.h"
#include "tools/Options.h"

#include "llvm/Support/FileSystem.h"

#include <fmt/format.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <optional>

using namespace pipec;

namespace {

/// A line (or more) to standard output that never throws: a write error (a full disk, a closed
/// pipe) is reported once, at the end (runTool), and the run is not cut short by it.
template <typename... T> void say(fmt::format_string<T...> format, T &&...args) {
  sayToStdout(fmt::format(format, std::forward<T>(args)...));
}

/// Preemption: the first SIGTERM or SIGUSR1, for the driver to stop at after the step in flight
/// (TrainOptions::stopSignal), and the status piperun then exits with.
std::atomic<int> stopSignal{0};
static_assert(std::atomic<int>::is_always_lock_free, "set in a signal handler");
int stopStatus = 0;

/// Async-signal-safe: records the first signal; a second one takes the default action (the
/// process ends at once, killed by it).
void onStopSignal(int sig) {
  int none = 0;
  if (!stopSignal.compare_exchange_strong(none, sig)) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}

#ifdef PIPEC_HAS_CUDA
using RunOptions = CudaRunOptions; // the driver's options and the GPU backends'
#else
using RunOptions = TrainOptions;
#endif

/// What the flags ask for, read and checked before any file is: the driver's options (no
/// checkpoint opened, no weights loaded yet) and the rest of the flags.
struct Request {
  std::string backend;
  std::optional<std::string> computeFlag; // --dtype
  std::string dataDtype;
  std::optional<std::string> saveDir, resumeDir, initFrom, dataPath, profilePath;
  int saveEvery = 0, keep = 0;
  int endStep = 1; // --steps: the step the job ends at
  bool seedGiven = false, lrGiven = false;
  RunOptions options;
};

/// The flags' values (but the files they name), in the order of their checks.
llvm::Expected<Request> readFlags(const Args &args) {
  Request r;
  RunOptions &o = r.options;
  r.backend = args.get("--backend").value_or("cpu");
  if (r.backend == "cuda" || r.backend == "nccl") {
#ifdef PIPEC_HAS_CUDA
    if (auto devices = cudaDevices(); !devices)
      return inputError("--backend {}: no GPU ({}); use --backend cpu", r.backend,
                        takeMessage(devices.takeError()));
    // How the GPU backends' ops choose their kernels (the environment is read here alone).
    auto fromEnvironment = kernelConfigFromEnvironment();
    if (!fromEnvironment)
      return fromEnvironment.takeError();
    o.kernels = *fromEnvironment;
#else
    return inputError("--backend {}: this build has no CUDA (nvcc was not found when it was "
                      "built); use --backend cpu",
                      r.backend);
#endif
  }
  if (!args.isChoice("--backend", r.backend))
    return inputError("--backend: unknown backend '{}' (known: cpu, cuda, nccl); try cpu",
                      r.backend);
  r.computeFlag = args.get("--dtype");
  if (r.computeFlag && !args.isChoice("--dtype", *r.computeFlag))
    return inputError("--dtype: expected fp32 or bf16 (got '{}'); try --dtype {}", *r.computeFlag,
                      llvm::StringRef(*r.computeFlag).contains("16") ? "bf16" : "fp32");
  if (r.computeFlag && *r.computeFlag != "fp32" && r.backend == "cpu")
#ifdef PIPEC_HAS_CUDA
    return inputError("--dtype {}: the cpu backend computes in fp32 only (it is the reference); "
                      "use --backend cuda for {}, or drop --dtype",
                      *r.computeFlag, *r.computeFlag);
#else
    return inputError("--dtype {}: the cpu backend computes in fp32 only (it is the reference, "
                      "and this build has no GPU backend); drop --dtype",
                      *r.computeFlag);
#endif
  auto steps = args.integer("--steps");
  if (!steps)
    return steps.takeError();
  auto seed = args.integer("--seed");
  if (!seed)
    return seed.takeError();
  r.endStep = int(*steps);
  o.seed = uint64_t(*seed);
  r.seedGiven = args.has("--seed");
  o.checkReference = args.has("--check-reference");
  auto lr = args.real("--lr");
  if (!lr)
    return lr.takeError();
  if (*lr)
    o.lr = float(**lr);
  r.lrGiven = bool(*lr);
  auto timeout = args.real("--timeout");
  if (!timeout)
    return timeout.takeError();
  if (*timeout)
    o.timeoutSeconds = **timeout;
  auto dataDtype = args.choice("--data-dtype");
  if (!dataDtype)
    return dataDtype.takeError();
  r.dataDtype = dataDtype->value_or("uint16");
  auto saveEvery = args.integer("--save-every");
  if (!saveEvery)
    return saveEvery.takeError();
  r.saveEvery = int(*saveEvery);
  auto keep = args.integer("--keep");
  if (!keep)
    return keep.takeError();
  r.keep = int(*keep);
  // An empty path names nothing: an empty --export-hf skipped the export, and an empty
  // --resume started afresh.
  for (const char *flag :
       {"--save-dir", "--resume", "--export-hf", "--init-from", "--data", "--profile"})
    if (args.get(flag) == "")
      return inputError("{}: expected a path, got an empty one", flag);
  r.saveDir = args.path("--save-dir");
  r.resumeDir = args.path("--resume");
  for (const char *flag : {"--save-every", "--keep"})
    if (args.has(flag) && !r.saveDir)
      return inputError("{} needs --save-dir (where to save); try --save-dir ckpt", flag);
  if (args.has("--data-dtype") && !args.has("--data"))
    return inputError("--data-dtype needs --data (the token file it describes); try --data "
                      "tokens.bin, or drop --data-dtype");
  // With --resume too, --init-from is where a job starts that has no checkpoint yet (a
  // fine-tune's requeued command line): readInputs reads one or the other.
  r.initFrom = args.path("--init-from");
  if (r.saveDir)
    if (auto err = checkSaveDir(*r.saveDir, r.resumeDir.value_or("")))
      return err;
  if (auto dir = args.path("--export-hf")) {
    if (auto err = checkHfExportDir(*dir))
      return err;
    o.exportHfDir = *dir;
    o.onExported = [](const std::string &dir, int files) {
      say("exported the weights to {} ({} safetensors file{}, Hugging Face's layout)\n", dir, files,
          files == 1 ? "" : "s");
    };
  }
  // The export and the checkpoints each need a directory of their own: found at the end of the
  // run, a clash would cost the whole run.
  if (r.saveDir && !o.exportHfDir.empty()) {
    if (auto err =
            checkOutsideDirectories("--export-hf", o.exportHfDir, {{"--save-dir", *r.saveDir}}))
      return err;
    if (auto err =
            checkOutsideDirectories("--save-dir", *r.saveDir, {{"--export-hf", o.exportHfDir}}))
      return err;
  }
  auto shardBytes = args.bytes("--export-hf-shard-size");
  if (!shardBytes)
    return shardBytes.takeError();
  if (args.has("--export-hf-shard-size")) {
    if (o.exportHfDir.empty())
      return inputError("--export-hf-shard-size needs --export-hf (where to write); try "
                        "--export-hf model-out");
    if (*shardBytes < 1)
      return inputError("--export-hf-shard-size expects a positive size such as 5GB");
    o.exportHfShardBytes = uint64_t(*shardBytes);
  }
  r.dataPath = args.path("--data");
  r.profilePath = args.path("--profile");
  if (r.profilePath && r.endStep < 2)
    return inputError("--profile needs --steps 2 or more (the first step is dropped as "
                      "warm-up); try --steps 5");
  o.profile = r.profilePath.has_value();
  return r;
}

/// The files piperun reads (the plan, --data, --init-from FILE): what --profile's writer is
/// checked against.
std::vector<InputFile> inputFilesOf(const Request &r, const std::string &planPath) {
  std::vector<InputFile> files{{"plan", planPath}};
  if (r.dataPath)
    files.push_back({"--data", *r.dataPath});
  if (r.initFrom && !llvm::sys::fs::is_directory(*r.initFrom))
    files.push_back({"--init-from", *r.initFrom});
  return files;
}

/// --profile's file, before anything is read but the plan: not one of the files piperun reads,
/// nor inside a directory it reads or writes (--init-from DIR, --resume, --save-dir,
/// --export-hf), which a costs file would overwrite or corrupt.
llvm::Error checkProfilePath(const Request &r, const std::string &planPath) {
  std::vector<InputFile> dirs;
  if (r.initFrom && llvm::sys::fs::is_directory(*r.initFrom))
    dirs.push_back({"--init-from", *r.initFrom});
  if (r.resumeDir)
    dirs.push_back({"--resume", *r.resumeDir});
  if (r.saveDir)
    dirs.push_back({"--save-dir", *r.saveDir});
  if (!r.options.exportHfDir.empty())
    dirs.push_back({"--export-hf", r.options.exportHfDir});
  if (auto err = checkOutputPath("--profile", *r.profilePath, inputFilesOf(r, planPath)))
    return err;
  return checkOutsideDirectories("--profile", *r.profilePath, dirs);
}

/// The plan to run: loaded, verified, and one that piperun executes on `backend`.
llvm::Expected<Plan> readPlan(const std::string &path) {
  auto plan = loadPlan(path);
  if (!plan)
    return plan.takeError();
  if (auto err = verifyPlan(*plan))
    return finding("refusing to run a plan that fails verification: {}",
                   takeMessage(std::move(err)));
  if (plan->transformer && plan->transformer->recompute != Recompute::None)
    return inputError("the plan recomputes activations ($.transformer.recompute: \"{}\"), which "
                      "piperun does not execute; compile it with --recompute none",
                      toString(plan->transformer->recompute).str());
  if (plan->transformer && plan->transformer->fp8Gemms)
    return inputError("the plan's GEMMs are FP8 ($.transformer.gemm_precision: \"fp8\"), which "
                      "piperun does not execute; compile a model with \"gemm_precision\": "
                      "\"bf16\"");
  if (plan->transformer)
    for (auto [key, p] : {std::pair{"attention_dropout", plan->transformer->attentionDropout},
                          std::pair{"hidden_dropout", plan->transformer->hiddenDropout}})
      if (p > 0)
        return inputError("the plan's model has dropout ($.transformer.{}: {}), which piperun "
                          "does not execute; compile a model with \"{}\": 0",
                          key, p, key);
  for (auto [on, flag] :
       {std::pair{plan->parallel.sequenceParallel, "--sequence-parallel"},
        std::pair{plan->parallel.distributedOptimizer, "--distributed-optimizer"}})
    if (on)
      return inputError("the plan was compiled with {}, which piperun does not execute; compile "
                        "it without {}",
                        flag, flag);
  if (plan->parallel.cp > 1)
    return inputError("the plan was compiled with --cp {} ($.parallel.cp), which piperun does not "
                      "execute; compile it without --cp",
                      plan->parallel.cp);
  return std::move(*plan);
}

/// What a run starts from and reads: --init-from's weights (into `initWeights`), the checkpoint
/// to continue (into `resume`; its seed becomes the run's) and the data source.
llvm::Expected<std::unique_ptr<DataSource>> readInputs(Request &r, const Plan &plan,
                                                       const kernels::GptConfig &cfg,
                                                       std::vector<std::vector<float>> &initWeights,
                                                       std::optional<Checkpoint> &resume) {
  RunOptions &o = r.options;
  llvm::Expected<bool> holds = r.resumeDir ? holdsCheckpoint(*r.resumeDir) : false;
  if (!holds)
    return holds.takeError();
  // Initial weights: every tensor checked against the model before anything runs; not read
  // where the job continues from its own checkpoint.
  if (r.initFrom && *holds)
    say("--init-from {}: not read; the job continues from its checkpoint in {}\n", *r.initFrom,
        *r.resumeDir);
  else if (r.initFrom) {
    auto loaded = loadInitialWeights(*r.initFrom, cfg, *plan.transformer);
    if (!loaded)
      return loaded.takeError();
    initWeights = std::move(*loaded);
    o.initWeights = &initWeights;
    say("initial weights from {}\n", *r.initFrom);
  }
  // A checkpoint to continue: the same model and global batch (any layout), seed and data
  // (the token file's bytes, read here).
  std::unique_ptr<llvm::MemoryBuffer> tokens;
  o.dataName = "synthetic";
  if (r.dataPath) {
    auto read = readTokenFile(*r.dataPath, r.dataDtype);
    if (!read)
      return read.takeError();
    tokens = std::move(*read);
    o.dataName = dataSourceName(*r.dataPath, tokens->getBuffer());
  }
  // The same command line relaunched finishes the job: a --resume directory without a
  // checkpoint yet (the first launch's, or one killed before its first save) starts at step 0.
  if (r.resumeDir && !*holds) {
    say("--resume {}: no checkpoint yet; starting at step 0\n", *r.resumeDir);
  } else if (r.resumeDir) {
    auto opened = openCheckpoint(*r.resumeDir);
    if (!opened)
      return opened.takeError();
    std::optional<uint64_t> seedFlag;
    if (r.seedGiven)
      seedFlag = o.seed;
    if (auto err = checkResumable(*opened, plan, seedFlag, o.dataName))
      return err;
    o.seed = opened->manifest.seed;
    // The learning rate goes on as saved, unless --lr sets another from here on (said).
    if (std::optional<float> saved = opened->manifest.lr; saved && !r.lrGiven)
      o.lr = *saved;
    else if (saved && *saved != o.lr)
      say("note: --lr {} from step {} on; the checkpoint's run trained with --lr {}\n", o.lr,
          opened->manifest.step, *saved);
    resume = std::move(*opened);
    o.resume = &*resume;
    say("{}\n", describeResume(*resume, plan));
  }
  if (r.saveDir) {
    o.saveDir = *r.saveDir;
    o.saveEvery = r.saveEvery;
    o.keep = size_t(r.keep);
    o.onSaved = [keep = r.keep](int step, const std::string &path, const SavedCheckpoint &saved,
                                double seconds) {
      say("saved {} (step {}, {:.2f} MiB, {:.2f} s)\n", path, step, inMiB(saved.bytes), seconds);
      for (const std::string &left : saved.notRemoved)
        say("note: --keep {} left {}\n", keep, left);
      std::fflush(stdout);
    };
  }
  if (tokens)
    return tokenBytesData(tokens->getBuffer(), *r.dataPath, r.dataDtype, cfg.vocab, cfg.seqLen,
                          o.seed);
  return syntheticData(cfg.vocab, o.seed);
}

#ifdef PIPEC_HAS_CUDA
/// What each rank holds, allocated before step 0: its weights, gradients and optimizer state
/// (`pipec compile`'s static bytes), and the arena its steps allocate from (the sizing pass).
void printMemory(const CudaRunResult &sofar, const char *whose) {
  say("weights, gradients and optimizer state MiB ({}): {}\n", whose, mibColumns(sofar.stateBytes));
  say("activation arena MiB ({}; sized before step 0): {}\n", whose, mibColumns(sofar.arenaBytes));
}

/// The GPU backend `r` asks for, its compute type chosen and its first lines printed (in the
/// nccl mode by RANK 0 alone). `plan` keeps only this process's rank's stream in the nccl mode.
llvm::Expected<std::unique_ptr<TrainBackend>>
gpuBackend(Request &r, Plan &plan, const kernels::GptConfig &cfg, const DataSource &data,
           const std::string &ncclLine, std::optional<LaunchEnv> &env) {
  RunOptions &o = r.options;
  // Which type the GPU run computes in, and why (a model spec without "dtype" means bf16).
  const std::string computeType = r.computeFlag.value_or(plan.transformer->dtype);
  o.dtype = computeType == "bf16" ? kernels::DType::BF16 : kernels::DType::F32;
  auto printComputeType = [&] {
    if (r.computeFlag)
      say("compute type {} (--dtype)\n", computeType);
    else
      say("compute type {} (the model's \"dtype\"; --dtype {} to override)\n", computeType,
          computeType == "bf16" ? "fp32" : "bf16");
  };
  if (r.backend == "cuda") {
    printComputeType();
    o.onArenas = [](const CudaRunResult &sofar) {
      printMemory(sofar, "every rank, in RANK order");
    };
    return createCudaBackend(plan, cfg, data, o);
  }
  // Checked before anything else runs, so a misconfigured launch fails at once on every
  // process with the variable named.
  auto launch = launchEnvOf(plan, ::getenv);
  if (!launch)
    return launch.takeError();
  env = *launch;
  // One process runs one pipeline rank. The plan was read as a stream (no document in memory,
  // 40 bytes an instruction) and verified whole; the process keeps only its rank's stream.
  for (int rank = 0; rank < plan.numRanks(); ++rank)
    if (rank != env->coord.pp)
      std::vector<Instruction>().swap(plan.ranks[size_t(rank)]);
  if (env->rank == 0) {
    say("{}\n", ncclLine);
    say("launch: {} process{}, placed by {} (RANK 0 has {})\n", env->worldSize,
        env->worldSize == 1 ? "" : "es", env->launcher->name, env->describe());
    printComputeType();
    o.onArenas = [](const CudaRunResult &sofar) { printMemory(sofar, "this process's rank 0"); };
  }
  return createNcclBackend(plan, cfg, data, o, *env);
}
#endif

/// The last line with --steps N (N >= 3; docs/runtime.md#measured-against-predicted): the median
/// step (the first, a warm-up, dropped) against `predictedMs`, the plan simulated as piperun
/// executes it. Off by more than 5x either way (farther than a loaded machine's noise takes a
/// profiled plan), a note before it says how to predict this machine: the plan's stage times are
/// then another device's (the cluster it was compiled for).
std::optional<std::string> stepTimeLine(std::optional<double> predictedMs,
                                        const std::vector<double> &stepMs) {
  if (stepMs.size() < 3 || !predictedMs || !(*predictedMs > 0))
    return std::nullopt;
  const Measured m = summarizeSamples({stepMs.begin() + 1, stepMs.end()});
  const double ratio = m.medianMs / *predictedMs;
  std::string note;
  if (ratio > 5 || ratio < 0.2) {
    const double times = ratio > 1 ? ratio : 1 / ratio;
    note = fmt::format("note: the step ran {:.{}f}x {} than the plan's stage times predict: they "
                       "are not this machine's (the cluster's it was compiled for, or another "
                       "profile's); to predict this machine, run with --profile costs.json and "
                       "compile with --costs costs.json\n",
                       times, times < 10 ? 1 : 0, ratio > 1 ? "slower" : "faster");
  }
  return fmt::format("{}step time: measured median {:.2f} ms over {} steps, predicted {:.2f} ms "
                     "({:+.1f}%)",
                     note, m.medianMs, m.samples, *predictedMs, 100 * (ratio - 1));
}

llvm::Error run(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 1, piperunCommand()); // reportError names the tool
  if (!args)
    return args.takeError();
  if (args->positional().size() != 1)
    return inputError("expected one plan file (got {}); usage: piperun plan.json --backend cpu",
                      args->positional().size());
  std::string ncclLine;
#ifdef PIPEC_HAS_CUDA
  // Before the first CUDA or NCCL call, and so before any thread the driver may start: it may
  // set an environment variable. Printed by RANK 0.
  if (args->get("--backend") == "nccl")
    ncclLine = prepareNcclEnvironment(
        ::getenv, [](const char *name, const char *value) { (void)::setenv(name, value, 0); });
#endif
  auto request = readFlags(*args);
  if (!request)
    return request.takeError();
  Request &r = *request;
  const std::string planPath = userPath(args->positional().front());
  auto plan = readPlan(planPath);
  if (!plan)
    return plan.takeError();
  if (r.profilePath)
    if (auto err = checkProfilePath(r, planPath))
      return err;
  // The prediction of the last line: the plan's stage times (measured ones when it was compiled
  // with --costs) on its streams as they run here (before the nccl mode drops other ranks').
  std::optional<double> predictedMs;
  if (plan->timeUnit == "ms") {
    if (auto step = simulateExecutedStep(*plan))
      predictedMs = *step;
    else
      llvm::consumeError(step.takeError());
  }
  auto cfg = gptConfigOf(*plan);
  if (!cfg)
    return cfg.takeError();
  // --export-hf writes GPT-2's or Llama's block (what transformers loads): known before step 0.
  if (!r.options.exportHfDir.empty())
    if (auto config = hfConfigJson(*plan->transformer); !config)
      return config.takeError();
#ifdef PIPEC_HAS_CUDA
  if (r.backend != "cpu")
    if (auto err = gpuRunsTheBlock(*cfg, *plan, r.backend))
      return err;
#endif
  // The GPU backends' compute type: --dtype, else the model's.
  const std::string computeType = r.computeFlag.value_or(plan->transformer->dtype);
  if (r.backend != "cpu" && computeType != "fp32" && computeType != "bf16")
    return inputError("the plan's model has \"dtype\": \"{}\", which --backend {} does not "
                      "compute in; pass --dtype bf16 (or --dtype fp32)",
                      computeType, r.backend);
  std::vector<std::vector<float>> initWeights;
  std::optional<Checkpoint> resume;
  auto data = readInputs(r, *plan, *cfg, initWeights, resume);
  if (!data)
    return data.takeError();
  // --steps N: the job ends at step N, wherever it starts.
  const int first = resume ? int(resume->manifest.step) : 0;
  if (first >= r.endStep) {
    // A job killed after its last save but before its export: the relaunch exports the
    // checkpoint's weights (the same command line finishes the job).
    const bool exporting = !r.options.exportHfDir.empty();
    say("{} is at step {}, at or past --steps {}: nothing to train{}{}\n", resume->path, first,
        r.endStep, exporting ? "; exporting its weights" : "",
        r.profilePath ? fmt::format("; nothing to time, so {} is not written", *r.profilePath)
                      : std::string());
    // What a kill during the last save's pruning left: the finished job's relaunch prunes.
    if (r.saveDir && llvm::sys::fs::is_directory(*r.saveDir)) {
      auto left = pruneCheckpoints(*r.saveDir, size_t(r.keep));
      if (!left)
        return left.takeError();
      for (const std::string &step : *left)
        say("note: --keep {} left {}\n", r.keep, step);
    }
    if (!exporting)
      return llvm::Error::success();
    r.profilePath.reset(); // (nothing is timed)
    r.options.profile = false;
  }
  r.options.steps = std::max(0, r.endStep - first);
  // --profile times the steps this launch trains, the first dropped: a resumed job may train
  // fewer than --steps (its costs file would hold no samples, which --costs refuses).
  if (r.profilePath && r.options.steps < 2)
    return inputError("--profile needs 2 or more steps to train, and {} is at step {} of "
                      "--steps {} (the first is dropped as warm-up); try --steps {}",
                      resume->path, first, r.endStep, first + 5);
  r.options.stopSignal = &stopSignal;
  // The backend, and the tolerances of its reference check: relative to the largest reference
  // gradient, and to each tensor's own (GradCheck).
  std::unique_ptr<TrainBackend> backend;
  double relative = 1e-5, perTensor = kTensorGradTolerance;
  std::optional<LaunchEnv> env; // (the nccl mode's; the backend keeps a reference)
  if (r.backend == "cpu") {
    backend = createCpuBackend(*plan, *cfg, **data, r.options);
  } else {
#ifdef PIPEC_HAS_CUDA
    auto gpu = gpuBackend(r, *plan, *cfg, **data, ncclLine, env);
    if (!gpu)
      return gpu.takeError();
    backend = std::move(*gpu);
    relative = cudaGradTolerance(r.options.dtype);
    perTensor = cudaTensorGradTolerance(r.options.dtype);
#endif
  }
  // One run saves into a directory at a time: the lead (the process that writes) locks it for
  // its life before the first step; a second launch is refused here, before it trains.
  if (r.saveDir && backend->leads())
    if (auto lock = lockSaveDir(*r.saveDir); !lock) // (its descriptor is never closed)
      return lock.takeError();
  auto result = train(*plan, *cfg, **data, *backend, r.options, [](int step, double loss) {
    say("step {} loss {:.6f}\n", step, loss);
    std::fflush(stdout);
  });
  if (!result)
    return result.takeError();
  if (int sig = result->stopSignal) {
    stopStatus = 128 + sig;
    std::string saved = "not saved (no --save-dir)";
    if (r.saveDir)
      saved = fmt::format("saved {} (relaunch with --resume {} to continue)",
                          checkpointPath(*r.saveDir, result->stoppedAt), *r.saveDir);
    if (backend->leads()) // (one line, as the process ends: on standard error)
      std::fputs(fmt::format("piperun: {}: stopped after step {}, {}; exit status {}\n",
                             sig == SIGTERM ? "SIGTERM" : "SIGUSR1", result->stoppedAt - 1, saved,
                             stopStatus)
                     .c_str(),
                 stderr);
    return llvm::Error::success();
  }
  say("{}", backend->summary());
  if (result->costs) {
    if (auto err = writeCosts(*r.profilePath, *result->costs, inputFilesOf(r, planPath)))
      return err;
    const int timed = result->costs->steps - 1;
    say("measured costs written to {} ({} step{} after the warm-up)\n", *r.profilePath, timed,
        timed == 1 ? "" : "s");
  }
  // (With --backend nccl only RANK 0 runs the reference.)
  llvm::Error judged = llvm::Error::success();
  if (r.options.checkReference && !result->referenceLosses.empty()) {
    say("reference loss (last step) {:.6f}\n", result->referenceLosses.back());
    say("{}", referenceCheckReport(result->grads, result->weights));
    judged = judgeReferenceCheck(result->grads, result->weights, relative, perTensor);
  }
  if (backend->leads())
    if (auto line = stepTimeLine(predictedMs, result->stepMs))
      say("{}\n", *line);
  return judged;
}

} // namespace

int main(int argc, char **argv) {
  // Line-buffered, also into a file: a launcher's log keeps every line printed before a crash
  // or a kill (tools/gpu_check.sh reads them), and the lines are few.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  // A closed pipe on standard output is a write error (exit 2 with its line), not a signal.
  std::signal(SIGPIPE, SIG_IGN);
  // Past a file size limit (`ulimit -f`, which Slurm passes on to jobs), a write fails with
  // EFBIG, reported as a full disk is (exit 2 with the line), instead of SIGXFSZ killing the
  // process mid-save.
  std::signal(SIGXFSZ, SIG_IGN);
  if (argc < 2) {
    std::fputs(commandHelp(piperunCommand()).c_str(), stdout);
    return reportError("piperun", inputError("expected a plan file; usage above"));
  }
  // --help or -h anywhere (as pipec's commands take it): the usage, exit 0.
  for (int i = 1; i < argc; ++i)
    if (llvm::StringRef(argv[i]) == "-h" || llvm::StringRef(argv[i]) == "--help") {
      std::fputs(commandHelp(piperunCommand()).c_str(), stdout);
      return finishTool("piperun", llvm::Error::success());
    }
  struct sigaction stop = {};
  stop.sa_handler = onStopSignal;
  stop.sa_flags = SA_RESTART;
  sigemptyset(&stop.sa_mask);
  for (int sig : {SIGTERM, SIGUSR1})
    sigaction(sig, &stop, nullptr);
  // The checkpoint library's test hook (runtime/Checkpoint.h): libraries read no environment.
  if (const char *killAt = std::getenv("PIPEC_CHECKPOINT_KILL_AT"))
    setCheckpointKillAt(std::atol(killAt));
  int code = runTool("piperun", [&] { return run(argc, argv); });
  return code == 0 && stopStatus ? stopStatus : code;
}
