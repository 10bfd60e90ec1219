//===- StageKernelsEmu.cpp - runtime/cuda/StageKernels.h on the CPU (emulated device) -===//
//
// The glue kernels of a GPU stage written as plain loops over host memory, for the emulated
// device (kernels/cuda/emu/README.md); each follows its contract in StageKernels.h, independently
// of the .cu version, and runs in its stream's order (emu::enqueue).
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/StageKernels.h"

#include "kernels/cuda/emu/FakeCuda.h"

namespace pipec::runtime::cuda::launch {

namespace {
/// Row r = (b, t) of a slice of x tokens is row (begin + t) * batch + b of the position-major
/// K/V.
size_t kvRow(int r, int x, int batch, int begin) {
  return size_t(begin + r % x) * size_t(batch) + size_t(r / x);
}
} // namespace

cudaError_t embeddingForward(float *resid, const int32_t *inputs, const float *wte,
                             const float *wpe, int n, int x, int begin, int c,
                             cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] {
    for (int r = 0; r < n; ++r)
      for (int k = 0; k < c; ++k)
        resid[size_t(r) * c + k] =
            wte[size_t(inputs[r]) * c + k] + wpe[size_t(begin + r % x) * c + k];
  });
  return cudaSuccess;
}

cudaError_t embeddingBackward(float *dWte, float *dWpe, const float *dEmb, const int32_t *inputs,
                              int n, int x, int begin, int c, cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] {
    for (int r = 0; r < n; ++r)
      for (int k = 0; k < c; ++k) {
        dWte[size_t(inputs[r]) * c + k] += dEmb[size_t(r) * c + k];
        if (dWpe)
          dWpe[size_t(begin + r % x) * c + k] += dEmb[size_t(r) * c + k];
      }
  });
  return cudaSuccess;
}

cudaError_t residualAdd(float *resid, const float *branch, const float *bias, int n, int c,
                        cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] {
    for (size_t i = 0; i < size_t(n) * c; ++i)
      resid[i] += branch[i] + bias[i % size_t(c)];
  });
  return cudaSuccess;
}

cudaError_t splitQkv(float *q, float *k, float *v, const float *qkv, int n, int x, int batch,
                     int begin, int cl, cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] {
    for (int r = 0; r < n; ++r) {
      const float *row = qkv + size_t(r) * 3 * cl;
      const size_t kv = kvRow(r, x, batch, begin) * cl;
      for (int j = 0; j < cl; ++j) {
        q[size_t(r) * cl + j] = row[j];
        k[kv + j] = row[cl + j];
        v[kv + j] = row[2 * cl + j];
      }
    }
  });
  return cudaSuccess;
}

cudaError_t gatherQkv(float *dQkv, const float *dq, const float *dk, const float *dv, int n, int x,
                      int batch, int begin, int cl, cudaStream_t stream) {
  pipec::emu::enqueue(stream, [=] {
    for (int r = 0; r < n; ++r) {
      float *row = dQkv + size_t(r) * 3 * cl;
      const size_t kv = kvRow(r, x, batch, begin) * cl;
      for (int j = 0; j < cl; ++j) {
        row[j] = dq[size_t(r) * cl + j];
        row[cl + j] = dk[kv + j];
        row[2 * cl + j] = dv[kv + j];
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

cudaError_t sumInOrder(const SumOperands &ops, int count, size_t n, cudaStream_t stream) {
  if (count > kMaxSumOperands)
    return cudaErrorInvalidValue;
  pipec::emu::enqueue(stream, [=] {
    for (size_t i = 0; i < n && count > 1; ++i) {
      float s = ops.buffers[0][i];
      for (int b = 1; b < count; ++b)
        s += ops.buffers[b][i];
      for (int b = 0; b < count; ++b)
        ops.buffers[b][i] = s;
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
