//===- CudaDeviceTest.h - Tests of the GPU backends on a device --*- C++ -*-===//
//
// The fixture of the cuda and nccl backends' suites, which run on a GPU (the gpu flavour,
// tagged requires-gpu) or on the emulated device (//:flavours.bzl).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_CUDADEVICETEST_H
#define PIPEC_TESTS_CUDADEVICETEST_H

#include "ir/support/Error.h"
#include "runtime/cuda/CudaRun.h"

#include <gtest/gtest.h>

namespace pipec::test {

/// Fails each test at once where there is no usable CUDA device.
class CudaDeviceTest : public ::testing::Test {
protected:
  void SetUp() override {
    auto devices = cudaDevices();
    if (!devices)
      FAIL() << "no usable CUDA device (this test is tagged requires-gpu): "
             << takeMessage(devices.takeError());
  }
};

} // namespace pipec::test

#endif // PIPEC_TESTS_CUDADEVICETEST_H
