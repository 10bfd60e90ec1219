//===- InitFromTest.cpp - piperun --init-from: real weights in ------------------------===//
//
// The real piperun in real processes, on safetensors files this test writes byte by byte (its
// own writer, not the reader's code), in Hugging Face's GPT-2 names:
//  - a file holding exactly the seeded initialisation (kernels::initLayerFull) gives, on every
//    schedule and layout, the losses of the run without --init-from bit for bit: every tensor
//    lands where the model's own initialisation puts it, tp shards and stages included;
//  - a file of other weights, in F32, F16 and BF16, gives one first-step loss on every
//    schedule and layout, equal to the single-rank reference's (--check-reference, which loads
//    the same file), and another than the seeded one;
//  - GPT2LMHeadModel's "transformer." prefix, its lm_head.weight (a copy of wte when tied) and
//    the causal-mask buffers are accepted;
//  - a missing, extra or wrongly shaped tensor, an unreadable dtype, a truncated or malformed
//    file is exit 2 with one line naming it (and both shapes), before any step runs.
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"

#include "kernels/cpu/Gpt.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

namespace fs = std::filesystem;
using pipec::testing::runCommand;
using pipec::testing::stepLosses;
using pipec::testing::tmpDir;

std::string tool(const std::string &name) { return fs::current_path().string() + "/tools/" + name; }

std::string dir() {
  std::string d = tmpDir() + "/init-from";
  fs::create_directories(d);
  return d;
}

/// One tensor to write: its dtype, shape and values (converted to the dtype here).
struct Tensor {
  std::string dtype = "F32";
  std::vector<int64_t> shape;
  std::vector<float> values;
};

void put(std::string &out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out.push_back(char((v >> (8 * i)) & 0xFF));
}

uint16_t toHalf(float f) { // round to nearest even, normal range only (weights are small)
  uint32_t b = std::bit_cast<uint32_t>(f);
  uint32_t sign = (b >> 16) & 0x8000;
  int exp = int((b >> 23) & 0xFF) - 127 + 15;
  uint32_t man = b & 0x7FFFFF;
  if (exp <= 0)
    return uint16_t(sign); // flush the tiny ones
  uint32_t h = sign | uint32_t(exp) << 10 | man >> 13;
  uint32_t rest = man & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1)))
    ++h;
  return uint16_t(h);
}

/// A safetensors file: the u64 header length, the JSON header, the data.
std::string safetensors(const std::map<std::string, Tensor> &tensors) {
  std::string header = "{\"__metadata__\": {\"format\": \"pt\"}", data;
  for (const auto &[name, t] : tensors) {
    uint64_t begin = data.size();
    for (float v : t.values) {
      if (t.dtype == "F32")
        put(data, std::bit_cast<uint32_t>(v), 4);
      else if (t.dtype == "BF16")
        put(data, std::bit_cast<uint32_t>(v) >> 16, 2);
      else if (t.dtype == "F16")
        put(data, toHalf(v), 2);
      else
        put(data, std::bit_cast<uint64_t>(double(v)), 8); // F64
    }
    std::string shape;
    for (int64_t d : t.shape)
      shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    header += ", \"" + name + "\": {\"dtype\": \"" + t.dtype + "\", \"shape\": [" + shape +
              "], \"data_offsets\": [" + std::to_string(begin) + ", " +
              std::to_string(data.size()) + "]}";
  }
  header += "}";
  std::string out;
  put(out, header.size(), 8);
  return out + header + data;
}

/// A hand-made header behind its u64 length (for malformed files).
std::string withHeader(const std::string &header) {
  std::string out;
  put(out, header.size(), 8);
  return out + header;
}

void writeFile(const std::string &path, const std::string &bytes) {
  std::ofstream f(path, std::ios::binary);
  f << bytes;
}

/// examples/tiny-gpt.json's shapes.
pipec::kernels::GptConfig tinyConfig(bool tied = false) {
  pipec::kernels::GptConfig c;
  c.vocab = 64;
  c.seqLen = 16;
  c.channels = 32;
  c.heads = 4;
  c.layers = 4;
  c.ffn = 128;
  c.microbatch = 2;
  c.tiedEmbeddings = tied;
  return c;
}

/// The model's layers from initLayerFull(seed), cut into Hugging Face's GPT-2 tensors (the
/// kernels' documented order: kernels/cpu/Gpt.h, StageCompute::params).
std::map<std::string, Tensor> gpt2Tensors(const pipec::kernels::GptConfig &c, uint64_t seed,
                                          const std::string &prefix = "", int positions = 16) {
  const int64_t C = c.channels, V = c.vocab, T = c.seqLen, F = c.ffn;
  std::map<std::string, Tensor> out;
  auto cut = [&](const std::vector<float> &layer, size_t &at, const std::string &name,
                 std::vector<int64_t> shape) {
    size_t n = 1;
    for (int64_t d : shape)
      n *= size_t(d);
    out[name] = Tensor{"F32", shape, {layer.begin() + long(at), layer.begin() + long(at + n)}};
    at += n;
  };
  std::vector<float> emb = pipec::kernels::initLayerFull(c, 0, seed);
  size_t at = 0;
  cut(emb, at, prefix + "wte.weight", {V, C});
  cut(emb, at, prefix + "wpe.weight", {T, C});
  // GPT-2's wpe holds more positions than a run uses: the extra rows are never read.
  for (int p = int(T); p < positions; ++p) {
    out[prefix + "wpe.weight"].shape[0] = positions;
    for (int64_t k = 0; k < C; ++k)
      out[prefix + "wpe.weight"].values.push_back(1000.0f + float(p));
  }
  for (int b = 0; b < c.layers; ++b) {
    std::vector<float> l = pipec::kernels::initLayerFull(c, b + 1, seed);
    at = 0;
    const std::string h = prefix + "h." + std::to_string(b) + ".";
    cut(l, at, h + "ln_1.weight", {C});
    cut(l, at, h + "ln_1.bias", {C});
    cut(l, at, h + "attn.c_attn.weight", {C, 3 * C});
    cut(l, at, h + "attn.c_attn.bias", {3 * C});
    cut(l, at, h + "attn.c_proj.weight", {C, C});
    cut(l, at, h + "attn.c_proj.bias", {C});
    cut(l, at, h + "ln_2.weight", {C});
    cut(l, at, h + "ln_2.bias", {C});
    cut(l, at, h + "mlp.c_fc.weight", {C, F});
    cut(l, at, h + "mlp.c_fc.bias", {F});
    cut(l, at, h + "mlp.c_proj.weight", {F, C});
    cut(l, at, h + "mlp.c_proj.bias", {C});
    EXPECT_EQ(at, l.size());
  }
  std::vector<float> head = pipec::kernels::initLayerFull(c, c.layers + 1, seed);
  at = 0;
  cut(head, at, prefix + "ln_f.weight", {C});
  cut(head, at, prefix + "ln_f.bias", {C});
  cut(head, at, "lm_head.weight", {V, C});
  EXPECT_EQ(at, head.size());
  return out;
}

/// examples/tiny-llama.json's shapes (RMSNorm, SwiGLU, rope, 2 key/value heads, no biases).
pipec::kernels::GptConfig tinyLlamaConfig() {
  pipec::kernels::GptConfig c = tinyConfig();
  c.ffn = 96;
  c.rmsnorm = c.swiglu = c.rope = true;
  c.kvHeads = 2;
  c.bias = false;
  return c;
}

/// The Llama model's layers from initLayerFull(seed), cut into Hugging Face's LlamaForCausalLM
/// tensors: the kernels' [in, out] matrices (qkv's q | k | v and fc's gate | up column blocks)
/// transposed into nn.Linear's [out, in].
std::map<std::string, Tensor> llamaTensors(const pipec::kernels::GptConfig &c, uint64_t seed) {
  const int64_t C = c.channels, V = c.vocab, F = c.ffn, K = int64_t(c.kvHeads) * (C / c.heads);
  std::map<std::string, Tensor> out;
  auto vec = [&](const std::vector<float> &layer, size_t &at, const std::string &name, int64_t n) {
    out[name] = Tensor{"F32", {n}, {layer.begin() + long(at), layer.begin() + long(at + n)}};
    at += size_t(n);
  };
  // Columns [col, col + rows) of the [in, width] matrix at `at`, as a [rows, in] tensor.
  auto linear = [&](const std::vector<float> &layer, size_t at, int64_t in, int64_t width,
                    int64_t col, int64_t rows, const std::string &name) {
    Tensor t{"F32", {rows, in}, {}};
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < in; ++i)
        t.values.push_back(layer[at + size_t(i * width + col + r)]);
    out[name] = t;
  };
  std::vector<float> emb = pipec::kernels::initLayerFull(c, 0, seed);
  EXPECT_EQ(emb.size(), size_t(V * C));
  out["model.embed_tokens.weight"] = Tensor{"F32", {V, C}, emb};
  for (int b = 0; b < c.layers; ++b) {
    std::vector<float> l = pipec::kernels::initLayerFull(c, b + 1, seed);
    const std::string h = "model.layers." + std::to_string(b) + ".";
    size_t at = 0;
    vec(l, at, h + "input_layernorm.weight", C);
    linear(l, at, C, C + 2 * K, 0, C, h + "self_attn.q_proj.weight");
    linear(l, at, C, C + 2 * K, C, K, h + "self_attn.k_proj.weight");
    linear(l, at, C, C + 2 * K, C + K, K, h + "self_attn.v_proj.weight");
    at += size_t(C * (C + 2 * K));
    linear(l, at, C, C, 0, C, h + "self_attn.o_proj.weight");
    at += size_t(C * C);
    vec(l, at, h + "post_attention_layernorm.weight", C);
    linear(l, at, C, 2 * F, 0, F, h + "mlp.gate_proj.weight");
    linear(l, at, C, 2 * F, F, F, h + "mlp.up_proj.weight");
    at += size_t(C * 2 * F);
    linear(l, at, F, C, 0, C, h + "mlp.down_proj.weight");
    at += size_t(F * C);
    EXPECT_EQ(at, l.size());
  }
  std::vector<float> head = pipec::kernels::initLayerFull(c, c.layers + 1, seed);
  size_t at = 0;
  vec(head, at, "model.norm.weight", C);
  out["lm_head.weight"] = Tensor{"F32", {V, C}, {head.begin() + long(at), head.end()}};
  return out;
}

std::string compile(const std::string &model, const std::string &flags) {
  std::string out =
      dir() + "/plan-" + std::to_string(std::hash<std::string>()(model + flags)) + ".json";
  auto r =
      runCommand(tool("pipec") + " compile --quiet --model " + model + " " + flags + " -o " + out);
  EXPECT_EQ(r.code, 0) << r.err;
  return out;
}

// One global batch (4 microbatches of 2 sequences) under every layout.
const char *kLayouts[] = {
    "--schedule 1f1b --pp 2 --microbatches 4",
    "--schedule interleaved-1f1b --pp 2 --vpp 2 --microbatches 4 --tp 2",
    "--schedule zb-v --pp 2 --vpp 2 --microbatches 4",
    "--schedule seq1f1b --pp 2 --microbatches 2 --seq-splits 2 --dp 2",
    "--schedule gpipe --pp 3 --microbatches 2 --tp 2 --dp 2",
    "--schedule dualpipe-v --pp 2 --vpp 2 --microbatches 4",
};

TEST(InitFromTest, TheSeededWeightsInAFileGiveTheSeededRunBitForBit) {
  const std::string file = dir() + "/seeded.safetensors";
  writeFile(file, safetensors(gpt2Tensors(tinyConfig(), /*seed=*/1)));
  for (const char *layout : kLayouts) {
    std::string plan = compile("examples/tiny-gpt.json", layout);
    auto seeded = runCommand(tool("piperun") + " " + plan + " --backend cpu --steps 2 --seed 1");
    auto loaded = runCommand(tool("piperun") + " " + plan +
                             " --backend cpu --steps 2 --seed 1 --init-from " + file);
    ASSERT_EQ(seeded.code, 0) << seeded.err;
    ASSERT_EQ(loaded.code, 0) << loaded.err;
    EXPECT_NE(loaded.out.find("initial weights from " + file), std::string::npos);
    auto want = stepLosses(seeded.out), got = stepLosses(loaded.out);
    ASSERT_EQ(want.size(), 2u) << seeded.out;
    EXPECT_EQ(got, want) << layout;
  }
}

TEST(InitFromTest, AFineTunesRequeuedCommandLineStartsFromTheFileThenFromItsCheckpoint) {
  // `--init-from F --resume D --save-dir D`, launched again after a preemption: the first
  // launch (D empty) starts from F, every later one from D's checkpoint (F is not read), and the
  // job ends as the uninterrupted fine-tune, bit for bit.
  const std::string file = dir() + "/base.safetensors";
  writeFile(file, safetensors(gpt2Tensors(tinyConfig(), /*seed=*/7)));
  const std::string plan =
      compile("examples/tiny-gpt.json", "--schedule 1f1b --pp 2 --microbatches 4");
  const std::string ck = dir() + "/finetune";
  std::filesystem::remove_all(ck);
  auto whole =
      runCommand(tool("piperun") + " " + plan + " --backend cpu --steps 4 --init-from " + file);
  ASSERT_EQ(whole.code, 0) << whole.err;
  const std::string job = tool("piperun") + " " + plan + " --backend cpu --init-from " + file +
                          " --resume " + ck + " --save-dir " + ck;
  auto first = runCommand(job + " --steps 2");
  ASSERT_EQ(first.code, 0) << first.err;
  EXPECT_NE(first.out.find("initial weights from " + file), std::string::npos) << first.out;
  auto requeued = runCommand(job + " --steps 4");
  ASSERT_EQ(requeued.code, 0) << requeued.err;
  EXPECT_NE(requeued.out.find("--init-from " + file +
                              ": not read; the job continues from its "
                              "checkpoint in " +
                              ck + "\n"),
            std::string::npos)
      << requeued.out;
  auto got = stepLosses(first.out);
  for (auto [step, loss] : stepLosses(requeued.out))
    got[step] = loss;
  EXPECT_EQ(got, stepLosses(whole.out));
}

TEST(InitFromTest, OneFileGivesOneFirstLossOnEveryLayoutAndTheReferences) {
  // Weights of another seed, the matrices in half precision types as checkpoints store them,
  // GPT2LMHeadModel's names, GPT-2's 1,024-position wpe (here 40), its mask buffers.
  auto tensors = gpt2Tensors(tinyConfig(), /*seed=*/7, "transformer.", /*positions=*/40);
  for (auto &[name, t] : tensors) {
    if (name.find("c_attn.weight") != std::string::npos)
      t.dtype = "BF16";
    else if (name.find("c_fc.weight") != std::string::npos)
      t.dtype = "F16";
    else if (name.find("ln_f") != std::string::npos)
      t.dtype = "F64";
  }
  tensors["transformer.h.0.attn.bias"] = Tensor{"F32", {1, 1, 2, 2}, {1, 0, 1, 1}};
  tensors["transformer.h.1.attn.masked_bias"] = Tensor{"F32", {}, {-1e4f}}; // a scalar
  const std::string file = dir() + "/other.safetensors";
  writeFile(file, safetensors(tensors));
  std::string first, seededFirst;
  for (const char *layout : kLayouts) {
    std::string plan = compile("examples/tiny-gpt.json", layout);
    auto r = runCommand(tool("piperun") + " " + plan +
                        " --backend cpu --steps 1 --check-reference --init-from " + file);
    ASSERT_EQ(r.code, 0) << layout << "\n" << r.out << r.err;
    auto l = stepLosses(r.out);
    ASSERT_EQ(l.size(), 1u);
    if (first.empty())
      first = l[0];
    EXPECT_EQ(l[0], first) << layout; // printed to 6 decimals: equal within fp32 rounding
    std::smatch ref;
    ASSERT_TRUE(std::regex_search(r.out, ref, std::regex(R"(reference loss \(last step\) (\S+))")))
        << r.out;
    EXPECT_EQ(ref[1].str(), l[0]) << layout;
    if (seededFirst.empty()) {
      auto seeded = runCommand(tool("piperun") + " " + plan + " --backend cpu");
      ASSERT_EQ(seeded.code, 0) << seeded.err;
      seededFirst = stepLosses(seeded.out)[0];
      ASSERT_FALSE(seededFirst.empty()) << seeded.out;
    }
  }
  EXPECT_NE(first, seededFirst); // the file's weights were used
}

TEST(InitFromTest, ALlamaCheckpointOfTheSeededWeightsGivesTheSeededRunBitForBit) {
  // Hugging Face's Llama names and [out, in] matrices: loading them must rebuild the kernels'
  // layers exactly, on every layout (tp 2 holds one key/value head per rank).
  const std::string file = dir() + "/llama-seeded.safetensors";
  writeFile(file, safetensors(llamaTensors(tinyLlamaConfig(), /*seed=*/3)));
  for (const char *layout : kLayouts) {
    std::string plan = compile("examples/tiny-llama.json", layout);
    auto seeded = runCommand(tool("piperun") + " " + plan + " --backend cpu --steps 2 --seed 3");
    auto loaded =
        runCommand(tool("piperun") + " " + plan +
                   " --backend cpu --steps 2 --seed 3 --check-reference --init-from " + file);
    ASSERT_EQ(seeded.code, 0) << seeded.err;
    ASSERT_EQ(loaded.code, 0) << layout << "\n" << loaded.out << loaded.err;
    auto want = stepLosses(seeded.out), got = stepLosses(loaded.out);
    ASSERT_EQ(want.size(), 2u) << seeded.out;
    EXPECT_EQ(got, want) << layout;
  }
}

TEST(InitFromTest, ABadLlamaFileIsRefusedWithOneLineBeforeAnyStep) {
  const std::string plan =
      compile("examples/tiny-llama.json", "--schedule 1f1b --pp 2 --microbatches 2");
  struct Bad {
    const char *what;
    std::function<void(std::map<std::string, Tensor> &)> edit;
    const char *message;
  } cases[] = {
      {"missing", [](auto &t) { t.erase("model.layers.3.mlp.up_proj.weight"); },
       "missing tensor model.layers.3.mlp.up_proj.weight (shape [96, 32]) of a Llama model with "
       "4 blocks"},
      {"extra",
       [](auto &t) {
         t["model.layers.0.self_attn.q_proj.bias"] = Tensor{"F32", {32}, std::vector<float>(32)};
       },
       "extra tensor model.layers.0.self_attn.q_proj.bias (shape [32]) is not a parameter of a "
       "Llama model with 4 blocks"},
      {"transposed",
       [](auto &t) {
         t["model.layers.1.mlp.down_proj.weight"].shape = {96, 32};
       },
       "tensor model.layers.1.mlp.down_proj.weight has shape [96, 32]; the model needs [32, 96]"},
      {"untied without a head", [](auto &t) { t.erase("lm_head.weight"); },
       "missing tensor lm_head.weight (shape [64, 32]): the model's head is untied"},
      {"no embedding", [](auto &t) { t.erase("model.embed_tokens.weight"); },
       "missing tensor model.embed_tokens.weight (shape [64, 32]) of a Llama model with 4 blocks"},
  };
  for (const Bad &b : cases) {
    auto tensors = llamaTensors(tinyLlamaConfig(), /*seed=*/3);
    b.edit(tensors);
    const std::string file = dir() + "/llama-bad.safetensors";
    writeFile(file, safetensors(tensors));
    auto r = runCommand(tool("piperun") + " " + plan + " --backend cpu --init-from " + file);
    EXPECT_EQ(r.code, 2) << b.what << "\n" << r.err;
    EXPECT_NE(r.err.find("--init-from " + file + ": " + b.message), std::string::npos)
        << b.what << "\n"
        << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(stepLosses(r.out).empty()) << r.out;
  }
  // A Llama file for a GPT-2 model: the names say which block the model would need.
  const std::string file = dir() + "/llama-for-gpt.safetensors";
  writeFile(file, safetensors(llamaTensors(tinyLlamaConfig(), /*seed=*/3)));
  auto r = runCommand(tool("piperun") + " " +
                      compile("examples/tiny-gpt.json", "--schedule 1f1b --pp 2 --microbatches 2") +
                      " --backend cpu --init-from " + file);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("the file has a Llama checkpoint's tensor names (embed_tokens.weight), but "
                       "the model's block is GPT-2's"),
            std::string::npos)
      << r.err;
  // A tied Llama model whose file carries an lm_head.weight other than embed_tokens.
  std::string tiedModel = dir() + "/tiny-llama-tied.json";
  {
    std::string spec = pipec::testing::slurp("examples/tiny-llama.json");
    const size_t at = spec.find("\"dtype\": \"fp32\"");
    ASSERT_NE(at, std::string::npos);
    spec.insert(at, "\"tie_embeddings\": true, ");
    std::ofstream(tiedModel) << spec;
  }
  const std::string untiedFile = dir() + "/llama-untied.safetensors"; // its own lm_head
  writeFile(untiedFile, safetensors(llamaTensors(tinyLlamaConfig(), /*seed=*/3)));
  auto tied = runCommand(tool("piperun") + " " +
                         compile(tiedModel, "--schedule 1f1b --pp 2 --microbatches 2") +
                         " --backend cpu --init-from " + untiedFile);
  EXPECT_EQ(tied.code, 2) << tied.err;
  EXPECT_NE(tied.err.find("tensor lm_head.weight differs from model.embed_tokens.weight, but the "
                          "model ties its embeddings"),
            std::string::npos)
      << tied.err;
}

// The GPU backends on the emulated device (tools/piperun_emu: the same code, CPU stand-ins for
// the kernels): every rank's stages and the reference take the file's weights.
TEST(InitFromTest, TheEmulatedGpuBackendsLoadTheFileToo) {
  const std::string seededFile = dir() + "/gpu-seeded.safetensors";
  writeFile(seededFile, safetensors(gpt2Tensors(tinyConfig(), /*seed=*/1)));
  auto other = gpt2Tensors(tinyConfig(), /*seed=*/5);
  const std::string otherFile = dir() + "/gpu-other.safetensors";
  writeFile(otherFile, safetensors(other));
  const std::string nccl = "RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 ";
  struct Run {
    std::string env, backend, layout;
  } runs[] = {{"", "cuda", "--schedule 1f1b --pp 2 --microbatches 4 --tp 2"},
              {"", "cuda", "--schedule zb-v --pp 2 --vpp 2 --microbatches 4"},
              {nccl, "nccl", "--schedule gpipe --pp 1 --microbatches 4"}};
  for (const Run &run : runs) {
    std::string plan = compile("examples/tiny-gpt.json", run.layout);
    auto piperun = [&](const std::string &args) {
      return runCommand(run.env + tool("piperun_emu") + " " + plan + " --backend " + run.backend +
                        " " + args);
    };
    auto seeded = piperun("--steps 2");
    auto loaded = piperun("--steps 2 --init-from " + seededFile);
    ASSERT_EQ(seeded.code, 0) << seeded.err;
    ASSERT_EQ(loaded.code, 0) << loaded.err;
    EXPECT_EQ(stepLosses(loaded.out), stepLosses(seeded.out)) << run.layout;
    ASSERT_EQ(stepLosses(seeded.out).size(), 2u) << seeded.out;
    // Other weights: the reference (on the CPU) agrees, and its loss is the cpu backend's.
    auto gpu = piperun("--steps 1 --check-reference --init-from " + otherFile);
    ASSERT_EQ(gpu.code, 0) << run.layout << "\n" << gpu.out << gpu.err;
    auto cpu = runCommand(tool("piperun") + " " + plan + " --backend cpu --init-from " + otherFile);
    ASSERT_EQ(cpu.code, 0) << cpu.err;
    std::smatch ref;
    ASSERT_TRUE(
        std::regex_search(gpu.out, ref, std::regex(R"(reference loss \(last step\) (\S+))")));
    EXPECT_EQ(ref[1].str(), stepLosses(cpu.out)[0]) << run.layout;
    EXPECT_NE(stepLosses(gpu.out)[0], stepLosses(seeded.out)[0]) << run.layout;
  }
}

TEST(InitFromTest, TheEmulatedGpuBackendsLoadALlamaFileToo) {
  // Llama's names and block on the device (one stage definition): the seeded file reproduces the
  // seeded run, and another file's first loss is the cpu backend's reference.
  const std::string seededFile = dir() + "/gpu-llama-seeded.safetensors";
  writeFile(seededFile, safetensors(llamaTensors(tinyLlamaConfig(), /*seed=*/1)));
  const std::string otherFile = dir() + "/gpu-llama-other.safetensors";
  writeFile(otherFile, safetensors(llamaTensors(tinyLlamaConfig(), /*seed=*/6)));
  for (const char *layout : {"--schedule 1f1b --pp 2 --microbatches 4 --tp 2",
                             "--schedule seq1f1b --pp 2 --microbatches 4 --seq-splits 2"}) {
    std::string plan = compile("examples/tiny-llama.json", layout);
    auto piperun = [&](const std::string &args) {
      return runCommand(tool("piperun_emu") + " " + plan + " --backend cuda " + args);
    };
    auto seeded = piperun("--steps 2 --seed 1");
    auto loaded = piperun("--steps 2 --seed 1 --init-from " + seededFile);
    ASSERT_EQ(seeded.code, 0) << seeded.err;
    ASSERT_EQ(loaded.code, 0) << loaded.err;
    ASSERT_EQ(stepLosses(seeded.out).size(), 2u) << seeded.out;
    EXPECT_EQ(stepLosses(loaded.out), stepLosses(seeded.out)) << layout;
    auto gpu = piperun("--steps 1 --check-reference --init-from " + otherFile);
    ASSERT_EQ(gpu.code, 0) << layout << "\n" << gpu.out << gpu.err;
    auto cpu = runCommand(tool("piperun") + " " + plan + " --backend cpu --init-from " + otherFile);
    ASSERT_EQ(cpu.code, 0) << cpu.err;
    std::smatch ref;
    ASSERT_TRUE(
        std::regex_search(gpu.out, ref, std::regex(R"(reference loss \(last step\) (\S+))")));
    EXPECT_EQ(ref[1].str(), stepLosses(cpu.out)[0]) << layout;
  }
}

TEST(InitFromTest, TiedEmbeddingsTakeTheHeadFromWte) {
  const std::string model = dir() + "/tiny-tied.json";
  writeFile(model, R"({"format": "pipemodel/1", "name": "tiny-tied",
 "transformer": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
   "ffn_hidden_size": 128, "vocab_size": 64, "seq_length": 16, "microbatch_size": 2,
   "dtype": "fp32", "tie_embeddings": true}})");
  std::string plan = compile(model, "--schedule 1f1b --pp 2 --microbatches 4 --tp 2");
  auto run = [&](const std::string &file) {
    return runCommand(tool("piperun") + " " + plan +
                      " --backend cpu --steps 2 --check-reference --init-from " + file);
  };
  // The seeded tied model's head is a copy of wte: its weights without lm_head.weight give the
  // seeded run, so the head was taken from wte.
  auto seededTensors = gpt2Tensors(tinyConfig(/*tied=*/true), 1);
  seededTensors.erase("lm_head.weight");
  const std::string seededFile = dir() + "/tied-seeded.safetensors";
  writeFile(seededFile, safetensors(seededTensors));
  auto seeded = runCommand(tool("piperun") + " " + plan + " --backend cpu --steps 2");
  ASSERT_EQ(seeded.code, 0) << seeded.err;
  auto fromSeeded = run(seededFile);
  ASSERT_EQ(fromSeeded.code, 0) << fromSeeded.err;
  EXPECT_EQ(stepLosses(fromSeeded.out), stepLosses(seeded.out));
  // Other weights, with Hugging Face's copy of wte as lm_head.weight and without it: one run,
  // another than the seeded one, and the reference agrees.
  auto tensors = gpt2Tensors(tinyConfig(/*tied=*/true), 9);
  const std::string with = dir() + "/tied-with-head.safetensors";
  writeFile(with, safetensors(tensors));
  tensors.erase("lm_head.weight");
  const std::string without = dir() + "/tied.safetensors";
  writeFile(without, safetensors(tensors));
  auto a = run(with), b = run(without);
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_EQ(stepLosses(a.out), stepLosses(b.out));
  EXPECT_NE(stepLosses(a.out), stepLosses(seeded.out));
  // A head that is not wte cannot be tied: refused, naming both.
  tensors["lm_head.weight"] = Tensor{"F32", {64, 32}, std::vector<float>(64 * 32, 0.5f)};
  const std::string other = dir() + "/tied-other-head.safetensors";
  writeFile(other, safetensors(tensors));
  auto c = run(other);
  EXPECT_EQ(c.code, 2);
  EXPECT_NE(c.err.find("tensor lm_head.weight differs from wte.weight, but the model ties its "
                       "embeddings"),
            std::string::npos)
      << c.err;
}

TEST(InitFromTest, BadFilesAreRefusedWithOneLineBeforeAnyStep) {
  const auto good = gpt2Tensors(tinyConfig(), 1);
  std::string plan = compile("examples/tiny-gpt.json", "--schedule 1f1b --pp 2 --microbatches 4");
  struct Case {
    std::string name, bytes, want;
  };
  std::vector<Case> cases;
  {
    auto t = good;
    t.erase("h.2.mlp.c_proj.bias");
    cases.push_back({"missing", safetensors(t),
                     "missing tensor h.2.mlp.c_proj.bias (shape [32]) of a GPT-2 model with 4 "
                     "blocks"});
  }
  {
    auto t = good;
    t["h.4.ln_1.weight"] = Tensor{"F32", {32}, std::vector<float>(32, 1)};
    cases.push_back({"extra", safetensors(t),
                     "extra tensor h.4.ln_1.weight (shape [32]) is not a parameter of a GPT-2 "
                     "model with 4 blocks"});
  }
  {
    auto t = good;
    t["h.1.mlp.c_fc.weight"] = Tensor{"F32", {32, 64}, std::vector<float>(32 * 64, 0)};
    cases.push_back({"shape", safetensors(t),
                     "tensor h.1.mlp.c_fc.weight has shape [32, 64]; the model needs [32, 128]"});
  }
  {
    auto t = good;
    t["wte.weight"].shape = {32, 64}; // transposed
    cases.push_back({"transposed", safetensors(t),
                     "tensor wte.weight has shape [32, 64]; the model needs [64, 32]"});
  }
  {
    auto t = good;
    t.erase("lm_head.weight");
    cases.push_back({"untied-head", safetensors(t),
                     "missing tensor lm_head.weight (shape [64, "
                     "32]): the model's head is untied"});
  }
  {
    std::string bytes = safetensors(good);
    std::string needle = "\"dtype\": \"F32\", \"shape\": [32], \"data_offsets\"";
    size_t at = bytes.find("\"h.0.ln_1.bias\": {\"dtype\": \"F32\"");
    ASSERT_NE(at, std::string::npos);
    bytes.replace(bytes.find("F32", at), 3, "I32");
    (void)needle;
    cases.push_back({"dtype", bytes,
                     "tensor h.0.ln_1.bias is I32; initial weights are read "
                     "from F32, F16, BF16 or F64"});
  }
  {
    std::string bytes = safetensors(good);
    bytes.resize(bytes.size() - 100);
    cases.push_back({"truncated", bytes, "are not inside the"});
  }
  cases.push_back({"short", "abc", "not a safetensors file (3 bytes"});
  {
    std::string bytes;
    put(bytes, uint64_t(1) << 62, 8);
    cases.push_back({"header-length", bytes + "{}", "header length 4611686018427387904 is past"});
  }
  cases.push_back({"not-object", withHeader("[1, 2]"), "its header is not a JSON object"});
  cases.push_back({"byte-count",
                   withHeader("{\"wte.weight\": {\"dtype\": \"F32\", \"shape\": [64, 32], "
                              "\"data_offsets\": [0, 12]}}") +
                       std::string(12, '\0'),
                   "tensor wte.weight: 12 bytes for shape [64, 32] of F32 (8192 expected)"});
  {
    auto t = good;
    t["h.0.ln_2.weight"].values[5] = INFINITY;
    cases.push_back({"not-finite", safetensors(t),
                     "tensor h.0.ln_2.weight holds a value that is not a finite fp32 number at "
                     "element 5"});
  }
  cases.push_back({"deep", withHeader("{\"a\": {\"shape\": [[[1]]]}}"),
                   "its header nests deeper than the format's 3 levels"});
  cases.push_back({"shape-overflow",
                   withHeader("{\"wte.weight\": {\"dtype\": \"F32\", \"shape\": [4294967296, "
                              "4294967296], \"data_offsets\": [0, 0]}}"),
                   "shape: more than 2^40 elements"});
  for (const Case &c : cases) {
    const std::string file = dir() + "/bad-" + c.name + ".safetensors";
    writeFile(file, c.bytes);
    auto r =
        runCommand(tool("piperun") + " " + plan + " --backend cpu --steps 1 --init-from " + file);
    EXPECT_EQ(r.code, 2) << c.name << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.name << ": " << r.err;
    EXPECT_NE(r.err.find("--init-from " + file + ": "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.want), std::string::npos) << c.name << ": " << r.err;
    EXPECT_EQ(r.out.find("step 0"), std::string::npos) << c.name; // nothing ran
  }
  // A short relative name keeps the whole message.
  {
    auto t = good;
    t.erase("wte.weight");
    writeFile(dir() + "/m", safetensors(t));
    auto r = runCommand("cd " + dir() + " && " + tool("piperun") + " " + plan +
                        " --backend cpu --init-from m");
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.err.find("--init-from m: missing tensor wte.weight (shape [64, 32])"),
              std::string::npos)
        << r.err;
  }
  auto missing = runCommand(tool("piperun") + " " + plan + " --backend cpu --init-from " + dir() +
                            "/no-such.safetensors");
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.err.find("no-such.safetensors"), std::string::npos) << missing.err;
}

TEST(InitFromTest, OnlyTheRowsOfWpeTheModelUsesAreRead) {
  // GPT-2's wpe may hold more positions than the model's seq_length; here 2^28 rows (32 GiB of
  // F32), all but the first 16 a hole in a sparse file. Only the rows the model uses are read:
  // the run is the seeded one, bit for bit, instead of an attempt to allocate 32 GiB.
  const pipec::kernels::GptConfig c = tinyConfig();
  std::map<std::string, Tensor> tensors = gpt2Tensors(c, /*seed=*/1);
  Tensor wpe = tensors.at("wpe.weight");
  tensors.erase("wpe.weight");
  std::string file = safetensors(tensors); // wpe goes last, its data mostly a hole
  uint64_t headerBytes = 0;
  for (int i = 0; i < 8; ++i)
    headerBytes |= uint64_t(uint8_t(file[size_t(i)])) << (8 * i);
  std::string header = file.substr(8, size_t(headerBytes)), data = file.substr(8 + headerBytes);
  const uint64_t rows = uint64_t(1) << 28, begin = data.size(), end = begin + rows * 32 * 4;
  ASSERT_EQ(c.channels, 32);
  header.pop_back(); // the closing brace
  header += ", \"wpe.weight\": {\"dtype\": \"F32\", \"shape\": [" + std::to_string(rows) +
            ", 32], \"data_offsets\": [" + std::to_string(begin) + ", " + std::to_string(end) +
            "]}}";
  for (float v : wpe.values)
    put(data, std::bit_cast<uint32_t>(v), 4);
  std::string bytes;
  put(bytes, header.size(), 8);
  const std::string path = dir() + "/sparse-wpe.safetensors";
  writeFile(path, bytes + header + data);
  ASSERT_EQ(::truncate(path.c_str(), off_t(8 + header.size() + end)), 0);

  std::string plan = compile("examples/tiny-gpt.json", kLayouts[0]);
  auto seeded = runCommand(tool("piperun") + " " + plan + " --backend cpu --steps 2 --seed 1");
  auto loaded = runCommand(tool("piperun") + " " + plan +
                           " --backend cpu --steps 2 --seed 1 --init-from " + path);
  ASSERT_EQ(seeded.code, 0) << seeded.err;
  ASSERT_EQ(loaded.code, 0) << loaded.err;
  EXPECT_EQ(stepLosses(loaded.out), stepLosses(seeded.out));
  fs::remove(path);
}

} // namespace
