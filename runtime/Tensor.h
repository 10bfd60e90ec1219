//===- Tensor.h - A typed view of a tensor the runtime moves -------*- C++ -*-===//
//
// What a backend hands the transport and the transport moves: `count` elements of `type` at
// `data`, host memory (cpu backend) or device memory (cuda backends). The cpu backend's tensors
// are always fp32; the cuda backends' p2p tensors and tp partial sums are in the run's compute
// type (fp32 or bf16), their gradients (dp and embedding all-reduces) fp32.
//
// A view converts implicitly from a float span (fp32) and, for the cpu stage's calls, back to a
// const float span; the latter asserts fp32, as does floats().
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_TENSOR_H
#define PIPEC_RUNTIME_TENSOR_H

#include "kernels/DType.h"

#include <cassert>
#include <cstddef>
#include <span>

namespace pipec {

using kernels::DType;

struct TensorView {
  void *data = nullptr;
  size_t count = 0;
  DType type = DType::F32;

  TensorView() = default;
  TensorView(void *data, size_t count, DType type) : data(data), count(count), type(type) {}
  TensorView(std::span<float> s) : data(s.data()), count(s.size()) {}
  /// A const span's view: the runtime reads it only (a send's tensor, a stage input).
  TensorView(std::span<const float> s) : data(const_cast<float *>(s.data())), count(s.size()) {}

  size_t bytes() const { return count * kernels::sizeOf(type); }
  bool empty() const { return count == 0; }
  /// Elements [offset, offset + n).
  TensorView sub(size_t offset, size_t n) const {
    assert(offset + n <= count && "view out of range");
    return {static_cast<char *>(data) + offset * kernels::sizeOf(type), n, type};
  }
  /// The fp32 elements (an fp32 view only).
  std::span<float> floats() const {
    assert(type == DType::F32 && "floats() of a bf16 tensor");
    return {static_cast<float *>(data), count};
  }
  operator std::span<const float>() const { return floats(); }
};

} // namespace pipec

#endif // PIPEC_RUNTIME_TENSOR_H
