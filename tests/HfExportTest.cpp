//===- HfExportTest.cpp - --export-hf's writer against --init-from's reader -----===//
//
// A Hugging Face directory written from a model's layers (runtime/HfExport.h) reads back through
// --init-from DIR (runtime/SafeTensors.h, config.json checked against the model) to the same
// layers bit for bit, for GPT-2's and Llama's blocks, tied and untied, in one file and in
// shards. python/tests/test_hf_dir.py loads such directories with transformers itself.
//
//===----------------------------------------------------------------------===//
#include "runtime/HfExport.h"
#include "runtime/SafeTensors.h"
#include "runtime/cpu/CpuRun.h"
#include "tests/TestUtil.h"

#include "llvm/Support/FileSystem.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace pipec;
using namespace pipec::test;

namespace {

std::string tempDir(const std::string &name) {
  const char *base = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(base ? base : "/tmp") + "/" + name;
  llvm::sys::fs::remove_directories(dir);
  return dir;
}

/// The model's seeded layers, each value made distinct (so that a misplaced tensor shows).
std::vector<std::vector<float>> layersOf(const kernels::GptConfig &cfg) {
  std::vector<std::vector<float>> layers;
  for (int l = 0; l < cfg.numLayers(); ++l) {
    layers.push_back(kernels::initLayerFull(cfg, l, /*seed=*/7));
    for (size_t k = 0; k < layers.back().size(); ++k)
      layers.back()[k] += 1e-3f * float(k % 97) + float(l);
  }
  if (cfg.tiedEmbeddings) { // the head's matrix is wte
    std::vector<float> &head = layers.back();
    auto wte = layers.front().begin();
    std::copy(wte, wte + long(cfg.vocab) * cfg.channels,
              head.end() - long(cfg.vocab) * cfg.channels);
  }
  return layers;
}

/// Writes the model's layers with shards of at most `shardBytes`, reads them back and returns
/// the number of safetensors files.
int expectRoundTrip(const ModelSpec &model, uint64_t shardBytes) {
  SCOPED_TRACE(model.name + " shard bytes " + std::to_string(shardBytes));
  Plan plan = compileOrFail(model, options("1f1b", 2, 2));
  auto cfg = gptConfigOf(plan);
  EXPECT_TRUE(bool(cfg)) << errorText(cfg.takeError());
  if (!cfg)
    return 0;
  const auto layers = layersOf(*cfg);
  const std::string dir = tempDir("hf-" + model.name + std::to_string(shardBytes));
  auto files = writeHfDirectory(dir, *cfg, *plan.transformer, layers, shardBytes);
  EXPECT_TRUE(bool(files)) << (files ? "" : errorText(files.takeError()));
  if (!files)
    return 0;
  EXPECT_TRUE(llvm::sys::fs::exists(dir + "/config.json"));
  EXPECT_EQ(llvm::sys::fs::exists(dir + "/model.safetensors.index.json"), *files > 1);
  EXPECT_EQ(llvm::sys::fs::exists(dir + "/model.safetensors"), *files == 1);
  auto back = loadInitialWeights(dir, *cfg, *plan.transformer);
  EXPECT_TRUE(bool(back)) << (back ? "" : errorText(back.takeError()));
  if (!back)
    return 0;
  EXPECT_EQ(back->size(), layers.size());
  for (size_t l = 0; l < layers.size() && l < back->size(); ++l)
    EXPECT_EQ((*back)[l], layers[l]) << "layer " << l;
  return *files;
}

TEST(HfExportTest, Gpt2AndLlamaLayersComeBackBitForBitWholeAndSharded) {
  for (bool llama : {false, true})
    for (bool tied : {false, true}) {
      ModelSpec m = llama ? tinyLlama(tied) : tinyGpt(tied);
      m.name += tied ? "-tied" : "";
      EXPECT_EQ(expectRoundTrip(m, kDefaultHfShardBytes), 1);
      EXPECT_GT(expectRoundTrip(m, /*shardBytes=*/4096), 4);
    }
}

TEST(HfExportTest, ADirectoryThatHoldsFilesIsRefusedAndLeftAlone) {
  const std::string dir = tempDir("hf-busy");
  ASSERT_FALSE(llvm::sys::fs::create_directory(dir));
  std::ofstream(dir + "/keep.txt") << "mine";
  Plan plan = compileOrFail(tinyGpt(), options("1f1b", 2, 2));
  auto cfg = gptConfigOf(plan);
  ASSERT_TRUE(bool(cfg));
  auto files = writeHfDirectory(dir, *cfg, *plan.transformer, layersOf(*cfg));
  ASSERT_FALSE(bool(files));
  EXPECT_NE(errorText(files.takeError()).find("exists and is not empty"), std::string::npos);
  EXPECT_TRUE(llvm::sys::fs::exists(dir + "/keep.txt"));
  EXPECT_FALSE(llvm::sys::fs::exists(dir + "/config.json"));
}

/// The pid of a process that has ended (forked, exited and reaped here).
pid_t deadPid() {
  pid_t pid = ::fork();
  if (pid == 0)
    ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

TEST(HfExportTest, WhatAKilledExportLeftIsRemovedAndNothingElse) {
  // An export killed before its rename leaves DIR.partial-<pid>. The next export to DIR removes
  // such a directory when its process is gone and it holds only what an export writes; a live
  // process's, one holding a user's file, and a link (into a directory of exported names) stay.
  const std::string dir = tempDir("hf-relaunch");
  auto partial = [&](pid_t pid) { return dir + ".partial-" + std::to_string(pid); };
  const pid_t killed = deadPid(), mixed = deadPid(), linked = deadPid();
  for (const std::string &d : {partial(killed), partial(mixed), partial(::getppid())}) {
    llvm::sys::fs::remove_directories(d);
    ASSERT_FALSE(llvm::sys::fs::create_directory(d));
    std::ofstream(d + "/config.json") << "{}";
    std::ofstream(d + "/model-00001-of-00003.safetensors") << "x";
    std::ofstream(d + "/model-00002-of-00003.safetensors.tmp-0a1b2c") << "x";
  }
  std::ofstream(partial(mixed) + "/notes.txt") << "mine";
  const std::string outside = tempDir("hf-outside");
  ASSERT_FALSE(llvm::sys::fs::create_directory(outside));
  std::ofstream(outside + "/config.json") << "mine";
  llvm::sys::fs::remove(partial(linked));
  ASSERT_FALSE(llvm::sys::fs::create_link(outside, partial(linked)));

  Plan plan = compileOrFail(tinyGpt(), options("1f1b", 2, 2));
  auto cfg = gptConfigOf(plan);
  ASSERT_TRUE(bool(cfg));
  auto files = writeHfDirectory(dir, *cfg, *plan.transformer, layersOf(*cfg));
  ASSERT_TRUE(bool(files)) << errorText(files.takeError());
  EXPECT_TRUE(llvm::sys::fs::exists(dir + "/model.safetensors"));
  EXPECT_FALSE(llvm::sys::fs::exists(partial(killed)));
  EXPECT_TRUE(llvm::sys::fs::exists(partial(mixed) + "/notes.txt"));
  EXPECT_TRUE(llvm::sys::fs::exists(partial(mixed) + "/config.json"));
  EXPECT_TRUE(llvm::sys::fs::exists(partial(::getppid()) + "/config.json"));
  EXPECT_TRUE(llvm::sys::fs::exists(outside + "/config.json"));
  EXPECT_TRUE(llvm::sys::fs::is_symlink_file(partial(linked)));
  EXPECT_FALSE(llvm::sys::fs::exists(dir + ".partial-" + std::to_string(::getpid())));
}

TEST(HfExportTest, ALinkIsRefusedBeforeTheRunAndAnEmptyDirectoryKeepsItsMode) {
  // The export is renamed into place: through a link it would replace the link (a link to an
  // empty directory left that directory empty), so a link is refused up front, dangling or not.
  const std::string target = tempDir("hf-target"), link = tempDir("hf-link");
  ASSERT_FALSE(llvm::sys::fs::create_directory(target));
  llvm::sys::fs::remove(link);
  ASSERT_FALSE(llvm::sys::fs::create_link(target, link));
  llvm::Error err = checkHfExportDir(link);
  ASSERT_TRUE(bool(err));
  EXPECT_NE(errorText(std::move(err)).find("is a symbolic link; give the directory itself"),
            std::string::npos);
  llvm::sys::fs::remove(target);
  err = checkHfExportDir(link);
  ASSERT_TRUE(bool(err));
  EXPECT_NE(errorText(std::move(err)).find("is a symbolic link"), std::string::npos);
  // An empty directory given keeps its mode (it came out 0750 whatever it was).
  const std::string dir = tempDir("hf-mode");
  ASSERT_FALSE(llvm::sys::fs::create_directory(dir));
  ASSERT_EQ(::chmod(dir.c_str(), 0751), 0);
  Plan plan = compileOrFail(tinyGpt(), options("1f1b", 2, 2));
  auto cfg = gptConfigOf(plan);
  ASSERT_TRUE(bool(cfg));
  auto files = writeHfDirectory(dir, *cfg, *plan.transformer, layersOf(*cfg));
  ASSERT_TRUE(bool(files)) << errorText(files.takeError());
  struct stat st;
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0751u);
  EXPECT_TRUE(llvm::sys::fs::exists(dir + "/config.json"));
}

TEST(HfExportTest, ABlockTransformersCannotLoadIsRefused) {
  ModelSpec m = tinyGpt();
  m.transformer->norm = Norm::RmsNorm; // RMSNorm with GPT-2's other choices: no HF class
  Plan plan = compileOrFail(m, options("1f1b", 2, 2));
  auto cfg = gptConfigOf(plan);
  ASSERT_TRUE(bool(cfg));
  auto files = writeHfDirectory(tempDir("hf-mixed"), *cfg, *plan.transformer, layersOf(*cfg));
  ASSERT_FALSE(bool(files));
  EXPECT_NE(errorText(files.takeError()).find("neither GPT-2's nor Llama's"), std::string::npos);
}

} // namespace
