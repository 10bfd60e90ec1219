//===- KernelEnvTest.cpp - the kernels' configuration from the environment ---===//
//
// tools/KernelEnv.h, the one reader of the environment for kernels/cuda/KernelConfig.h, on
// environments given as maps (no process state touched).
//
//===----------------------------------------------------------------------===//
#include "tools/KernelEnv.h"

#include "ir/support/Error.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace pipec {
namespace {

using Env = std::map<std::string, std::string>;

llvm::Expected<kernels::cuda::KernelConfig> configOf(const Env &env) {
  return kernelConfigFromEnvironment([&](const char *name) -> const char * {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

/// The input error's message (exit 2 in the tools), or "" with a test failure.
std::string inputErrorOf(const Env &env) {
  auto config = configOf(env);
  if (config) {
    ADD_FAILURE() << "accepted";
    return "";
  }
  llvm::Error err = config.takeError();
  EXPECT_EQ(exitCodeFor(err), 2);
  return takeMessage(std::move(err));
}

TEST(KernelEnvTest, AnEmptyEnvironmentAllowsTheHopperKernels) {
  auto config = configOf({});
  ASSERT_TRUE(bool(config)) << takeMessage(config.takeError());
  EXPECT_EQ(*config, kernels::cuda::KernelConfig{});
  EXPECT_TRUE(config->hopperKernels);
}

TEST(KernelEnvTest, WgmmaZeroTurnsTheHopperKernelsOffAndOneKeepsThem) {
  auto off = configOf({{"PIPEC_ATTENTION_WGMMA", "0"}});
  ASSERT_TRUE(bool(off)) << takeMessage(off.takeError());
  EXPECT_FALSE(off->hopperKernels);
  auto on = configOf({{"PIPEC_ATTENTION_WGMMA", "1"}});
  ASSERT_TRUE(bool(on)) << takeMessage(on.takeError());
  EXPECT_TRUE(on->hopperKernels);
}

TEST(KernelEnvTest, AnotherValueIsAnInputErrorNamingTheVariableAndTheFix) {
  const std::string message = inputErrorOf({{"PIPEC_ATTENTION_WGMMA", "off"}});
  EXPECT_NE(message.find("PIPEC_ATTENTION_WGMMA=off: expected 0"), std::string::npos) << message;
  EXPECT_NE(message.find("try PIPEC_ATTENTION_WGMMA=0"), std::string::npos) << message;
}

TEST(KernelEnvTest, TheMovedHopperBackwardSwitchesAreRefusedUnlessZero) {
  for (const char *name : {"PIPEC_ATTENTION_WGMMA_BACKWARD", "PIPEC_ATTENTION_DQ_ATOMICS"}) {
    SCOPED_TRACE(name);
    const std::string message = inputErrorOf({{name, "1"}});
    EXPECT_NE(message.find("kernels/cuda/experimental"), std::string::npos) << message;
    EXPECT_NE(message.find(std::string("unset ") + name), std::string::npos) << message;
    auto zero = configOf({{name, "0"}});
    EXPECT_TRUE(bool(zero)) << takeMessage(zero.takeError());
  }
}

} // namespace
} // namespace pipec
