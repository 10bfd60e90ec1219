//===- StageDevice.h - What a device provides to the stage template -*- C++ -*-===//
//
// The contract between the stage template (kernels/StageProgram.h) and a device that runs it:
// the host (kernels/cpu/Gpt.cpp) or a CUDA stream, on a GPU or the emulated device
// (runtime/cuda/GpuStage.cpp). Each device's definition is checked against StageDevice with a
// static_assert, so a missing or mistyped operation is reported there, by name, rather than
// deep inside an instantiation of the template.
//
// Every operation returns llvm::Error (the host's never fail); the order in which the template
// allocates is the device's (a GPU's arena is sized by running these calls). Types:
//   Act    an activation buffer in the compute type; Ptr / CPtr an element pointer of one;
//   F32    an fp32 buffer (norm statistics, attention's saved state, dK/dV, loss statistics);
//   In     a part's input (a received activation or gradient); Out what a part hands to the
//          runtime (the buffer its tp all-reduce sums, or the stage's output);
//   Loss   the head's own saved state (the CPU keeps softmax probabilities, a GPU its logits'
//          log-sum-exps), whose forEach visits its buffers.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_STAGEDEVICE_H
#define PIPEC_KERNELS_STAGEDEVICE_H

#include "llvm/Support/Error.h"

#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

namespace pipec::kernels {

/// Grouped-query attention's shape, as the devices take it.
struct StageAttentionShape {
  int batch, queries, begin, heads, kvHeads, headDim;
};

/// Which rows a rotary embedding turns: a slice's rows in (b, t) order (queries), or its K/V
/// rows in position-major (t, b) order (keys).
enum class RopeRows { Queries, Keys };

/// The fp32 arrays of a stage, each laid out as its parameters (kernels/StageModel.h).
enum class StageState { Params, Grads, AdamFirstMoment, AdamSecondMoment };

namespace stage_device {
/// Visits nothing: the type of the callbacks a Loss's forEach is checked with.
struct AnyBuffer {
  template <typename T> void operator()(T &) const {}
};
} // namespace stage_device

template <class D>
concept StageDevice = requires(D d, typename D::Act &a, typename D::Act &a2,
                               const typename D::Act &ca, typename D::F32 &f,
                               const typename D::F32 &cf, typename D::Loss &loss, typename D::In in,
                               typename D::Ptr p, typename D::CPtr cp, float *g, const float *cg,
                               const StageAttentionShape &shape, RopeRows rows,
                               std::vector<float> host, StageState state, size_t count, int i,
                               float x, double theta, bool flag) {
  // Types.
  requires std::default_initializable<typename D::Act> && std::movable<typename D::Act>;
  requires std::default_initializable<typename D::F32> && std::movable<typename D::F32>;
  requires std::default_initializable<typename D::Out>;
  requires std::convertible_to<typename D::Ptr, typename D::CPtr>;
  loss.forEach(stage_device::AnyBuffer());

  // Memory: buffers, the pointers into them, the parts' inputs and outputs.
  { d.alloc(a, count) } -> std::same_as<llvm::Error>;
  { d.alloc(f, count) } -> std::same_as<llvm::Error>;
  { d.allocZero(a, count) } -> std::same_as<llvm::Error>;
  { d.allocZero(f, count) } -> std::same_as<llvm::Error>;
  d.release(a);
  d.release(f);
  { d.copy(a, a2) } -> std::same_as<llvm::Error>;
  { d.input(a, in, count) } -> std::same_as<llvm::Error>;
  { d.out(a) } -> std::same_as<typename D::Out>;
  { d.out(f) } -> std::same_as<typename D::Out>;
  { D::ptr(a) } -> std::same_as<typename D::Ptr>;
  { D::ptr(f) } -> std::same_as<float *>;
  { D::at(a, count) } -> std::same_as<typename D::Ptr>;
  { D::size(ca) } -> std::same_as<size_t>;
  { D::size(cf) } -> std::same_as<size_t>;

  // The stage's fp32 state and the compute copy of the parameters, by flat offset.
  { d.param(count) } -> std::convertible_to<typename D::CPtr>;
  { d.grad(count) } -> std::same_as<float *>;
  { d.state(state) } -> std::same_as<std::span<float>>;
  { d.allocateState(std::move(host)) } -> std::same_as<llvm::Error>;
  { d.zeroGrads() } -> std::same_as<llvm::Error>;
  { d.adamUpdate(x, x, x, x, x, i) } -> std::same_as<llvm::Error>;

  // Norms: LayerNorm (out, mean, rstd, in, w, b, rows, channels, eps) and RMSNorm.
  { d.layernormForward(p, g, g, cp, cp, cp, i, i, x) } -> std::same_as<llvm::Error>;
  { d.layernormBackwardInputAccumulate(p, cp, cp, cg, cg, cp, i, i) } -> std::same_as<llvm::Error>;
  { d.layernormBackwardWeight(g, g, cp, cp, cg, cg, i, i) } -> std::same_as<llvm::Error>;
  { d.rmsnormForward(p, g, cp, cp, i, i, x) } -> std::same_as<llvm::Error>;
  { d.rmsnormBackwardInputAccumulate(p, cp, cp, cg, cp, i, i) } -> std::same_as<llvm::Error>;
  { d.rmsnormBackwardWeight(g, cp, cp, cg, i, i) } -> std::same_as<llvm::Error>;

  // Matmuls (kernels/cpu/Ops.h's six: x W + b, and the LM head's x W^T).
  { d.matmulForward(p, cp, cp, cp, i, i, i) } -> std::same_as<llvm::Error>;
  { d.matmulBackwardInput(p, cp, cp, i, i, i) } -> std::same_as<llvm::Error>;
  { d.matmulBackwardWeight(g, g, cp, cp, i, i, i) } -> std::same_as<llvm::Error>;
  { d.matmulTForward(p, cp, cp, i, i, i) } -> std::same_as<llvm::Error>;
  { d.matmulTBackwardInput(p, cp, cp, i, i, i) } -> std::same_as<llvm::Error>;
  { d.matmulTBackwardWeight(g, cp, cp, i, i, i) } -> std::same_as<llvm::Error>;

  // The MLP's activations and the residual add (with the row-parallel bias, or null).
  { d.geluForward(p, cp, count) } -> std::same_as<llvm::Error>;
  { d.geluBackward(p, cp, cp, count) } -> std::same_as<llvm::Error>;
  { d.swigluForward(p, cp, i, i) } -> std::same_as<llvm::Error>;
  { d.swigluBackward(p, cp, cp, i, i) } -> std::same_as<llvm::Error>;
  { d.residualAdd(p, cp, cp, i, i) } -> std::same_as<llvm::Error>;

  // Attention: rotary embeddings, the K/V of a microbatch's slices, the split of qkv's rows
  // into q and the position-major K/V and its gradient's gather, the attention itself.
  { d.rope(p, rows, i, i, i, i, theta, flag) } -> std::same_as<llvm::Error>;
  { d.ropeF32(g, i, i, i, i, theta) } -> std::same_as<llvm::Error>;
  { d.reserveSequenceKv(a, a2, i, i) } -> std::same_as<llvm::Error>;
  { d.reserveKv(a, a2, i, i, i, i) } -> std::same_as<llvm::Error>;
  { d.splitQkv(p, p, p, cp, i, i, i, i, i, i) } -> std::same_as<llvm::Error>;
  { d.gatherQkv(p, cp, cg, cg, i, i, i, i, i, i) } -> std::same_as<llvm::Error>;
  { D::attentionSavedFloats(shape) } -> std::same_as<size_t>;
  { d.attentionForward(p, g, cp, cp, cp, shape) } -> std::same_as<llvm::Error>;
  { d.attentionBackward(p, g, g, cp, cp, cg, cp, cp, cp, shape) } -> std::same_as<llvm::Error>;

  // The embedding (mb, slice name the batch's tokens) and the loss, whole or vocab-parallel.
  { d.embeddingForward(p, i, i, cp, cp, i, i, i, i, i, i) } -> std::same_as<llvm::Error>;
  { d.embeddingBackward(g, g, cp, i, i, i, i, i, i, i, i) } -> std::same_as<llvm::Error>;
  { d.lossForward(loss, a, i, i, i, i, x) } -> std::same_as<llvm::Error>;
  { d.lossShardStats(loss, a, f, i, i, i, i, i, i, i) } -> std::same_as<llvm::Error>;
  { d.lossCombine(loss, f, i, i, x) } -> std::same_as<llvm::Error>;
  { d.lossBackward(loss, a, a2, i, i, i, i, i, i, x) } -> std::same_as<llvm::Error>;
};

} // namespace pipec::kernels

#endif // PIPEC_KERNELS_STAGEDEVICE_H
