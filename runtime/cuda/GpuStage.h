//===- GpuStage.h - One pipeline stage of the GPT on a GPU ------*- C++ -*-===//
//
// The device counterpart of kernels::StageCompute (kernels/cpu/Gpt.h): both run the one stage
// definition, kernels/StageProgram.h, so the semantics are the same call for call: forward and
// backward_input run in tp parts and return the buffer the runtime sums over the tp group (the
// reduced sum is consumed lazily by the next part, output(), inputGrad() or backwardWeight());
// backward_weight accumulates the weight gradients and frees the slice's state; slice k of a
// microbatch attends to the K/V of slices 0..k and its backward adds dK/dV for the earlier ones;
// parameters, gradients and the tied-embedding range have the CPU's flat layout
// (kernels/StageModel.h). Parameters are the same initialisation (kernels::initLayerFull, cut by
// kernels::shardLayer) copied to the device, so both backends start from the same bits.
//
// Differences from the CPU class, all forced by the device:
//   - every call returns llvm::Error (a CUDA failure is an error naming the call);
//   - tensors are device memory of the compute type: the TensorViews handed in and out point to
//     the device;
//   - the loss stays on the device: accumulateLoss() adds a slice's loss to a step accumulator
//     that takeLoss() reads (one host synchronisation per step);
//   - attention keeps the forward's output and a log-sum-exp per row instead of probabilities,
//     and the head keeps its logits (the CUDA ops recompute softmax in the backwards).
// Precision: the compute type `dtype`. fp32 is fp32 throughout (cuBLAS in strict fp32). bf16
// (kernels/cuda/CudaOps.h's mixed precision) keeps activations, their gradients, the p2p tensors
// and the tp partial sums in bf16 (the vocab-parallel cross entropy's statistics: fp32) and reads a
// bf16 copy of the parameters, rounded from the fp32 master weights after every optimizer step;
// weight gradients, the dK/dV that Seq1F1B's slices accumulate, Adam moments, layernorm statistics,
// log-sum-exps and losses stay fp32. All work is queued on the context's stream. Parameters,
// gradients and Adam moments (and the bf16 copy) are allocated once, in create(); the batch's
// tokens by the first setBatch(), which must be in the context's sizing pass (so that no step
// allocates); activations, saved state and scratch come from the context's DeviceAllocator (the
// rank's pre-sized arena in the executor, runtime/cuda/DeviceArena.h). In the sizing pass
// (CudaContext::setSizing) every call makes the same requests of that allocator as in a step, in
// the same order, and queues nothing.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_GPUSTAGE_H
#define PIPEC_RUNTIME_CUDA_GPUSTAGE_H

#include "kernels/StageModel.h"
#include "kernels/cuda/CudaOps.h"
#include "runtime/Tensor.h"

#include "llvm/Support/Error.h"

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace pipec {

class GpuStage {
public:
  /// The layers [layerBegin, layerEnd) on tp rank `tpRank` of `tp`, queued on `ctx`'s stream
  /// (which must outlive the stage). Arguments as kernels::StageCompute's, plus the compute type
  /// `dtype` (see Precision above). `initLayers`: every layer's initial weights whole (tp = 1;
  /// `piperun --init-from`), cut for this rank, instead of the seeded initialisation.
  static llvm::Expected<std::unique_ptr<GpuStage>>
  create(kernels::cuda::CudaContext &ctx, const kernels::GptConfig &cfg, int layerBegin,
         int layerEnd, int tpRank, int tp, uint64_t seed, std::vector<std::pair<int, int>> slices,
         float lossScale, kernels::cuda::DType dtype = kernels::cuda::DType::F32,
         const std::vector<std::vector<float>> *initLayers = nullptr);
  /// The parameters create() gives these layers on each tp rank of `tp` (kernels/StageModel.h's
  /// layerParamCount)...
  static size_t paramCount(const kernels::GptConfig &cfg, int layerBegin, int layerEnd, int tp);
  /// ... and the device memory it allocates for them: fp32 parameters, gradients and Adam's two
  /// moments, the bf16 copy with bf16 compute, and the loss's accumulator. Computed, not
  /// allocated: a runner checks it against the free memory before it creates the stage.
  static size_t stateBytes(const kernels::GptConfig &cfg, int layerBegin, int layerEnd, int tp,
                           kernels::cuda::DType dtype);
  ~GpuStage();
  GpuStage(const GpuStage &) = delete;
  GpuStage &operator=(const GpuStage &) = delete;

  int parts() const;
  bool hasEmbedding() const;
  bool hasHead() const;

  /// The batch of this step (host), as StageCompute::setBatch; queued for upload (through a
  /// pinned copy that the previous step's upload must have left: call it between steps). With
  /// the embedding, it also plans the embedding backward's ordered sums of every slice on the
  /// host (runtime/cuda/EmbeddingGrad.h: a stable sort of the slice's rows by token) and
  /// uploads the plans with the tokens.
  llvm::Error setBatch(const std::vector<std::vector<int32_t>> &tokens);

  /// As StageCompute::forward; `input` and the result are device tensors of the compute type.
  llvm::Expected<TensorView> forward(int mb, int slice, int part, TensorView input);
  /// As StageCompute::output (a device tensor; empty on the last stage).
  llvm::Expected<TensorView> output(int mb, int slice);
  /// Adds the slice's (scaled) loss to the step's device accumulator (last stage only).
  llvm::Error accumulateLoss(int mb, int slice);
  /// Waits for the stream, returns the accumulated loss and resets the accumulator.
  llvm::Expected<double> takeLoss();

  llvm::Expected<TensorView> backwardInput(int mb, int slice, int part, TensorView gradOutput);
  llvm::Expected<TensorView> inputGrad(int mb, int slice);
  llvm::Error backwardWeight(int mb, int slice);

  /// Device spans, CPU layout (kernels::StageCompute::params()); fp32 in both compute types.
  /// params() is the master copy: in bf16 the kernels read a copy of it that only adamStep()
  /// refreshes.
  std::span<float> params();
  std::span<float> grads();
  /// AdamW's moments (device, fp32, laid out as params()) and its step count.
  std::span<float> adamFirstMoment();
  std::span<float> adamSecondMoment();
  int adamSteps() const;
  void setAdamSteps(int steps);
  /// After params() were written from outside (a checkpoint, --init-from): refreshes the copy
  /// the kernels read in bf16 (nothing in fp32).
  llvm::Error paramsWritten();
  std::pair<size_t, size_t> layerRange(int layer) const;
  std::pair<size_t, size_t> tiedEmbeddingRange() const;
  llvm::Error zeroGrads();
  llvm::Error adamStep(float lr, float beta1, float beta2, float eps, float weightDecay);

  struct Impl;

private:
  explicit GpuStage(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl;
};

} // namespace pipec

#endif // PIPEC_RUNTIME_CUDA_GPUSTAGE_H
