//===- HostBf16.h - bf16 conversions on the host ------------------*- C++ -*-===//
//
// bf16 as its 16 bits (the high half of an fp32), for host code that reads or writes device-format
// bf16: the emulated device's CPU ops, and the runtime's checks. Rounding is to nearest even, as
// __float2bfloat16 rounds; a NaN stays a (quiet) NaN.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_KERNELS_HOSTBF16_H
#define PIPEC_KERNELS_HOSTBF16_H

#include <bit>
#include <cstdint>

namespace pipec::kernels {

inline float bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(uint32_t(bits) << 16); }

inline uint16_t floatToBf16(float x) {
  if (x != x)
    return 0x7fc0;
  const uint32_t wide = std::bit_cast<uint32_t>(x);
  return uint16_t((wide + 0x7fffu + ((wide >> 16) & 1u)) >> 16);
}

} // namespace pipec::kernels

#endif // PIPEC_KERNELS_HOSTBF16_H
