//===- CudaOps.h - CUDA primitive ops of the GPT, behind plain pointers -*- C++ -*-===//
//
// The CUDA counterparts of kernels/cpu/Ops.h, for the cuda backend's executor. Same names, same
// shapes, same row-major layouts and the same split of every backward into an input gradient
// and a (+=) weight gradient, so that the executor can call either backend from one interpreter
// and the tests can hold each CUDA op against its CPU reference.
//
// This header has no CUDA types: pointers are device pointers passed as void* (their element
// type is the `DType` argument), the stream lives in an opaque CudaContext, and every call
// returns llvm::Error — a failing CUDA or cuBLAS call becomes an error naming the call, its code
// and file:line (kernels/cuda/CudaCheck.h), a bad shape an error naming the argument.
//
// Precision. `DType::F32` is fp32 throughout (cuBLAS in strict fp32, no TF32), for the checks
// against the CPU. `DType::BF16` stores activations and the weights used by the matmuls in
// bf16 and accumulates in fp32; what must not lose bits stays fp32 in both modes: layernorm
// statistics, softmax log-sum-exps, weight and bias gradients, attention's dK/dV accumulators,
// and the optimizer's parameters and moments (AdamW runs on fp32 master weights; `convert`
// makes the bf16 copy).
//
// Where the CUDA API departs from the CPU one, it is to avoid quadratic buffers:
//   - attention keeps a log-sum-exp per query row (B, H, x) instead of the probabilities
//     (B, H, x, a+x), and its backward recomputes them (flash-attention style), taking the
//     forward's output as an input;
//   - cross entropy keeps a log-sum-exp per row (n) instead of the probabilities (n, V) and
//     returns the per-row losses on the device; the backward recomputes softmax from logits.
// All calls are asynchronous on the context's stream unless they say otherwise.
//
// Kernels. Where an op has several kernels (attention), the op chooses one from the shapes, the
// tensors' alignment, the context's device (its compute capability: the build has sm_80 and
// sm_90a code, and Hopper-only kernels run on a compute-capability-9.0 device alone) and the
// context's KernelConfig; never from the environment or a process-wide setting.
//
// Implementations (kernels/BUILD, one per backend flavour): contexts in CudaContext.cpp for
// every flavour; on a GPU, CudaOps.cpp (cuBLASLt matmuls) and KernelOps.cpp (the hand-written
// kernels of the .cu files, through Launch.h); on the emulated device
// (kernels/cuda/emu/README.md), emu/CudaOpsEmu.cpp (matmuls on the CPU) with either
// emu/CpuKernelOpsEmu.cpp (CPU stand-ins for the kernels) or KernelOps.cpp with the .cu files run
// by the kernel emulator.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_CUDA_CUDAOPS_H
#define PIPEC_KERNELS_CUDA_CUDAOPS_H

#include "kernels/cuda/DType.h"
#include "kernels/cuda/KernelConfig.h"
#include "llvm/Support/Error.h"

#include <cstddef>
#include <cstdint>
#include <memory>

namespace pipec::kernels::cuda {

/// Number of CUDA devices visible; an error when the driver or runtime is unusable (e.g. no GPU).
llvm::Expected<int> deviceCount();

/// Where a context's temporary buffers (and the executor's activations) come from. Memory handed
/// out is usable by work queued on the context's stream from then on; release() may be called
/// as soon as the work that uses it is queued (the memory is reused only by later work of the
/// same stream, or of streams ordered after it). The default is the stream-ordered allocator
/// (cudaMallocAsync / cudaFreeAsync on the context's stream); the executor installs a
/// pre-sized arena (runtime/cuda/DeviceArena.h).
class DeviceAllocator {
public:
  virtual ~DeviceAllocator() = default;
  /// `bytes` of device memory (null for 0 bytes), or an error naming the shortfall.
  virtual llvm::Expected<void *> allocate(size_t bytes) = 0;
  /// Gives back what allocate() returned (null is ignored).
  virtual void release(void *p) = 0;
};

/// A device, one stream on it, a cuBLASLt handle and its workspace, and how the ops queued
/// through it choose their kernels: the device's compute capability and the run's KernelConfig.
/// Not thread-safe: one per host thread (the executor has one per rank and stream role).
class CudaContext {
public:
  /// The oldest GPUs the build has kernels for: compute capability 8.0 (sm_80; A100).
  static constexpr int kMinComputeCapability = 80;
  /// Selects `device`, reads its compute capability (an error naming it for a device older than
  /// kMinComputeCapability: the build has no kernels for it), creates a non-blocking stream (or
  /// borrows `stream`, a cudaStream_t, which the context then does not destroy), a cuBLASLt
  /// handle and a 32 MiB workspace. Every op queued through the context chooses its kernels by
  /// the device and `config`.
  static llvm::Expected<std::unique_ptr<CudaContext>> create(int device, const KernelConfig &config,
                                                             void *stream = nullptr);
  /// The workspace's size: the device memory create() allocates.
  static constexpr size_t kWorkspaceBytes = size_t(32) << 20;
  ~CudaContext();
  CudaContext(const CudaContext &) = delete;
  CudaContext &operator=(const CudaContext &) = delete;

  int device() const;
  void *stream() const; ///< the cudaStream_t
  /// The device's compute capability, 10 major + minor (80, 86, 89, 90, ...).
  int computeCapability() const;
  const KernelConfig &kernelConfig() const;
  /// Blocks until everything queued on the stream has run; reports asynchronous kernel faults.
  llvm::Error synchronize();

  /// Synchronous copies (they synchronize the stream) and an asynchronous memset.
  llvm::Error upload(void *device, const void *host, size_t bytes);
  llvm::Error download(void *host, const void *device, size_t bytes);
  llvm::Error memsetZero(void *device, size_t bytes);

  /// Temporary buffers of the ops and the executor's activations: `allocator` from now on (kept
  /// by the caller; null restores the stream-ordered default).
  void setAllocator(DeviceAllocator *allocator);
  DeviceAllocator &allocator();

  /// The sizing pass (runtime/cuda/DeviceArena.h), off by default. While it is on, every op of
  /// this header checks its shapes and takes and gives back its scratch through the allocator
  /// exactly as it otherwise would, but queues no device work: no kernel, copy, memset or
  /// cuBLASLt call (so a matmul for which cuBLASLt has no algorithm fails only when it runs).
  /// upload(), download(), memsetZero() and synchronize() do nothing (download() leaves the host
  /// buffer as it was). Pointers need not point anywhere then.
  void setSizing(bool on);
  bool sizing() const;

  struct Impl;
  Impl &impl() { return *impl_; }

private:
  explicit CudaContext(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Owning device memory (cudaMalloc / cudaFree).
class DeviceBuffer {
public:
  static llvm::Expected<DeviceBuffer> allocate(size_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer &&other) noexcept;
  DeviceBuffer &operator=(DeviceBuffer &&other) noexcept;
  DeviceBuffer(const DeviceBuffer &) = delete;
  DeviceBuffer &operator=(const DeviceBuffer &) = delete;
  ~DeviceBuffer();

  void *data() const { return ptr_; }
  template <typename T> T *as() const { return static_cast<T *>(ptr_); }
  size_t bytes() const { return bytes_; }

private:
  void *ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// dst (n) = src (n) converted (fp32 -> bf16 rounds to nearest even); same dtypes copy.
llvm::Error convert(CudaContext &ctx, DType dstType, void *dst, DType srcType, const void *src,
                    size_t n);

//===--- Matmuls (cuBLASLt): the B/W split of kernels/cpu/Ops.h ------------===//
// `dtype` is that of in, w, out, dOut, dIn and bias; weight and bias gradients are fp32.

/// out (n, o) = in (n, i) @ w (i, o) + bias (o); `bias` may be null.
llvm::Error matmulForward(CudaContext &ctx, DType dtype, void *out, const void *in, const void *w,
                          const void *bias, int n, int i, int o);
/// dIn (n, i) = dOut (n, o) @ w^T.
llvm::Error matmulBackwardInput(CudaContext &ctx, DType dtype, void *dIn, const void *dOut,
                                const void *w, int n, int i, int o);
/// dW (i, o) += in^T @ dOut; dBias (o) += column sums of dOut (`dBias` may be null).
llvm::Error matmulBackwardWeight(CudaContext &ctx, DType dtype, float *dW, float *dBias,
                                 const void *in, const void *dOut, int n, int i, int o);
/// The LM head's transposed weight w (o, i): out (n, o) = in (n, i) @ w^T.
llvm::Error matmulTForward(CudaContext &ctx, DType dtype, void *out, const void *in, const void *w,
                           int n, int i, int o);
/// dIn (n, i) = dOut (n, o) @ w.
llvm::Error matmulTBackwardInput(CudaContext &ctx, DType dtype, void *dIn, const void *dOut,
                                 const void *w, int n, int i, int o);
/// dW (o, i) += dOut^T @ in.
llvm::Error matmulTBackwardWeight(CudaContext &ctx, DType dtype, float *dW, const void *in,
                                  const void *dOut, int n, int i, int o);

//===--- Layernorm (eps 1e-5); w, b in `dtype`, statistics and gradients of w, b fp32 ------===//

/// out (n, c) = (in - mean) * rstd * w + b; mean, rstd (n) fp32.
llvm::Error layernormForward(CudaContext &ctx, DType dtype, void *out, float *mean, float *rstd,
                             const void *in, const void *w, const void *b, int n, int c);
/// dIn (n, c) += the gradient of in from dOut (n, c).
llvm::Error layernormBackwardInputAccumulate(CudaContext &ctx, DType dtype, void *dIn,
                                             const void *dOut, const void *in, const float *mean,
                                             const float *rstd, const void *w, int n, int c);
/// dW (c) += sum over rows of dOut * xhat; dB (c) += sum over rows of dOut.
llvm::Error layernormBackwardWeight(CudaContext &ctx, DType dtype, float *dW, float *dB,
                                    const void *dOut, const void *in, const float *mean,
                                    const float *rstd, int n, int c);

//===--- Llama-style block: RMSNorm, SwiGLU, rotary embeddings ------------===//
// kernels/cpu/LlamaOps.h's formulas (rotate-half pairs).

/// out (n, c) = in * rstd * w, rstd (n) = 1 / sqrt(mean(in^2) + eps), fp32.
llvm::Error rmsnormForward(CudaContext &ctx, DType dtype, void *out, float *rstd, const void *in,
                           const void *w, int n, int c, float eps = 1e-5f);
/// dIn (n, c) += the gradient of in from dOut (n, c).
llvm::Error rmsnormBackwardInputAccumulate(CudaContext &ctx, DType dtype, void *dIn,
                                           const void *dOut, const void *in, const float *rstd,
                                           const void *w, int n, int c);
/// dW (c) += sum over rows of dOut * in * rstd (the same bits every launch).
llvm::Error rmsnormBackwardWeight(CudaContext &ctx, DType dtype, float *dW, const void *dOut,
                                  const void *in, const float *rstd, int n, int c);
/// out (n, f) = silu(gate) * up, where each row of pre (n, 2f) is gate | up (the stage's fc
/// output).
llvm::Error swigluForward(CudaContext &ctx, DType dtype, void *out, const void *pre, int n, int f);
/// dPre (n, 2f) = the gradients of gate | up from dOut (n, f).
llvm::Error swigluBackward(CudaContext &ctx, DType dtype, void *dPre, const void *dOut,
                           const void *pre, int n, int f);
/// Rotary embeddings of x (rows, heads * headDim) in place, row r at device positions[r]: the
/// pair (i, i + headDim/2) of each head turns by positions[r] * theta^(-2i / headDim).
llvm::Error ropeForward(CudaContext &ctx, DType dtype, void *x, const int32_t *positions, int rows,
                        int heads, int headDim, double theta);
/// The gradient through ropeForward, in place (the rotation transposed).
llvm::Error ropeBackward(CudaContext &ctx, DType dtype, void *dx, const int32_t *positions,
                         int rows, int heads, int headDim, double theta);

//===--- GELU (tanh approximation) ----------------------------------------===//

/// out (n) = gelu(in).
llvm::Error geluForward(CudaContext &ctx, DType dtype, void *out, const void *in, size_t n);
/// dIn (n) = gelu'(in) * dOut.
llvm::Error geluBackward(CudaContext &ctx, DType dtype, void *dIn, const void *dOut, const void *in,
                         size_t n);

//===--- Causal attention of a query slice [a, a + x) over keys [0, a + x) ----===//

/// The CPU's shape: q, out (B, x, H*hd); k, v (a + x, B, H*hd), position-major. headDim <= 256.
struct AttentionShape {
  int batch;   // B
  int queries; // x: tokens of the slice
  int begin;   // a: position of the slice's first token
  int heads;   // H
  int headDim; // hd
  /// Key/value heads (grouped-query attention: query head h reads key/value head
  /// h / (H / kvHeads)); 0: one per query head. k, v and their gradients are
  /// (a + x, B, kvHeads*hd).
  int kvHeads = 0;
  int keys() const { return begin + queries; }
  int width() const { return heads * headDim; }
  int kvHeadCount() const { return kvHeads > 0 ? kvHeads : heads; }
};
/// out (B, x, H*hd) = softmax(q k^T / sqrt(hd), causal) v; lse (B, H, x) fp32, the log-sum-exp
/// of each query row's scaled scores, for the backward. The kernel (docs/gpu.md): wgmma on a
/// compute-capability-9.0 GPU for bf16 with head dimension 64 or 128 (unless the context's
/// KernelConfig turns the Hopper kernels off), mma.sync for other bf16 head dimensions that are
/// multiples of 16 up to 128 and on other GPUs, SIMT otherwise (fp32, unaligned tensors).
llvm::Error attentionForward(CudaContext &ctx, DType dtype, void *out, float *lse, const void *q,
                             const void *k, const void *v, const AttentionShape &s);
/// dq (B, x, H*hd) = the gradient of q; dk, dv (a + x, B, H*hd) += those of keys and values.
/// `out` and `lse` are the forward's. dk and dv are fp32 in every compute type: Seq1F1B's slices
/// all add to the gradients of the earlier keys, and a bf16 sum would round once per slice.
/// mma.sync where the forward's tensor-core condition holds, SIMT otherwise, on every GPU.
/// Grouped-query attention (kvHeads < heads) runs on the SIMT kernels, forward and backward;
/// the backward sums each key/value head's gradients over its group in a fixed order.
llvm::Error attentionBackward(CudaContext &ctx, DType dtype, void *dq, float *dk, float *dv,
                              const void *dOut, const void *out, const float *lse, const void *q,
                              const void *k, const void *v, const AttentionShape &s);

//===--- Softmax cross entropy --------------------------------------------===//

/// rowLoss (n) = scale * (logsumexp(logits_r) - logits_r[target_r]); lse (n); both fp32.
/// The CPU's return value is the sum of rowLoss.
llvm::Error crossEntropyForward(CudaContext &ctx, DType dtype, float *rowLoss, float *lse,
                                const void *logits, const int32_t *targets, int n, int v,
                                float scale);
/// Vocab-parallel cross entropy (kernels/cpu/Ops.h has the CPU's): logits (n, v) hold the
/// vocabulary columns [vocabBegin, vocabBegin + v) of shard `part` of `parts`; stats
/// (ops::crossEntropyStatsFloats(n, parts), fp32) get the row's (max, sum of exp) at the shard's
/// place and its target's logit where the shard has it, zeros elsewhere: summed over the
/// shards (the tp all-reduce), crossEntropyCombine turns them into rowLoss and lse as
/// crossEntropyForward's over the whole vocabulary.
llvm::Error crossEntropyShardStats(CudaContext &ctx, DType dtype, float *stats, const void *logits,
                                   const int32_t *targets, int n, int v, int vocabBegin, int part,
                                   int parts);
llvm::Error crossEntropyCombine(CudaContext &ctx, float *rowLoss, float *lse, const float *stats,
                                int n, int parts, float scale);
/// dLogits (n, v) = (softmax(logits) - onehot(target)) * scale, softmax from the forward's lse.
/// dLogits may be logits itself (in place). With `vocabBegin`, logits are the columns
/// [vocabBegin, vocabBegin + v) of a vocab-parallel shard and lse that of the whole vocabulary.
llvm::Error crossEntropyBackward(CudaContext &ctx, DType dtype, void *dLogits, const void *logits,
                                 const float *lse, const int32_t *targets, int n, int v,
                                 float scale, int vocabBegin = 0);

//===--- AdamW on fp32 master weights -------------------------------------===//

/// One AdamW step, exactly the CPU's formula (bias-corrected, `step` from 1, decoupled decay).
llvm::Error adamUpdate(CudaContext &ctx, float *params, const float *grads, float *m, float *v,
                       size_t n, float lr, float beta1, float beta2, float eps, float weightDecay,
                       int step);

} // namespace pipec::kernels::cuda

#endif // PIPEC_KERNELS_CUDA_CUDAOPS_H
