//===- piperun.cpp - Run a compiled plan ----------------------------------===//
//
//   piperun plan.json --backend cpu|cuda|nccl [--dtype fp32|bf16] [--steps N]
//           [--check-reference] [--seed S] [--data FILE [--data-dtype uint16|uint32]] [--lr LR]
//           [--timeout SECONDS]
// Prints "step N loss X" per step; with --check-reference also the single-rank reference's
// loss, "max_abs_grad_diff=<value>" and "max_tensor_grad_diff=<value>" with the places of both
// (runtime/cpu/Reference.h, GradCheck), and exits 1 when the first exceeds 1e-5 of the largest
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
// Checkpoints (cpu backend; runtime/Checkpoint.h, docs/reliability.md): --save-dir DIR saves
// after every --save-every N-th step and after the last, each crash-safe; --resume DIR continues
// from DIR's newest complete checkpoint (its step numbers, seed and data position; --steps
// counts the steps of this run), under this plan's layout, whichever it was saved under.
// --init-from FILE (runtime/SafeTensors.h): the initial weights from a safetensors file in
// Hugging Face's GPT-2 or Llama names, checked against the model before step 0, on every
// backend.
// Exit codes: 0 ok, 1 a finding (wrong plan, gradient mismatch, stall), 2 bad usage or input.
//
//===----------------------------------------------------------------------===//
#include "compiler/Verifier.h"
#include "ir/Error.h"
#include "ir/PlanJson.h"
#include "runtime/Checkpoint.h"
#include "runtime/Data.h"
#include "runtime/SafeTensors.h"
#include "runtime/cpu/CpuRun.h"
#ifdef PIPEC_HAS_CUDA
#include "runtime/cuda/CudaRun.h"
#include "runtime/cuda/NcclRun.h"
#endif
#include "runtime/cuda/NcclLayout.h"
#include "tools/Args.h"
#include "tools/KernelEnv.h"

#include <fmt/format.h>

#include <csignal>
#include <cstdio>
#include <optional>

using namespace pipec;

namespace {

/// A line (or more) to standard output that never throws: a write error (a full disk, a closed
/// pipe) is reported once, at the end (runTool), and the run is not cut short by it.
template <typename... T> void say(fmt::format_string<T...> format, T &&...args) {
  sayToStdout(fmt::format(format, std::forward<T>(args)...));
}

const char *kUsage =
    R"(usage: piperun plan.json --backend cpu|cuda|nccl [--dtype fp32|bf16] [--steps N]
               [--check-reference] [--seed S] [--data FILE [--data-dtype uint16|uint32]]
               [--lr LR] [--timeout SECONDS]
               [--save-dir DIR [--save-every N]] [--resume DIR] [--init-from FILE]
)";

llvm::Error run(int argc, char **argv) {
  auto args =
      Args::parse(argc, argv, 1,
                  {"--backend", "--dtype", "--steps", "--seed", "--data", "--data-dtype", "--lr",
                   "--timeout", "--save-dir", "--save-every", "--resume", "--init-from"},
                  {"--check-reference"}, /*command=*/""); // reportError names the tool
  if (!args)
    return args.takeError();
  if (args->positional().size() != 1)
    return inputError("expected one plan file (got {}); usage: piperun plan.json --backend cpu",
                      args->positional().size());
  std::string backend = args->get("--backend").value_or("cpu");
#ifdef PIPEC_HAS_CUDA
  // Before the first CUDA or NCCL call, and so before any thread the driver may start: it may
  // set an environment variable. Printed by RANK 0 below.
  const std::string ncclLine = backend == "nccl" ? prepareNcclEnvironment() : "";
#endif
  // How the GPU backends' ops choose their kernels (the environment is read here alone).
  kernels::cuda::KernelConfig kernelConfig;
  if (backend == "cuda" || backend == "nccl") {
#ifdef PIPEC_HAS_CUDA
    if (auto devices = cudaDevices(); !devices)
      return inputError("--backend {}: no GPU ({}); use --backend cpu", backend,
                        takeMessage(devices.takeError()));
    auto fromEnvironment = kernelConfigFromEnvironment();
    if (!fromEnvironment)
      return fromEnvironment.takeError();
    kernelConfig = *fromEnvironment;
#else
    return inputError("--backend {}: this build has no CUDA (nvcc was not found when it was "
                      "built); use --backend cpu",
                      backend);
#endif
  }
  if (backend != "cpu" && backend != "cuda" && backend != "nccl")
    return inputError("--backend: unknown backend '{}' (known: cpu, cuda, nccl); try cpu", backend);
  const std::optional<std::string> computeFlag = args->get("--dtype");
  if (computeFlag && *computeFlag != "fp32" && *computeFlag != "bf16")
    return inputError("--dtype: expected fp32 or bf16 (got '{}'); try --dtype {}", *computeFlag,
                      llvm::StringRef(*computeFlag).contains("16") ? "bf16" : "fp32");
  if (computeFlag && *computeFlag != "fp32" && backend == "cpu")
#ifdef PIPEC_HAS_CUDA
    return inputError("--dtype {}: the cpu backend computes in fp32 only (it is the reference); "
                      "use --backend cuda for {}, or drop --dtype",
                      *computeFlag, *computeFlag);
#else
    return inputError("--dtype {}: the cpu backend computes in fp32 only (it is the reference, "
                      "and this build has no GPU backend); drop --dtype",
                      *computeFlag);
#endif
  auto steps = args->integer("--steps", 1, 1, 1000000);
  if (!steps)
    return steps.takeError();
  auto seed = args->integer("--seed", 1, 0, INT64_MAX);
  if (!seed)
    return seed.takeError();
  CpuRunOptions o;
  o.steps = int(*steps);
  o.seed = uint64_t(*seed);
  o.checkReference = args->has("--check-reference");
  for (auto [flag, out] : {std::pair{"--lr", &o.lr}}) {
    if (auto v = args->get(flag)) {
      double d = 0;
      if (llvm::StringRef(*v).getAsDouble(d) || !(d > 0) || d > 10)
        return inputError("{} expects a positive number such as 1e-3 (got '{}')", flag, *v);
      *out = float(d);
    }
  }
  if (auto v = args->get("--timeout")) {
    double d = 0;
    if (llvm::StringRef(*v).getAsDouble(d) || !(d > 0))
      return inputError("--timeout expects seconds > 0 such as 30 (got '{}')", *v);
    o.timeoutSeconds = d;
  }
  std::string dtype = args->get("--data-dtype").value_or("uint16");
  if (dtype != "uint16" && dtype != "uint32")
    return inputError("--data-dtype: expected uint16 or uint32 (got '{}')", dtype);

  auto saveEvery = args->integer("--save-every", 0, 1, 1000000);
  if (!saveEvery)
    return saveEvery.takeError();
  const std::optional<std::string> saveDir = args->path("--save-dir"),
                                   resumeDir = args->path("--resume");
  if (args->has("--save-every") && !saveDir)
    return inputError("--save-every needs --save-dir (where to save); try --save-dir ckpt");
  if ((saveDir || resumeDir) && backend != "cpu")
    return inputError("{}: checkpoints are saved and resumed by the cpu backend only (the {} "
                      "backend does not yet); use --backend cpu",
                      saveDir ? "--save-dir" : "--resume", backend);
  const std::optional<std::string> initFrom = args->path("--init-from");
  if (initFrom && resumeDir)
    return inputError("--init-from and --resume both set the weights; give one (a resume "
                      "continues from the checkpoint's own)");
  if (saveDir)
    if (auto err = checkSaveDir(*saveDir, resumeDir.value_or("")))
      return err;
  const std::string planPath = userPath(args->positional().front());
  auto plan = loadPlan(planPath);
  if (!plan)
    return plan.takeError();
  if (auto err = verifyPlan(*plan))
    return finding("refusing to run a plan that fails verification: {}",
                   takeMessage(std::move(err)));
  if (plan->transformer && plan->transformer->recompute != Recompute::None)
    return inputError("the plan recomputes activations ($.transformer.recompute: \"{}\"), which "
                      "piperun does not execute; compile it with --recompute none",
                      toString(plan->transformer->recompute).str());
  for (auto [on, flag] :
       {std::pair{plan->parallel.sequenceParallel, "--sequence-parallel"},
        std::pair{plan->parallel.distributedOptimizer, "--distributed-optimizer"}})
    if (on)
      return inputError("the plan was compiled with {}, which piperun does not execute; compile "
                        "it without {}",
                        flag, flag);
  auto cfg = gptConfigOf(*plan);
  if (!cfg)
    return cfg.takeError();
#ifdef PIPEC_HAS_CUDA
  if (backend != "cpu")
    if (auto err = gpuRunsTheBlock(*cfg, *plan, backend))
      return err;
#endif
  // The GPU backends' compute type: --dtype, else the model's.
  const std::string computeType = computeFlag.value_or(plan->transformer->dtype);
  if (backend != "cpu" && computeType != "fp32" && computeType != "bf16")
    return inputError("the plan's model has \"dtype\": \"{}\", which --backend {} does not "
                      "compute in; pass --dtype bf16 (or --dtype fp32)",
                      computeType, backend);
  // Initial weights: every tensor checked against the model before anything runs.
  std::vector<std::vector<float>> initWeights;
  if (initFrom) {
    auto loaded = loadInitialWeights(*initFrom, *cfg);
    if (!loaded)
      return loaded.takeError();
    initWeights = std::move(*loaded);
    o.initWeights = &initWeights;
    say("initial weights from {}\n", *initFrom);
  }
  // A checkpoint to continue: the same model and global batch (any layout), seed and data.
  std::optional<Checkpoint> resume;
  std::string dataName = "synthetic";
  if (auto path = args->path("--data"))
    dataName = dataSourceName(*path);
  if (resumeDir) {
    auto opened = openCheckpoint(*resumeDir);
    if (!opened)
      return opened.takeError();
    std::optional<uint64_t> seedFlag;
    if (args->has("--seed"))
      seedFlag = uint64_t(*seed);
    if (auto err = checkResumable(*opened, *plan, seedFlag, dataName))
      return err;
    o.seed = opened->manifest.seed;
    resume = std::move(*opened);
    o.resume = &*resume;
    say("{}\n", describeResume(*resume, *plan));
  }
  if (saveDir) {
    o.saveDir = *saveDir;
    o.saveEvery = int(*saveEvery);
    o.onSaved = [](int step, const std::string &path) {
      say("saved checkpoint after step {}: {}\n", step, path);
      std::fflush(stdout);
    };
  }
  o.dataName = dataName;
  std::unique_ptr<DataSource> data;
  if (auto path = args->path("--data")) {
    auto loaded = tokenFileData(*path, dtype, cfg->vocab, cfg->seqLen, o.seed);
    if (!loaded)
      return loaded.takeError();
    data = std::move(*loaded);
  } else {
    data = syntheticData(cfg->vocab, o.seed);
  }
  auto printStep = [](int step, double loss) {
    say("step {} loss {:.6f}\n", step, loss);
    std::fflush(stdout);
  };
  // The reference check's report, the same for both backends' results.
  // `relative`: the tolerance as a fraction of the largest reference gradient; `perTensor`: as a
  // fraction of each tensor's own (GradCheck).
  auto check = [&](const auto &result, double relative, double perTensor) -> llvm::Error {
    // (With --backend nccl only RANK 0 runs the reference.)
    if (!o.checkReference || result.referenceLosses.empty())
      return llvm::Error::success();
    say("reference loss (last step) {:.6f}\n", result.referenceLosses.back());
    say("{}", referenceCheckReport(result.grads, result.weights));
    return judgeReferenceCheck(result.grads, result.weights, relative, perTensor);
  };
#ifdef PIPEC_HAS_CUDA
  const kernels::DType computeDType =
      computeType == "bf16" ? kernels::DType::BF16 : kernels::DType::F32;
  // Which type the GPU run computes in, and why (a model spec without "dtype" means bf16).
  auto printComputeType = [&] {
    if (computeFlag)
      say("compute type {} (--dtype)\n", computeType);
    else
      say("compute type {} (the model's \"dtype\"; --dtype {} to override)\n", computeType,
                 computeType == "bf16" ? "fp32" : "bf16");
  };
  // What each rank holds, allocated before step 0: its weights, gradients and optimizer state
  // (`pipec compile`'s static bytes), and the arena its steps allocate from (the sizing pass).
  auto printMemory = [](const CudaRunResult &sofar, const char *whose) {
    auto mib = [](const std::vector<size_t> &all) {
      std::string sizes;
      for (size_t bytes : all)
        sizes += fmt::format("{}{:.2f}", sizes.empty() ? "" : " ", double(bytes) / (1 << 20));
      return sizes;
    };
    say("weights, gradients and optimizer state MiB ({}): {}\n", whose,
               mib(sofar.stateBytes));
    say("activation arena MiB ({}; sized before step 0): {}\n", whose,
               mib(sofar.arenaBytes));
  };
#endif
  if (backend == "nccl") {
    // Checked before anything else runs, so a misconfigured launch fails at once on every
    // process with the variable named.
    auto env = launchEnvOf(*plan);
    if (!env)
      return env.takeError();
    // One process runs one pipeline rank. The plan was read as a stream (no document in
    // memory, 40 bytes an instruction) and verified whole above; the process keeps only its
    // rank's stream for the run.
    for (int r = 0; r < plan->numRanks(); ++r)
      if (r != env->coord.pp)
        std::vector<Instruction>().swap(plan->ranks[size_t(r)]);
#ifdef PIPEC_HAS_CUDA
    CudaRunOptions co;
    co.steps = o.steps;
    co.seed = o.seed;
    co.lr = o.lr;
    co.initWeights = o.initWeights;
    co.checkReference = o.checkReference;
    co.timeoutSeconds = o.timeoutSeconds;
    co.dtype = computeDType;
    co.kernels = kernelConfig;
    if (env->rank == 0) {
      say("{}\n", ncclLine);
      say("launch: {} process{}, placed by {} (RANK 0 has {})\n", env->worldSize,
                 env->worldSize == 1 ? "" : "es", env->launcher->name, env->describe());
      printComputeType();
    }
    if (env->rank == 0)
      co.onArenas = [&](const CudaRunResult &sofar) {
        printMemory(sofar, "this process's rank 0");
      };
    auto result = runOnNccl(*plan, *data, co, *env, printStep);
    if (!result)
      return result.takeError();
    return check(*result, cudaGradTolerance(co.dtype), cudaTensorGradTolerance(co.dtype));
#endif
  }
#ifdef PIPEC_HAS_CUDA
  if (backend == "cuda") {
    CudaRunOptions co;
    co.steps = o.steps;
    co.seed = o.seed;
    co.lr = o.lr;
    co.initWeights = o.initWeights;
    co.checkReference = o.checkReference;
    co.timeoutSeconds = o.timeoutSeconds;
    co.dtype = computeDType;
    co.kernels = kernelConfig;
    printComputeType();
    co.onArenas = [&](const CudaRunResult &sofar) {
      printMemory(sofar, "every rank, in RANK order");
    };
    auto result = runOnCuda(*plan, *data, co, printStep);
    if (!result)
      return result.takeError();
    return check(*result, cudaGradTolerance(co.dtype), cudaTensorGradTolerance(co.dtype));
  }
#endif
  auto result = runOnCpu(*plan, *data, o, printStep);
  if (!result)
    return result.takeError();
  {
    std::string held;
    for (size_t bytes : result->heldBytes)
      held += fmt::format("{}{:.2f}", held.empty() ? "" : " ", double(bytes) / (1 << 20));
    fmt::print("activations held MiB (every rank, in RANK order; the most between kernel "
               "calls): {}\n",
               held);
  }
  return check(*result, 1e-5, kTensorGradTolerance);
}

} // namespace

int main(int argc, char **argv) {
  // Line-buffered, also into a file: a launcher's log keeps every line printed before a crash
  // or a kill (tools/gpu_check.sh reads them), and the lines are few.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  // A closed pipe on standard output is a write error (exit 2 with its line), not a signal.
  std::signal(SIGPIPE, SIG_IGN);
  if (argc < 2) {
    std::fputs(kUsage, stdout);
    return reportError("piperun", inputError("expected a plan file; usage above"));
  }
  llvm::StringRef first = argv[1];
  if (first == "-h" || first == "--help") {
    std::fputs(kUsage, stdout);
    return finishTool("piperun", llvm::Error::success());
  }
  return runTool("piperun", [&] { return run(argc, argv); });
}
