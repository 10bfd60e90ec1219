//===- CudaRuntimeTest.cpp - The cuda backend against the cpu backend ------===//
//
// Built in every backend flavour (//:flavours.bzl): //tests:cuda_runtime_test on a GPU (tag
// requires-gpu), and in CI on the emulated device (kernels/cuda/emu/README.md) as
// //tests:cuda_runtime_test_emu and //tests:cuda_runtime_test_emu_async (CPU stand-ins for the
// kernels; synchronous and asynchronous streams), //tests:cuda_runtime_test_kernel_emu and
// //tests:cuda_runtime_test_kernel_emu_async (the .cu kernels on the kernel emulator), and
// //tests:cuda_runtime_sm80_test_kernel_emu (its Hopper case on an emulated A100). Plans
// of the tiny GPT run on the cuda backend (every rank a thread on one GPU) and must give the CPU
// single-rank reference's gradients, and the cpu backend's losses, within fp32 tolerances:
// gradients within kCudaGradTolerance (1e-4) of the largest reference gradient, losses within
// 1e-5 absolute (the summation order of cuBLAS, the attention kernels, the column sums and the
// embedding backward differs from the CPU loops). The bf16 cases (mixed precision, fp32 master
// weights) hold the same fp32 reference to bf16 tolerances: gradients within kCudaBf16GradTolerance
// (5e-2) of the scale, losses within 2e-3 relative; and they must be measurably less exact
// than fp32 (more than 1e-4 of the scale), or the run did not compute in bf16.
//
//===----------------------------------------------------------------------===//
#include "tests/CudaDeviceTest.h"
#include "tests/TestUtil.h"

#include "compiler/Verifier.h"
#include "ir/formats/SpecJson.h"
#include "ir/support/Error.h"
#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/CudaOps.h"
#include "runtime/Data.h"
#include "runtime/cpu/CpuRun.h"
#include "runtime/cuda/CudaRun.h"
#include "runtime/cuda/EmbeddingGrad.h"
#include "runtime/cuda/GpuStage.h"
#include "runtime/cuda/StageKernels.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

namespace pipec::test {
namespace {

using kernels::DType;

/// `steps` steps on the cuda backend in `dtype` with the reference check, and on the cpu
/// backend.
void expectCudaMatchesCpu(const Plan &plan, int steps = 2, kernels::DType dtype = DType::F32,
                          std::unique_ptr<DataSource> data = syntheticData(32, /*seed=*/7)) {
  ASSERT_FALSE(verifyPlan(plan));
  CudaRunOptions o;
  o.steps = steps;
  o.checkReference = true;
  o.timeoutSeconds = 60;
  o.dtype = dtype;
  auto gpu = runOnCuda(plan, *data, o);
  ASSERT_TRUE(bool(gpu)) << takeMessage(gpu.takeError());
  EXPECT_GT(gpu->grads.scale, 0);
  EXPECT_LE(gpu->grads.maxAbsDiff, cudaGradTolerance(dtype) * gpu->grads.scale)
      << "max |grad - reference| " << gpu->grads.maxAbsDiff << " scale " << gpu->grads.scale;
  EXPECT_LE(gpu->grads.maxTensorDiff, cudaTensorGradTolerance(dtype))
      << "worst tensor at layer " << gpu->grads.worstTensor.layer << " "
      << gpu->grads.worstTensor.param;
  EXPECT_EQ(gpu->weights.steps, steps);
  EXPECT_LE(gpu->weights.maxRatio, 1.0) << weightCheckReport(gpu->weights);
  EXPECT_LT(gpu->weights.tpCopy.step, 0) << weightCheckReport(gpu->weights);
  EXPECT_LT(gpu->weights.dpCopy.replica, 0) << weightCheckReport(gpu->weights);
  // The sizing pass (no device work, no transport) made exactly the steps' requests: the steps
  // filled the arena it reserved, no less (the first-fit placement depends on the sequence
  // alone; a request it had not seen would have failed the step).
  EXPECT_EQ(gpu->arenaUsedBytes, gpu->arenaBytes);
  if (dtype == DType::BF16) {
    EXPECT_GT(gpu->grads.maxAbsDiff, kCudaGradTolerance * gpu->grads.scale)
        << "bf16 gradients as exact as fp32 ones: the run did not compute in bf16";
  }
  const bool bf16 = dtype == DType::BF16;
  CpuRunOptions co;
  co.steps = steps;
  co.timeoutSeconds = 20;
  auto cpu = runOnCpu(plan, *data, co);
  ASSERT_TRUE(bool(cpu)) << takeMessage(cpu.takeError());
  ASSERT_EQ(gpu->losses.size(), cpu->losses.size());
  for (size_t s = 0; s < gpu->losses.size(); ++s) {
    const double tolerance = bf16 ? 2e-3 * std::fabs(cpu->losses[s]) : 1e-5;
    EXPECT_NEAR(gpu->losses[s], cpu->losses[s], tolerance) << "step " << s;
    EXPECT_NEAR(gpu->losses[s], gpu->referenceLosses[s], tolerance) << "step " << s;
  }
}

/// A tiny bf16 GPT with two heads of `headDim`: 16 takes the mma.sync tensor-core attention; 64
/// the Hopper (wgmma) forward on a compute-capability-9.0 device (the emulated device is one
/// unless PIPEC_EMU_COMPUTE_CAPABILITY says otherwise), mma.sync on others.
ModelSpec tinyGptTwoHeads(int headDim, int layers, int seq) {
  const std::string name = fmt::format("tiny-hd{}", headDim);
  return modelOrFail(fmt::format(R"({{"format": "pipemodel/1", "name": "{}", "transformer": {{
          "num_layers": {}, "hidden_size": {}, "num_attention_heads": 2, "ffn_hidden_size": {},
          "vocab_size": 32, "seq_length": {}, "microbatch_size": 2, "dtype": "bf16"}}}})",
                                 name, layers, 2 * headDim, 4 * headDim, seq),
                     name + ".json");
}

using CudaRuntimeTest = CudaDeviceTest;

TEST_F(CudaRuntimeTest, OneFOneBOnFourStagesGivesTheReferenceGradients) {
  expectCudaMatchesCpu(compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                                     options("1f1b", /*pp=*/4, /*microbatches=*/6)));
}

TEST_F(CudaRuntimeTest, TensorParallelTwoGivesTheReferenceGradients) {
  expectCudaMatchesCpu(
      compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                    options("1f1b", /*pp=*/2, /*microbatches=*/4, 1, 1, /*tp=*/2)));
}

TEST_F(CudaRuntimeTest, ZeroBubbleWithSubSequencesAndTensorParallelMatches) {
  expectCudaMatchesCpu(
      compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                    options("zb-h1", /*pp=*/2, /*microbatches=*/3, 1, /*seqSplits=*/2, /*tp=*/2)));
}

TEST_F(CudaRuntimeTest, TiedEmbeddingsAndDataParallelMatch) {
  expectCudaMatchesCpu(
      compileOrFail(tinyGpt(/*tied=*/true, /*layers=*/6),
                    options("1f1b", /*pp=*/4, /*microbatches=*/4, 1, 1, 1, /*dp=*/2)));
}

TEST_F(CudaRuntimeTest, ZbvOnOneRankPairWithTiedCopiesMatches) {
  expectCudaMatchesCpu(compileOrFail(tinyGpt(/*tied=*/true, /*layers=*/6),
                                     options("zb-v", /*pp=*/2, /*microbatches=*/4, /*vpp=*/2)));
}

// bf16 (mixed precision): the pp = 4 plan of the GPU check, tp and dp sums of bf16 partials and
// fp32 gradients, sub-sequences (K/V of earlier slices and their fp32 gradient accumulators),
// tied embeddings, a V-shape, and the tensor-core attention kernels (head dimension 16).
TEST_F(CudaRuntimeTest, Bf16LlamaBlockWithTensorParallelSubSequencesIsWithinBf16Tolerance) {
  // RMSNorm, SwiGLU, rotary (K kept rotated across the slices) and grouped heads split over tp,
  // in bf16.
  expectCudaMatchesCpu(compileOrFail(tinyLlama(/*tied=*/false, /*layers=*/4),
                                     options("zb-h1", /*pp=*/2, /*microbatches=*/4, /*vpp=*/1,
                                             /*seqSplits=*/2, /*tp=*/2)),
                       /*steps=*/2, DType::BF16);
}

TEST_F(CudaRuntimeTest, Bf16OneFOneBOnFourStagesIsWithinBf16Tolerance) {
  expectCudaMatchesCpu(compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                                     options("1f1b", /*pp=*/4, /*microbatches=*/8)),
                       /*steps=*/3, DType::BF16);
}

TEST_F(CudaRuntimeTest, Bf16TensorAndDataParallelWithSubSequencesIsWithinBf16Tolerance) {
  expectCudaMatchesCpu(compileOrFail(tinyGpt(/*tied=*/true, /*layers=*/6),
                                     options("zb-h1", /*pp=*/2, /*microbatches=*/3, 1,
                                             /*seqSplits=*/2, /*tp=*/2, /*dp=*/2)),
                       /*steps=*/2, DType::BF16);
}

TEST_F(CudaRuntimeTest, Bf16ZbvWithTiedCopiesIsWithinBf16Tolerance) {
  expectCudaMatchesCpu(compileOrFail(tinyGpt(/*tied=*/true, /*layers=*/6),
                                     options("zb-v", /*pp=*/2, /*microbatches=*/4, /*vpp=*/2)),
                       /*steps=*/2, DType::BF16);
}

TEST_F(CudaRuntimeTest, Bf16TensorCoreAttentionWithSubSequencesIsWithinBf16Tolerance) {
  expectCudaMatchesCpu(compileOrFail(tinyGptTwoHeads(/*headDim=*/16, /*layers=*/4, /*seq=*/32),
                                     options("seq1f1b", /*pp=*/2, /*microbatches=*/2, 1,
                                             /*seqSplits=*/2)),
                       /*steps=*/2, DType::BF16);
}

// Two sub-sequences (86 and 74 tokens, balanced by FLOPs) of head dim 64 through the Hopper
// forward (on a compute-capability-9.0 device; the mma.sync one elsewhere): each slice's 128-query
// block is partly past it and its 64-key tiles cross the slice boundary. This checks the plumbing
// (the kernel's choice, offsets, K/V of earlier slices); at GPT-2's initialisation the scores are
// near zero, so a wrong score here moves the gradients less than bf16's tolerance:
// CudaAttentionTest (unit-scale inputs) is what holds the math.
TEST_F(CudaRuntimeTest, Bf16HopperAttentionWithSubSequencesIsWithinBf16Tolerance) {
  expectCudaMatchesCpu(compileOrFail(tinyGptTwoHeads(/*headDim=*/64, /*layers=*/2, /*seq=*/160),
                                     options("seq1f1b", /*pp=*/2, /*microbatches=*/2, 1,
                                             /*seqSplits=*/2)),
                       /*steps=*/1, DType::BF16);
}

TEST_F(CudaRuntimeTest, Bf16HalvesTheActivationArena) {
  // Activations, saved state and p2p buffers are 2 bytes instead of 4; only the per-row fp32
  // statistics (n floats next to n x C activations) keep their size.
  Plan plan = compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6), options("1f1b", 4, 8));
  auto data = syntheticData(32, /*seed=*/7);
  size_t arena[2] = {0, 0};
  for (DType dtype : {DType::F32, DType::BF16}) {
    CudaRunOptions o;
    o.dtype = dtype;
    auto result = runOnCuda(plan, *data, o);
    ASSERT_TRUE(bool(result)) << takeMessage(result.takeError());
    arena[dtype == DType::BF16] = result->arenaBytes.at(0);
  }
  EXPECT_LT(double(arena[1]), 0.65 * double(arena[0]))
      << "fp32 " << arena[0] << " bytes, bf16 " << arena[1];
  EXPECT_GT(double(arena[1]), 0.4 * double(arena[0]))
      << "fp32 " << arena[0] << " bytes, bf16 " << arena[1];
}

/// Every schedule on the cuda backend (the cpu backend's RuntimeTest cases that fit one GPU).
struct ScheduleCase {
  const char *name;
  CompileOptions options;
  bool tied = false;
};

class CudaEverySchedule : public CudaRuntimeTest,
                          public ::testing::WithParamInterface<ScheduleCase> {};

TEST_P(CudaEverySchedule, GradientsEqualTheSingleRankReference) {
  const ScheduleCase &c = GetParam();
  CompileOptions o = c.options;
  if (o.schedule == "zb-auto")
    o.memoryLimit = int64_t(1) << 40;
  expectCudaMatchesCpu(compileOrFail(tinyGpt(c.tied, /*layers=*/6), o), /*steps=*/1);
}

TEST_P(CudaEverySchedule, LlamaBlockGradientsEqualTheSingleRankReference) {
  // The same plans over Llama's block (RMSNorm, SwiGLU, rotary, 2 key/value heads for 4, no
  // biases): the one stage definition on the device against the cpu reference.
  const ScheduleCase &c = GetParam();
  CompileOptions o = c.options;
  if (o.schedule == "zb-auto")
    o.memoryLimit = int64_t(1) << 40;
  expectCudaMatchesCpu(compileOrFail(tinyLlama(c.tied, /*layers=*/6), o), /*steps=*/1);
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaEverySchedule,
    ::testing::Values(
        ScheduleCase{"gpipe", options("gpipe", 4, 4)},
        ScheduleCase{"onefoneb_fewer_microbatches", options("1f1b", 4, 2)},
        ScheduleCase{"onefoneb_tp2_dp2", options("1f1b", 2, 3, 1, 1, /*tp=*/2, /*dp=*/2)},
        ScheduleCase{"gpipe_seq4", options("gpipe", 2, 3, 1, /*seqSplits=*/4)},
        ScheduleCase{"single_stage_tied", options("1f1b", 1, 3), /*tied=*/true},
        ScheduleCase{"dualpipev", options("dualpipe-v", 2, 4, /*vpp=*/2)},
        ScheduleCase{"dualpipev_tied_tp2", options("dualpipe-v", 2, 4, 2, 1, /*tp=*/2), true},
        ScheduleCase{"interleaved", options("interleaved-1f1b", 2, 4, /*vpp=*/2)},
        ScheduleCase{"seq1f1b_k4", options("seq1f1b", 2, 4, 1, /*seqSplits=*/4)},
        ScheduleCase{"seq1f1b_interleaved", options("seq1f1b-interleaved", 2, 4, 2, 2)},
        ScheduleCase{"zbh2", options("zb-h2", 4, 6)},
        ScheduleCase{"zbv_seq2", options("zb-v", 2, 3, /*vpp=*/2, /*seqSplits=*/2)},
        ScheduleCase{"zbauto", options("zb-auto", 4, 6)}),
    [](const auto &info) { return std::string(info.param.name); });

/// Sequences of the 32-token vocabulary that are 95 % padding (token 0): a microbatch of two
/// sequences of 72 puts 136 of its 144 rows on one token, a run of two embedding-backward
/// pieces (runtime/cuda/EmbeddingGrad.h).
class MostlyPadding final : public DataSource {
public:
  void sequence(uint64_t index, std::span<int32_t> out) const override {
    for (size_t p = 0; p < out.size(); ++p)
      out[p] = p % 20 == 0 ? int32_t((index * 7 + p) % 31 + 1) : 0;
  }
};

TEST_F(CudaRuntimeTest, APaddedBatchWithTiedEmbeddingsOnTwoTpRanksMatches) {
  // One stage holds the embedding and the tied head: both embedding backwards take the long
  // run's pieces and their merge, on both tp ranks (whose copies must agree bit for bit).
  expectCudaMatchesCpu(compileOrFail(tinyGpt(/*tied=*/true, /*layers=*/4, /*seq=*/72),
                                     options("1f1b", /*pp=*/1, /*microbatches=*/2, 1, 1, /*tp=*/2)),
                       2, DType::F32, std::make_unique<MostlyPadding>());
}

// No kernel's sums depend on the order its blocks run in: a second run of a plan gives the
// same losses and gradients bit for bit, and every tp rank the same gradients of the tensors it
// holds whole (layernorms, row-parallel biases, the embeddings, the tied head), so their copies
// cannot drift apart. On the kernel emulator //tests:cuda_runtime_test_kernel_emu runs every
// launch's blocks in a new order (PIPEC_EMU_BLOCK_ORDER=shuffled), as a GPU may; floating-point
// atomics there fail this test.
TEST_F(CudaRuntimeTest, ASecondRunAndEveryTpRankGetTheSameBits) {
  // 96 rows per microbatch (2 sequences of 48 positions): the embedding backward spans several
  // blocks, and the 32-token vocabulary repeats across them. (The column sums' chunks of 256
  // rows, and the bias sums, which the emulated matmuls do on the CPU, are CudaKernelTest's.)
  Plan plan = compileOrFail(tinyGpt(/*tied=*/true, /*layers=*/4, /*seq=*/48),
                            options("zb-h1", /*pp=*/2, /*microbatches=*/2, 1, 1, /*tp=*/2));
  auto cfg = gptConfigOf(plan);
  ASSERT_TRUE(bool(cfg)) << takeMessage(cfg.takeError());
  auto data = syntheticData(32, /*seed=*/7);
  CudaRunOptions o;
  o.steps = 1;
  o.checkReference = true; // (for lastGrads)
  auto first = runOnCuda(plan, *data, o);
  ASSERT_TRUE(bool(first)) << takeMessage(first.takeError());
  auto second = runOnCuda(plan, *data, o);
  ASSERT_TRUE(bool(second)) << takeMessage(second.takeError());
  EXPECT_EQ(first->losses, second->losses);
  ASSERT_EQ(first->lastGrads.size(), 4u);
  for (const auto &[key, grads] : first->lastGrads) {
    const std::vector<float> &again = second->lastGrads.at(key);
    ASSERT_EQ(grads.size(), again.size());
    auto [mine, theirs] = std::mismatch(grads.begin(), grads.end(), again.begin());
    EXPECT_TRUE(mine == grads.end()) << "stage " << key.first << ", tp rank " << key.second
                                     << ": gradient " << (mine - grads.begin()) << " is " << *mine
                                     << " in one run and " << *theirs << " in the other";
  }
  ParamSnapshot snapshot;
  snapshot.byStageAndTp = first->lastGrads;
  const GradDiffPlace copy = firstTpCopyMismatch(plan, *cfg, snapshot, /*step=*/0);
  EXPECT_LT(copy.step, 0) << "the tp ranks' gradients of " << copy.param << " (stage " << copy.stage
                          << ", layer " << copy.layer << ") differ: " << copy.got << " on tp rank "
                          << copy.tpRank << ", " << copy.want << " on the last";
  EXPECT_LT(first->weights.tpCopy.step, 0) << weightCheckReport(first->weights);
}

// The embedding backward on its own (runtime/cuda/EmbeddingGrad.h, StageKernels.h): a batch in
// which one token fills 300 of 480 rows and another 129 (runs of three and two pieces, added up
// by the merge kernel) and the rest are scattered. The plan orders the rows by token, stably, and
// cuts the runs into pieces; the gradients of wte and wpe equal the sums over the rows (in
// double, on the host) and have the same bits when run again.
TEST_F(CudaRuntimeTest, TheEmbeddingGradientAddsLongRunsInPieces) {
  const int batch = 3, x = 160, n = batch * x, c = 24, vocab = 40, begin = 5;
  std::vector<int32_t> tokens;
  tokens.insert(tokens.end(), 300, 7);
  tokens.insert(tokens.end(), 129, 3);
  std::mt19937 rng(11);
  while (tokens.size() < size_t(n))
    tokens.push_back(int32_t(rng() % vocab));
  std::shuffle(tokens.begin(), tokens.end(), rng);

  const EmbeddingGradPlan plan = planEmbeddingGrad(tokens);
  ASSERT_EQ(plan.order.size(), size_t(n));
  for (int q = 1; q < n; ++q) { // stably sorted by token
    const int32_t a = plan.order[size_t(q) - 1], b = plan.order[size_t(q)];
    ASSERT_TRUE(tokens[size_t(a)] < tokens[size_t(b)] ||
                (tokens[size_t(a)] == tokens[size_t(b)] && a < b))
        << "positions " << q - 1 << " and " << q;
  }
  int covered = 0; // the pieces tile the order, none longer than kEmbeddingPieceRows
  for (int p = 0; p < plan.numPieces(); ++p) {
    EXPECT_EQ(plan.pieces[size_t(3 * p)], covered);
    const int length = plan.pieces[size_t(3 * p + 1)] - covered;
    EXPECT_GT(length, 0);
    EXPECT_LE(length, kEmbeddingPieceRows);
    covered += length;
  }
  EXPECT_EQ(covered, n);
  EXPECT_EQ(plan.merges, (std::vector<int32_t>{3, 0, 2, 7, 2, 3})) << "129 rows: 2 pieces; 300: 3";
  EXPECT_EQ(plan.slots, 5);
  EXPECT_LE(size_t(plan.slots), maxEmbeddingGradSlots(size_t(n)));

  auto ctx = kernels::cuda::CudaContext::create(/*device=*/0, kernels::cuda::KernelConfig{});
  ASSERT_TRUE(bool(ctx)) << takeMessage(ctx.takeError());
  auto buffer = [&](size_t bytes) {
    auto b = kernels::cuda::DeviceBuffer::allocate(bytes);
    EXPECT_TRUE(bool(b)) << takeMessage(b.takeError());
    return b ? std::move(*b) : kernels::cuda::DeviceBuffer();
  };
  auto put = [&](kernels::cuda::DeviceBuffer &to, const auto &from) {
    ASSERT_FALSE(bool((*ctx)->upload(to.data(), from.data(), from.size() * sizeof(from[0]))));
  };
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> dEmb(size_t(n) * c), wteStart(size_t(vocab) * c),
      wpeStart(size_t(begin + x) * c);
  for (std::vector<float> *v : {&dEmb, &wteStart, &wpeStart})
    for (float &f : *v)
      f = uniform(rng);
  std::vector<int32_t> ints(maxEmbeddingGradInts(size_t(n)), 0);
  std::copy(plan.order.begin(), plan.order.end(), ints.begin());
  std::copy(plan.pieces.begin(), plan.pieces.end(), ints.begin() + n);
  std::copy(plan.merges.begin(), plan.merges.end(), ints.begin() + 4 * n);
  auto gEmb = buffer(dEmb.size() * 4), gTokens = buffer(tokens.size() * 4);
  auto gPlan = buffer(ints.size() * 4), gSlots = buffer(maxEmbeddingGradSlots(n) * c * 4);
  auto gWte = buffer(wteStart.size() * 4), gWpe = buffer(wpeStart.size() * 4);
  put(gEmb, dEmb);
  put(gTokens, tokens);
  put(gPlan, ints);
  const auto *at = gPlan.as<int32_t>();
  const runtime::cuda::launch::EmbeddingGradArgs args{
      at, at + n, plan.numPieces(), at + 4 * n, plan.numMerges(), gSlots.as<float>()};
  auto run = [&](std::vector<float> &wte, std::vector<float> &wpe) {
    put(gWte, wteStart);
    put(gWpe, wpeStart);
    ASSERT_EQ(runtime::cuda::launch::embeddingBackward(
                  DType::F32, gWte.as<float>(), gWpe.as<float>(), gEmb.data(),
                  gTokens.as<int32_t>(), args, n, x, begin, c,
                  /*vocabBegin=*/0, vocab, static_cast<cudaStream_t>((*ctx)->stream())),
              cudaSuccess);
    wte.resize(wteStart.size());
    wpe.resize(wpeStart.size());
    ASSERT_FALSE(bool((*ctx)->download(wte.data(), gWte.data(), wte.size() * 4)));
    ASSERT_FALSE(bool((*ctx)->download(wpe.data(), gWpe.data(), wpe.size() * 4)));
  };
  std::vector<float> wte, wpe, wteAgain, wpeAgain;
  run(wte, wpe);
  run(wteAgain, wpeAgain);
  EXPECT_EQ(wte, wteAgain);
  EXPECT_EQ(wpe, wpeAgain);
  std::vector<double> refWte(wteStart.begin(), wteStart.end()),
      refWpe(wpeStart.begin(), wpeStart.end());
  for (int r = 0; r < n; ++r) // row r = (sequence r / x, position r % x)
    for (int k = 0; k < c; ++k) {
      refWte[size_t(tokens[size_t(r)]) * c + k] += dEmb[size_t(r) * c + k];
      refWpe[size_t(begin + r % x) * c + k] += dEmb[size_t(r) * c + k];
    }
  for (size_t i = 0; i < refWte.size(); ++i)
    ASSERT_NEAR(wte[i], refWte[i], 1e-4) << "wte[" << i / c << ", " << i % c << "]";
  for (size_t i = 0; i < refWpe.size(); ++i)
    ASSERT_NEAR(wpe[i], refWpe[i], 1e-5) << "wpe[" << i / c << ", " << i % c << "]";

  // Vocab-parallel: each of two tp ranks plans only its tokens' rows (tokens 3 and 7 on rank
  // 0's half) and adds them into its rows of wte; the halves are the whole table's rows, bit
  // for bit, since every token's rows are added in the same order and pieces.
  const int half = vocab / 2;
  for (int rank = 0; rank < 2; ++rank) {
    const int32_t first = rank * half;
    const EmbeddingGradPlan shard = planEmbeddingGrad(tokens, first, first + half);
    size_t held = 0;
    for (int32_t t : tokens)
      held += t >= first && t < first + half;
    ASSERT_EQ(shard.order.size(), held) << "rank " << rank;
    EXPECT_EQ(shard.numMerges(), rank == 0 ? 2 : 0) << "rank " << rank;
    std::fill(ints.begin(), ints.end(), 0);
    std::copy(shard.order.begin(), shard.order.end(), ints.begin());
    std::copy(shard.pieces.begin(), shard.pieces.end(), ints.begin() + n);
    std::copy(shard.merges.begin(), shard.merges.end(), ints.begin() + 4 * n);
    put(gPlan, ints);
    const runtime::cuda::launch::EmbeddingGradArgs shardArgs{
        at, at + n, shard.numPieces(), at + 4 * n, shard.numMerges(), gSlots.as<float>()};
    const std::vector<float> shardStart(wteStart.begin() + size_t(first) * c,
                                        wteStart.begin() + size_t(first + half) * c);
    put(gWte, shardStart);
    ASSERT_EQ(runtime::cuda::launch::embeddingBackward(DType::F32, gWte.as<float>(), nullptr,
                                                       gEmb.data(), gTokens.as<int32_t>(),
                                                       shardArgs, n, x, begin, c, first, half,
                                                       static_cast<cudaStream_t>((*ctx)->stream())),
              cudaSuccess);
    std::vector<float> got(shardStart.size());
    ASSERT_FALSE(bool((*ctx)->download(got.data(), gWte.data(), got.size() * 4)));
    EXPECT_TRUE(std::equal(got.begin(), got.end(), wte.begin() + size_t(first) * c))
        << "rank " << rank;
  }
}

TEST_F(CudaRuntimeTest, NoStepAllocatesDeviceMemoryStepZeroIncluded) {
  // The arenas are sized before step 0 on the host: from the end of step 0 to that of step 3 the
  // device's free memory does not move, and the stream-ordered pool hands out nothing in the
  // whole run (its high-water mark, reset before it, does not rise; a warm-up step that measured
  // the arena with stream-ordered allocations, as the runtime once did, raises it).
  Plan plan = compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                            options("zb-h1", /*pp=*/4, /*microbatches=*/6, 1, /*seqSplits=*/2));
  auto data = syntheticData(32, /*seed=*/7);
  CudaRunOptions o;
  o.steps = 4;
  int device = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  cudaMemPool_t pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, device), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  uint64_t zero = 0, usedBefore = 0; // (the reset starts the mark from what is in use now)
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero), cudaSuccess);
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &usedBefore), cudaSuccess);
  size_t freeAfterStep0 = 0, total = 0;
  std::vector<std::string> problems;
  auto onStep = [&](int step, double) {
    uint64_t high = 0;
    if (cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high) != cudaSuccess)
      problems.push_back("cannot read the pool's high-water mark");
    if (high != usedBefore)
      problems.push_back(fmt::format("by the end of step {}: the stream-ordered pool handed out "
                                     "{} bytes",
                                     step, high - usedBefore));
    size_t freeNow = 0;
    if (cudaMemGetInfo(&freeNow, &total) != cudaSuccess) {
      problems.push_back("cudaMemGetInfo failed");
      return;
    }
    if (step == 0)
      freeAfterStep0 = freeNow;
    else if (freeNow != freeAfterStep0)
      problems.push_back(
          fmt::format("step {}: free device memory {} -> {}", step, freeAfterStep0, freeNow));
  };
  auto result = runOnCuda(plan, *data, o, onStep);
  ASSERT_TRUE(bool(result)) << takeMessage(result.takeError());
  EXPECT_TRUE(problems.empty()) << fmt::format("{}", fmt::join(problems, "\n"));
  ASSERT_EQ(result->arenaBytes.size(), 4u);
  for (size_t r = 0; r < 4; ++r)
    EXPECT_GT(result->arenaBytes[r], 0u) << "rank " << r;
  EXPECT_EQ(result->arenaUsedBytes, result->arenaBytes);
}

/// A --backend cuda "the plan's 4 ranks need ... together" message lists each rank's MiB: each
/// between 30 % of `freeBytes` and all of it, all four together more.
void expectEachFitsAloneButNotTogether(const std::string &message, size_t freeBytes) {
  const std::string list = "(MiB by rank, in RANK order: ";
  const size_t at = message.find(list);
  ASSERT_NE(at, std::string::npos) << message;
  std::istringstream byRank(message.substr(at + list.size()));
  std::vector<double> need(4);
  for (double &mib : need)
    byRank >> mib;
  ASSERT_TRUE(bool(byRank)) << message;
  const double freeMib = double(freeBytes) / double(1 << 20);
  double sum = 0;
  for (size_t r = 0; r < 4; ++r) {
    EXPECT_LT(need[r], freeMib) << "rank " << r << ": " << message;
    EXPECT_GT(need[r], 0.3 * freeMib) << "rank " << r << ": " << message;
    sum += need[r];
  }
  EXPECT_GT(sum, freeMib) << message;
}

TEST_F(CudaRuntimeTest, RanksThatFitTheGpuAloneButNotTogetherFailBeforeStepZero) {
  // GPipe keeps every microbatch's activations: each of the four ranks about a block's fp32 fc
  // inputs per microbatch (134 MB), with enough microbatches for 35-45 % of the free memory
  // each. Every rank's arena would fit alone; the four share the GPU and cannot. The sizing
  // pass takes no arena memory and no device time, so this is found before step 0, with
  // each rank's need.
  size_t freeBytes = 0, totalBytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&freeBytes, &totalBytes), cudaSuccess);
  const size_t perMicrobatch = size_t(8) * 1024 * 4096 * sizeof(float);
  const int microbatches = int(0.35 * double(freeBytes) / double(perMicrobatch)) + 1;
  Plan plan = compileOrFail(wideFfnGpt(), options("gpipe", /*pp=*/4, microbatches));
  auto data = syntheticData(32, /*seed=*/7);
  CudaRunOptions o;
  o.steps = 1;
  bool stepRan = false;
  auto result = runOnCuda(plan, *data, o, [&](int, double) { stepRan = true; });
  ASSERT_FALSE(bool(result)) << "a plan of " << microbatches << " microbatches fitted";
  const std::string message = takeMessage(result.takeError());
  EXPECT_FALSE(stepRan);
  for (const char *part :
       {"--backend cuda: the plan's 4 ranks need ", " MiB of activation memory together on GPU 0",
        " MiB are free; ", "1f1b instead of gpipe", "--backend nccl"})
    EXPECT_NE(message.find(part), std::string::npos) << part << " missing from: " << message;
  // Each rank's need, from the message: each fits alone, all four do not.
  expectEachFitsAloneButNotTogether(message, freeBytes);
}

TEST_F(CudaRuntimeTest, RanksWhoseWeightsFitTheGpuAloneButNotTogetherFailBeforeAnyIsAllocated) {
  // One wide block per rank, its fc sized from the free memory so that each rank's fp32
  // weights, gradients and Adam moments (16 bytes a parameter) take about 40 % of it. Each
  // rank's would fit alone; the four share the GPU and cannot. That is found from the plan
  // before any rank allocates (or initialises on the host) its weights: were they allocated
  // one rank after another, the third would fail with its own message instead.
  size_t freeBytes = 0, totalBytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&freeBytes, &totalBytes), cudaSuccess);
  const double hidden = 1024, perRankParams = 0.4 * double(freeBytes) / 16;
  const int ffn = int((perRankParams - 4 * hidden * hidden) / (2 * hidden));
  Plan plan = compileOrFail(fp32Gpt(/*layers=*/4, int(hidden), /*heads=*/8, ffn, /*seq=*/8,
                                    /*microbatchSize=*/1),
                            options("1f1b", /*pp=*/4, /*microbatches=*/4));
  auto data = syntheticData(32, /*seed=*/7);
  bool arenasSized = false;
  CudaRunOptions o;
  o.onArenas = [&](const CudaRunResult &) { arenasSized = true; };
  auto result = runOnCuda(plan, *data, o);
  ASSERT_FALSE(bool(result)) << "four ranks of " << ffn << "-wide blocks fitted";
  const std::string message = takeMessage(result.takeError());
  EXPECT_FALSE(arenasSized);
  for (const char *part : {"--backend cuda: the plan's 4 ranks need ",
                           " MiB of weights, gradients and optimizer state together on GPU 0",
                           " MiB are free; run one rank per GPU with --backend nccl"})
    EXPECT_NE(message.find(part), std::string::npos) << part << " missing from: " << message;
  expectEachFitsAloneButNotTogether(message, freeBytes);
}

TEST_F(CudaRuntimeTest, EachRankHoldsTheStaticBytesOfThePlansMemoryAnalysis) {
  // The compiler's memory pass (compiler/Memory.cpp, from ir/Model.cpp's parameter count) says
  // what each rank's weights, gradients and optimizer state take: for an fp32 model 16 bytes a
  // parameter. The runtime holds that plus the loss's 8-byte accumulator; computing in bf16
  // adds the 2-byte copy of the weights.
  Plan plan = compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6), options("1f1b", /*pp=*/4, 4));
  auto data = syntheticData(32, /*seed=*/7);
  for (DType dtype : {DType::F32, DType::BF16}) {
    CudaRunOptions o;
    o.dtype = dtype;
    std::vector<size_t> seenBeforeStepZero;
    o.onArenas = [&](const CudaRunResult &sofar) { seenBeforeStepZero = sofar.stateBytes; };
    auto result = runOnCuda(plan, *data, o);
    ASSERT_TRUE(bool(result)) << takeMessage(result.takeError());
    ASSERT_EQ(result->stateBytes.size(), 4u);
    EXPECT_EQ(seenBeforeStepZero, result->stateBytes);
    for (size_t r = 0; r < 4; ++r) {
      const int64_t planned = plan.stats.ranks[r].staticBytes;
      EXPECT_EQ(int64_t(result->stateBytes[r]),
                (dtype == DType::BF16 ? planned / 16 * 18 : planned) + 8)
          << "rank " << r << (dtype == DType::BF16 ? " bf16" : " fp32");
    }
  }
}

TEST_F(CudaRuntimeTest, AnAllocationPastTheFreeMemoryIsAnOutOfMemoryErrorAndNothingElseIs) {
  // createStages() and the set-up explain an out-of-memory failure in their own terms and pass
  // any other on.
  size_t freeBytes = 0, totalBytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&freeBytes, &totalBytes), cudaSuccess);
  auto tooLarge = kernels::cuda::DeviceBuffer::allocate(totalBytes + (size_t(1) << 30));
  ASSERT_FALSE(bool(tooLarge));
  llvm::Error err = tooLarge.takeError();
  EXPECT_TRUE(err.isA<kernels::cuda::CudaOutOfMemoryError>());
  EXPECT_NE(takeMessage(std::move(err)).find("cudaMalloc("), std::string::npos);
  llvm::Error other =
      kernels::cuda::makeCudaError("cudaMemcpy(...)", cudaErrorInvalidValue, __FILE__, __LINE__);
  EXPECT_FALSE(other.isA<kernels::cuda::CudaOutOfMemoryError>());
  EXPECT_NE(takeMessage(std::move(other)).find("cudaErrorInvalidValue"), std::string::npos);
  // cuBLAS's own allocations (cublasLtCreate's) failing is the same want of memory.
  llvm::Error cublas = kernels::cuda::makeCublasError(
      "cublasLtCreate(...)", CUBLAS_STATUS_ALLOC_FAILED, __FILE__, __LINE__);
  EXPECT_TRUE(cublas.isA<kernels::cuda::CudaOutOfMemoryError>());
  EXPECT_NE(takeMessage(std::move(cublas)).find("CUBLAS_STATUS_ALLOC_FAILED"), std::string::npos);
  llvm::Error unsupported = kernels::cuda::makeCublasError(
      "cublasLtMatmul(...)", CUBLAS_STATUS_NOT_SUPPORTED, __FILE__, __LINE__);
  EXPECT_FALSE(unsupported.isA<kernels::cuda::CudaOutOfMemoryError>());
  llvm::consumeError(std::move(unsupported));
}

TEST(GpuStageTest, ItHoldsTheParametersThePlansMemoryAnalysisCounts) {
  // ir/Model.cpp counts each layer's parameters for the plan's memory analysis on its own; the
  // runtime lays them out from kernels/cpu/Gpt.h. Stage by stage (untied, tp 1) they agree, and
  // the device state is 16 bytes a parameter in fp32 (the plan's 4 per fp32 parameter byte),
  // 2 more with the bf16 copy, plus the loss's 8-byte accumulator.
  for (int pp : {1, 2, 4}) {
    Plan plan = compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6), options("1f1b", pp, 4));
    auto cfg = gptConfigOf(plan);
    ASSERT_TRUE(bool(cfg)) << takeMessage(cfg.takeError());
    for (const StageInfo &s : plan.stages) {
      const size_t n = GpuStage::paramCount(*cfg, s.layerBegin, s.layerEnd, /*tp=*/1);
      EXPECT_EQ(int64_t(n * sizeof(float)), s.paramBytes) << "pp " << pp << " stage " << s.stage;
      EXPECT_EQ(GpuStage::stateBytes(*cfg, s.layerBegin, s.layerEnd, 1, DType::F32),
                size_t(double(s.paramBytes) * plan.stateBytesPerParamByte) + sizeof(double));
      EXPECT_EQ(GpuStage::stateBytes(*cfg, s.layerBegin, s.layerEnd, 1, DType::BF16),
                18 * n + sizeof(double));
    }
  }
}

TEST(GpuStageTest, AtTpAboveOneItSplitsTheVocabularyAndHoldsTheReplicatedVectorsWhole) {
  // What a tp rank holds, counted here from the tensor shapes (hidden C, ffn F, vocabulary V,
  // sequence T): Megatron's column- and row-parallel matrices, the column-parallel biases and
  // the vocabulary tables (wte, the LM head: vocab-parallel) split by tp, and whole on every
  // rank both layernorms and the row-parallel biases (6C a block; Megatron too), wpe and the
  // final layernorm. The plan's memory analysis (ir/Model.cpp) divides every layer's
  // parameters by tp, so at tp > 1 a rank holds (1 - 1/tp) of those whole tensors more than
  // the plan counts (README, Memory).
  const int64_t c = 16, f = 32, v = 32, t = 8; // tinyGpt's
  for (int tp : {2, 4})
    for (int pp : {1, 2}) {
      Plan plan = compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                                options("1f1b", pp, 4, 1, 1, tp, /*dp=*/1));
      auto cfg = gptConfigOf(plan);
      ASSERT_TRUE(bool(cfg)) << takeMessage(cfg.takeError());
      ASSERT_EQ(cfg->channels, c);
      ASSERT_EQ(cfg->ffn, f);
      ASSERT_EQ(cfg->vocab, v);
      ASSERT_EQ(cfg->seqLen, t);
      for (const StageInfo &s : plan.stages) {
        int64_t sharded = 0, whole = 0, planWords = 0; // floats (fp32)
        for (int l = s.layerBegin; l < s.layerEnd; ++l) {
          if (l == 0) {
            sharded += v * c; // wte
            whole += t * c;   // wpe
            planWords += (v + t) * c / tp;
          } else if (l == cfg->numLayers() - 1) {
            sharded += v * c; // lm.w
            whole += 2 * c;   // lnf
            planWords += (v * c + 2 * c) / tp;
          } else {
            sharded += 4 * c * c + 3 * c + 2 * c * f + f; // qkv, attn.w, fc, proj.w
            whole += 6 * c;                               // ln1, ln2, attn.b, proj.b
            planWords += (4 * c * c + 9 * c + 2 * c * f + f) / tp;
          }
        }
        const std::string where = fmt::format("tp {} pp {} stage {}", tp, pp, s.stage);
        EXPECT_EQ(int64_t(GpuStage::paramCount(*cfg, s.layerBegin, s.layerEnd, tp)),
                  sharded / tp + whole)
            << where;
        EXPECT_EQ(s.paramBytes, planWords * int64_t(sizeof(float))) << where;
        EXPECT_EQ(sharded / tp + whole - planWords, whole - whole / tp) << where;
      }
    }
}

TEST_F(CudaRuntimeTest, TheArenaFollowsTheScheduleActivationPeak) {
  // m = 8 > p = 4: GPipe's rank 0 keeps all 8 microbatches' state, 1F1B's at most 4.
  auto arenaOfRank0 = [](const char *schedule) -> size_t {
    Plan plan = compileOrFail(tinyGpt(/*tied=*/false, /*layers=*/6),
                              options(schedule, /*pp=*/4, /*microbatches=*/8));
    auto data = syntheticData(32, /*seed=*/7);
    CudaRunOptions o;
    auto result = runOnCuda(plan, *data, o);
    EXPECT_TRUE(bool(result)) << takeMessage(result.takeError());
    return result && !result->arenaBytes.empty() ? result->arenaBytes[0] : 0;
  };
  size_t gpipe = arenaOfRank0("gpipe"), oneF1B = arenaOfRank0("1f1b");
  EXPECT_GT(gpipe, oneF1B) << "gpipe " << gpipe << " bytes, 1f1b " << oneF1B;
  // At most 8/4 the 1F1B arena (plus the ops' transient buffers, which both share).
  EXPECT_LE(double(gpipe), 2.0 * double(oneF1B));
}

} // namespace
} // namespace pipec::test
