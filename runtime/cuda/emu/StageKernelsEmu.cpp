//===- StageKernelsEmu.cpp - runtime/cuda/StageKernels.h on the CPU (emulated device) -===//
//
// The glue kernels of a GPU stage written as plain loops over host memory, for the emulated
// device (kernels/cuda/emu/README.md); each follows its contract in StageKernels.h, independently
// of the .cu version, and runs in its stream's order (emu::enqueue). bf16 elements are read into
// fp32 and rounded once when stored (kernels/HostBf16.h), as the contract says.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/StageKernels.h"

#include "kernels/HostBf16.h"
#include "kernels/cuda/emu/FakeCuda.h"

namespace pipec::runtime::cuda::launch {

namespace {
/// Row r = (b, t) of a slice of x tokens is row (begin + t) * batch + b of the position-major
/// K/V.
size_t kvRow(int r, int x, int batch, int begin) {
  return size_t(begin + r % x) * size_t(batch) + size_t(r / x);
}

/// Elements of `dtype` at `p`, read as and written from fp32.
struct Elements {
  void *p;
  DType dtype;
  Elements(const void *p, DType dtype) : p(const_cast<void *>(p)), dtype(dtype) {}
  float get(size_t i) const {
    if (dtype == DType::F32)
      return static_cast<const float *>(p)[i];
    return kernels::bf16ToFloat(static_cast<const uint16_t *>(p)[i]);
  }
  void set(size_t i, float value) const {
    if (dtype == DType::F32)
      static_cast<float *>(p)[i] = value;
    else
      static_cast<uint16_t *>(p)[i] = kernels::floatToBf16(value);
  }
};
} // namespace

cudaError_t embeddingForward(DType dtype, void *resid, const int32_t *inputs, const void *wte,
                             const void *wpe, int n, int x, int begin, int c, int vocabBegin,
                             int localVocab, cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] {
    Elements out(resid, dtype), te(wte, dtype), pe(wpe, dtype);
    for (int r = 0; r < n; ++r) {
      const int local = inputs[r] - vocabBegin;
      const bool held = local >= 0 && local < localVocab;
      for (int k = 0; k < c; ++k)
        out.set(size_t(r) * c + k, (held ? te.get(size_t(local) * c + k) : 0.0f) +
                                       (wpe ? pe.get(size_t(begin + r % x) * c + k) : 0.0f));
    }
  });
  return cudaSuccess;
}

cudaError_t embeddingBackward(DType dtype, float *dWte, float *dWpe, const void *dEmb,
                              const int32_t *inputs, [[maybe_unused]] const EmbeddingGradArgs &plan,
                              int n, int x, int begin, int c, int vocabBegin, int localVocab,
                              cudaStream_t stream) {
  // (Row order for both: the plan only says in which order and pieces the kernel adds them.)
  pipec::emu::enqueue(stream, [=] {
    Elements d(dEmb, dtype);
    for (int r = 0; r < n; ++r)
      for (int k = 0; k < c; ++k) {
        const float g = d.get(size_t(r) * c + k);
        const int local = inputs[r] - vocabBegin;
        if (local >= 0 && local < localVocab)
          dWte[size_t(local) * c + k] += g;
        if (dWpe)
          dWpe[size_t(begin + r % x) * c + k] += g;
      }
  });
  return cudaSuccess;
}

cudaError_t residualAdd(DType dtype, void *resid, const void *branch, const void *bias, int n,
                        int c, cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] {
    Elements out(resid, dtype), br(branch, dtype), bs(bias, dtype);
    for (size_t i = 0; i < size_t(n) * c; ++i)
      out.set(i, bias ? out.get(i) + (br.get(i) + bs.get(i % size_t(c))) : out.get(i) + br.get(i));
  });
  return cudaSuccess;
}

cudaError_t splitQkv(DType dtype, void *q, void *k, void *v, const void *qkv, int n, int x,
                     int batch, int begin, int cl, int kvl, cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] {
    Elements qs(q, dtype), ks(k, dtype), vs(v, dtype), in(qkv, dtype);
    for (int r = 0; r < n; ++r) {
      const size_t row = size_t(r) * size_t(cl + 2 * kvl);
      const size_t kv = kvRow(r, x, batch, begin) * kvl;
      for (int j = 0; j < cl; ++j)
        qs.set(size_t(r) * cl + j, in.get(row + j));
      for (int j = 0; j < kvl; ++j) {
        ks.set(kv + j, in.get(row + cl + j));
        vs.set(kv + j, in.get(row + cl + kvl + j));
      }
    }
  });
  return cudaSuccess;
}

cudaError_t gatherQkv(DType dtype, void *dQkv, const void *dq, const float *dk, const float *dv,
                      int n, int x, int batch, int begin, int cl, int kvl, cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] {
    Elements out(dQkv, dtype), qs(dq, dtype), ks(dk, DType::F32), vs(dv, DType::F32);
    for (int r = 0; r < n; ++r) {
      const size_t row = size_t(r) * size_t(cl + 2 * kvl);
      const size_t kv = kvRow(r, x, batch, begin) * kvl;
      for (int j = 0; j < cl; ++j)
        out.set(row + j, qs.get(size_t(r) * cl + j));
      for (int j = 0; j < kvl; ++j) {
        out.set(row + cl + j, ks.get(kv + j));
        out.set(row + cl + kvl + j, vs.get(kv + j));
      }
    }
  });
  return cudaSuccess;
}

cudaError_t sumPair(float *a, float *b, size_t n, cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] {
    for (size_t i = 0; i < n; ++i)
      a[i] = b[i] = a[i] + b[i];
  });
  return cudaSuccess;
}

cudaError_t sumInOrder(DType dtype, const SumOperands &ops, int count, size_t n,
                       cudaStream_t stream) {
  if (count > kMaxSumOperands)
    return cudaErrorInvalidValue;
  pipec::emu::enqueue(stream, [=] {
    for (size_t i = 0; i < n && count > 1; ++i) {
      float s = Elements(ops.buffers[0], dtype).get(i);
      for (int b = 1; b < count; ++b)
        s += Elements(ops.buffers[b], dtype).get(i);
      for (int b = 0; b < count; ++b)
        Elements(ops.buffers[b], dtype).set(i, s);
    }
  });
  return cudaSuccess;
}

cudaError_t accumulateSum(double *acc, const float *x, int n, cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] {
    double s = 0;
    for (int i = 0; i < n; ++i)
      s += double(x[i]);
    *acc += s;
  });
  return cudaSuccess;
}

} // namespace pipec::runtime::cuda::launch
