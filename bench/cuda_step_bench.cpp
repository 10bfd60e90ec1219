//===- cuda_step_bench.cpp - Training steps of a GPT on the cuda backend, in TFLOP/s -===//
//
// The whole runtime at a size where the kernels matter: a GPT (default 8 blocks, hidden 1024,
// 16 heads of 64, ffn 4096, vocab 32768, 2048 tokens, microbatch 4) compiled with --schedule
// over --pp ranks and --microbatches, run by the cuda backend (every rank a thread and a compute
// stream of one GPU, the local transport, the arenas sized before step 0) in --dtype (default
// bf16), on the synthetic token stream. Reports the mean time of the steps after the first,
// tokens/s and the model FLOP rate: the FLOPs of a step by
// docs/contracts.md#model-spec-pipemodel1's formulas (per block and sub-sequence F + B + W = 3 b x
// (8h^2 + 4hf) + 12 b h sum(t + 1), plus the LM head's 6 b x h V) over the step time, also as a
// fraction of the H200's dense peak (bf16: 989.5 TFLOP/s; fp32, which is strict fp32 here: 66.9).
// All ranks share one GPU, so their streams fill each other's bubbles: this measures the kernels
// and the runtime, not the schedule.
//   bazel run -c opt //bench:cuda_step_bench -- --pp 2 --microbatches 8
// --tiny runs examples/tiny-gpt.json's sizes for two steps (the emulated device's smoke run in
// CI). Needs a GPU otherwise; not a test: the numbers go into docs/benchmarks.md. The kernels are
// configured from the environment as piperun's are (tools/KernelEnv.h: PIPEC_ATTENTION_WGMMA=0
// measures the mma.sync attention forward on a Hopper GPU).
//
//===----------------------------------------------------------------------===//
#include "compiler/Pass.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"
#include "runtime/Data.h"
#include "runtime/cuda/CudaRun.h"
#include "tools/Args.h"
#include "tools/KernelEnv.h"

#include <fmt/format.h>

#include <chrono>
#include <vector>

using namespace pipec;

namespace {

constexpr double kPeakBf16 = 989.5e12; // H100/H200 SXM, dense bf16 tensor cores
constexpr double kPeakFp32 = 66.9e12;  // the same, fp32 without tensor cores (strict fp32)

struct Sizes {
  int64_t layers = 8, hidden = 1024, heads = 16, ffn = 4096, vocab = 32768, seq = 2048, batch = 4;
};

/// FLOPs of one training step of `plan` (forward and backward of every microbatch of every dp
/// replica), docs/contracts.md#model-spec-pipemodel1.
double stepFlops(const Sizes &z, const Plan &plan) {
  const double h = double(z.hidden), f = double(z.ffn), b = double(z.batch);
  double perSequence = 0; // one microbatch through every block and the head
  for (auto [begin, end] : plan.seqSlices) {
    const double x = double(end - begin);
    const double positions =
        (double(end) * double(end + 1) - double(begin) * double(begin + 1)) / 2;
    perSequence +=
        double(z.layers) * (3 * b * x * (8 * h * h + 4 * h * f) + 12 * b * h * positions);
    perSequence += 6 * b * x * h * double(z.vocab);
  }
  return perSequence * double(plan.parallel.microbatches) * double(plan.parallel.dp);
}

int fail(llvm::Error err, int code) {
  fmt::print(stderr, "cuda_step_bench: {}\n", takeMessage(std::move(err)));
  return code;
}

} // namespace

int main(int argc, char **argv) {
  auto args = Args::parse(argc, argv, 1,
                          {"--schedule", "--pp", "--vpp", "--microbatches", "--seq-splits", "--tp",
                           "--dp", "--dtype", "--steps", "--layers", "--hidden", "--heads", "--ffn",
                           "--vocab", "--seq", "--microbatch-size"},
                          {"--tiny"}, /*command=*/"");
  if (!args)
    return fail(args.takeError(), 2);
  const bool tiny = args->has("--tiny");
  Sizes d;
  if (tiny)
    d = Sizes{4, 32, 4, 128, 64, 16, 2};
  auto layers = args->integer("--layers", d.layers, 1, 256);
  auto hidden = args->integer("--hidden", d.hidden, 1, 4096);
  auto heads = args->integer("--heads", d.heads, 1, 4096);
  auto ffn = args->integer("--ffn", d.ffn, 1, 1 << 16);
  auto vocab = args->integer("--vocab", d.vocab, 2, 1 << 20);
  auto seq = args->integer("--seq", d.seq, 1, 8192);
  auto batch = args->integer("--microbatch-size", d.batch, 1, 64);
  auto pp = args->integer("--pp", 2, 1, 64);
  auto vpp = args->integer("--vpp", 1, 1, 16);
  auto m = args->integer("--microbatches", tiny ? 4 : 8, 1, 1 << 16);
  auto splits = args->integer("--seq-splits", 1, 1, 64);
  auto tp = args->integer("--tp", 1, 1, 64);
  auto dp = args->integer("--dp", 1, 1, 64);
  auto steps = args->integer("--steps", tiny ? 2 : 5, 2, 1000);
  for (auto *v : {&layers, &hidden, &heads, &ffn, &vocab, &seq, &batch, &pp, &vpp, &m, &splits, &tp,
                  &dp, &steps})
    if (!*v)
      return fail(v->takeError(), 2);
  const std::string dtypeName = args->get("--dtype").value_or("bf16");
  if (dtypeName != "bf16" && dtypeName != "fp32")
    return fail(inputError("--dtype: expected fp32 or bf16 (got '{}')", dtypeName), 2);
  const Sizes z{*layers, *hidden, *heads, *ffn, *vocab, *seq, *batch};
  if (z.hidden % z.heads != 0 || z.hidden / z.heads > 256)
    return fail(inputError("--hidden {} must be a multiple of --heads {} with a quotient (the "
                           "head dimension) of at most 256",
                           z.hidden, z.heads),
                2);

  auto devices = cudaDevices();
  if (!devices)
    return fail(inputError("no usable CUDA device ({})", takeMessage(devices.takeError())), 2);
  auto model = parseModelSpec(
      fmt::format(R"({{"format": "pipemodel/1", "name": "step-bench", "transformer": {{
          "num_layers": {}, "hidden_size": {}, "num_attention_heads": {}, "ffn_hidden_size": {},
          "vocab_size": {}, "seq_length": {}, "microbatch_size": {}, "dtype": "{}"}}}})",
                  z.layers, z.hidden, z.heads, z.ffn, z.vocab, z.seq, z.batch, dtypeName),
      "cuda_step_bench");
  if (!model)
    return fail(model.takeError(), 2);
  CompileOptions o;
  o.schedule = args->get("--schedule").value_or("1f1b");
  o.parallel.pp = int(*pp);
  o.parallel.vpp = int(*vpp);
  o.parallel.microbatches = int(*m);
  o.parallel.seqSplits = int(*splits);
  o.parallel.tp = int(*tp);
  o.parallel.dp = int(*dp);
  auto plan = compilePlan(*model, ClusterSpec::defaults(), o);
  if (!plan)
    return fail(plan.takeError(), 2);

  auto kernelConfig = kernelConfigFromEnvironment();
  if (!kernelConfig)
    return fail(kernelConfig.takeError(), 2);
  CudaRunOptions run;
  run.kernels = *kernelConfig;
  run.steps = int(*steps);
  run.dtype = dtypeName == "bf16" ? kernels::DType::BF16 : kernels::DType::F32;
  run.timeoutSeconds = 600;
  auto data = syntheticData(int(z.vocab), /*seed=*/1);
  using Clock = std::chrono::steady_clock;
  std::vector<Clock::time_point> ends; // per step, when its loss was read (the device is idle)
  double lastLoss = 0;
  auto result = runOnCuda(*plan, *data, run, [&](int, double loss) {
    ends.push_back(Clock::now());
    lastLoss = loss;
  });
  if (!result)
    return fail(result.takeError(), 1);
  // Step 0 pays the one-time costs (cuBLASLt's first heuristic queries of every shape, the first
  // launch of each kernel, the arena's first touch): time steps 1.. from the end of step 0.
  const double seconds =
      std::chrono::duration<double>(ends.back() - ends.front()).count() / double(ends.size() - 1);
  const double flops = stepFlops(z, *plan);
  const double tokens = double(z.batch) * double(z.seq) * double(*m) * double(*dp);
  const double peak = run.dtype == kernels::DType::BF16 ? kPeakBf16 : kPeakFp32;
  double arena = 0;
  for (size_t bytes : result->arenaBytes)
    arena += double(bytes);
  fmt::print("model layers={} hidden={} heads={} ffn={} vocab={} seq={} microbatch={} | "
             "schedule={} pp={} vpp={} m={} seq_splits={} tp={} dp={} dtype={}\n",
             z.layers, z.hidden, z.heads, z.ffn, z.vocab, z.seq, z.batch, o.schedule, *pp, *vpp, *m,
             *splits, *tp, *dp, dtypeName);
  fmt::print("step={:.2f}ms tokens/s={:.0f} model_tflops={:.1f} ({:.1f}% of the H200's dense {} "
             "peak) arenas={:.0f}MiB last_loss={:.4f}\n",
             seconds * 1e3, tokens / seconds, flops / seconds / 1e12, 100 * flops / seconds / peak,
             dtypeName, arena / (1 << 20), lastLoss);
  return 0;
}
