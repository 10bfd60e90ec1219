//===- Attention.cu - which attention kernel runs, and its launch ----------===//
//
// The entry points of Launch.h for causal attention: each call chooses one kernel family
// (Attention.cuh) from the shapes, the tensors' alignment and the device (launch::Target), and
// launches it. The choice is a pure function of those (attentionForwardKernel,
// attentionBackwardKernel), so that tests can check it for devices they do not have:
//   forward   wgmma (AttentionWgmma.cu) on a compute-capability-9.0 device with the Hopper
//             kernels allowed, bf16, head dimension 64 or 128, 16-byte aligned tensors;
//             else mma.sync (AttentionMmaSync.cu) for bf16, head dimensions that are multiples of
//             16 up to 128, 16-byte aligned tensors (every device of the build: sm_80 and newer);
//             else SIMT (AttentionSimt.cu);
//   backward  the row dots (SIMT), then mma.sync where the forward's tensor-core condition
//             holds, else SIMT; on every device.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/Attention.cuh"

namespace pipec::kernels::cuda::launch {

static bool aligned16(const void *p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

/// launch(s) with the call's Dims s; nothing for an empty call, cudaErrorInvalidValue for a head
/// dimension no kernel takes.
template <typename Launch> static cudaError_t withDims(AttentionDims dims, Launch launch) {
  const attention::Dims s = attention::toDims(dims);
  if (s.batch == 0 || s.queries == 0 || s.heads == 0)
    return cudaSuccess;
  if (s.headDim <= 0 || s.headDim > kMaxHeadDim)
    return cudaErrorInvalidValue;
  return launch(s);
}

const char *toString(AttentionKernel kernel) {
  switch (kernel) {
  case AttentionKernel::Simt:
    return "SIMT";
  case AttentionKernel::MmaSync:
    return "mma.sync";
  case AttentionKernel::Wgmma:
    return "wgmma";
  }
  return "?";
}

bool attentionUsesTensorCores(DType dtype, AttentionDims s,
                              std::initializer_list<const void *> tensors) {
  if (dtype != DType::BF16 || !attention::mmaSyncHeadDim(s.headDim))
    return false;
  if (s.kvHeads > 0 && s.kvHeads != s.heads)
    return false; // grouped key/value heads: the SIMT kernels

  for (const void *p : tensors)
    if (!aligned16(p))
      return false;
  return true;
}

AttentionKernel attentionForwardKernel(const Target &target, DType dtype, AttentionDims s,
                                       std::initializer_list<const void *> tensors) {
  if (!attentionUsesTensorCores(dtype, s, tensors))
    return AttentionKernel::Simt;
  if (target.hopper() && attention::wgmmaHeadDim(s.headDim))
    return AttentionKernel::Wgmma;
  return AttentionKernel::MmaSync;
}

AttentionKernel attentionBackwardKernel(DType dtype, AttentionDims s,
                                        std::initializer_list<const void *> tensors) {
  return attentionUsesTensorCores(dtype, s, tensors) ? AttentionKernel::MmaSync
                                                     : AttentionKernel::Simt;
}

size_t attentionBackwardScratchFloats(AttentionDims s) {
  return size_t(s.batch) * size_t(s.heads) * size_t(s.queries);
}

cudaError_t attentionForward(const Target &target, DType dtype, void *out, float *lse,
                             const void *q, const void *k, const void *v, AttentionDims dims,
                             cudaStream_t stream) {
  return withDims(dims, [&](const attention::Dims &s) {
    using attention::bf16;
    switch (attentionForwardKernel(target, dtype, dims, {out, q, k, v})) {
    case AttentionKernel::Wgmma:
      return attention::wgmmaForward(static_cast<bf16 *>(out), lse, static_cast<const bf16 *>(q),
                                     static_cast<const bf16 *>(k), static_cast<const bf16 *>(v), s,
                                     stream);
    case AttentionKernel::MmaSync:
      return attention::mmaSyncForward(static_cast<bf16 *>(out), lse, static_cast<const bf16 *>(q),
                                       static_cast<const bf16 *>(k), static_cast<const bf16 *>(v),
                                       s, stream);
    case AttentionKernel::Simt:
      return attention::simtForward(dtype, out, lse, q, k, v, s, stream);
    }
    return cudaErrorInvalidValue;
  });
}

cudaError_t attentionBackward(DType dtype, void *dq, float *dk, float *dv, const void *dOut,
                              const void *out, const float *lse, const void *q, const void *k,
                              const void *v, float *rowDot, AttentionDims dims,
                              cudaStream_t stream) {
  return withDims(dims, [&](const attention::Dims &s) {
    if (cudaError_t err = attention::rowDot(dtype, rowDot, dOut, out, s, stream))
      return err;
    using attention::bf16;
    if (attentionBackwardKernel(dtype, dims, {dq, dk, dv, dOut, out, q, k, v}) ==
        AttentionKernel::MmaSync)
      return attention::mmaSyncBackward(static_cast<bf16 *>(dq), dk, dv,
                                        static_cast<const bf16 *>(dOut), lse, rowDot,
                                        static_cast<const bf16 *>(q), static_cast<const bf16 *>(k),
                                        static_cast<const bf16 *>(v), s, stream);
    return attention::simtBackward(dtype, dq, dk, dv, dOut, lse, rowDot, q, k, v, s, stream);
  });
}

} // namespace pipec::kernels::cuda::launch
