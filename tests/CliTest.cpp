//===- CliTest.cpp - pipec end to end: exit codes, messages, files --------===//
//
// Runs the real binary. Bad input: exit 2, one line on stderr naming the field or flag, and no
// output file. A wrong plan: exit 1 with the verifier's diagnostic.
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <sys/stat.h>
#include <vector>

namespace {

using pipec::testing::slurp;
using pipec::testing::tmpDir;
using Result = pipec::testing::CommandResult;

void spit(const std::string &path, const std::string &text) { std::ofstream(path) << text; }

bool exists(const std::string &path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

Result run(const std::string &tool, const std::string &args) {
  return pipec::testing::runCommand(tool + " " + args);
}

Result pipec(const std::string &args) { return run("tools/pipec", args); }
Result piperun(const std::string &args) { return run("tools/piperun", args); }

const char *kModel = "examples/uniform-8.json";

std::string compileArgs(const std::string &extra) {
  return std::string("compile --model ") + kModel + " --schedule 1f1b --pp 4 --microbatches 8 " +
         extra;
}

size_t lines(const std::string &s) {
  size_t n = 0;
  for (char c : s)
    n += c == '\n';
  return n;
}

/// Exit 2, exactly one line on stderr containing `needle`, and no file at `out`.
void expectBadInput(const std::string &args, const std::string &needle) {
  std::string out = tmpDir() + "/should-not-exist.json";
  std::remove(out.c_str());
  Result r = pipec(args + " -o " + out);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
  EXPECT_EQ(lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_FALSE(exists(out)) << "partial output for: " << args;
  EXPECT_FALSE(exists(out + ".tmp"));
}

TEST(CliTest, CompileWritesAPlanAndPrintsTheSummary) {
  std::string out = tmpDir() + "/plan.json";
  Result r = pipec(compileArgs("-o " + out));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("bubble ratio 0.2727"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("peak act"), std::string::npos) << r.out;
  auto j = nlohmann::json::parse(slurp(out));
  EXPECT_EQ(j["format"], "pipeplan/1");
  EXPECT_EQ(j["ranks"].size(), 4u);
}

TEST(CliTest, ATransformersSummaryGivesThroughputAsPublishedRunsDo) {
  // GPT-3 175B at tp 4, pp 8 (6 virtual stages), dp 16 on the H100 spec: tokens/s from the
  // printed step time, and model FLOP/s per GPU from the closed form of contracts.md (per
  // microbatch of b sequences of s tokens: each block 3·b·s·(8h² + 4hf) for its matrices plus
  // 12·h·b·Σ(t+1) for causal attention, the head 3·2·b·s·h·v), not from pipec's own count.
  Result r = pipec("compile --model examples/gpt3-175b.json --cluster examples/h100-nemo.json "
                   "--schedule interleaved-1f1b --pp 8 --vpp 6 --tp 4 --dp 16 --microbatches 128 "
                   "--sequence-parallel --distributed-optimizer");
  ASSERT_EQ(r.code, 0) << r.err;
  std::smatch step, th;
  ASSERT_TRUE(std::regex_search(r.out, step, std::regex("step time ([0-9.]+) ms\n"))) << r.out;
  ASSERT_TRUE(std::regex_search(
      r.out, th,
      std::regex("\nthroughput: ([0-9]+) tokens/s \\(([0-9]+) per GPU\\), ([0-9.]+) TFLOP/s per "
                 "GPU of model FLOPs, MFU ([0-9.]+)% of the H100-SXM5-80GB's 989 TFLOP/s\n")))
      << r.out;
  const double seconds = std::stod(step[1]) / 1000, gpus = 4 * 8 * 16;
  const double l = 96, h = 12288, f = 49152, v = 51200, s = 2048, b = 1, m = 128, dp = 16;
  const double tokens = m * dp * b * s / seconds;
  EXPECT_NEAR(std::stod(th[1]), tokens, 1);
  EXPECT_NEAR(std::stod(th[2]), tokens / gpus, 1);
  const double perMicrobatch =
      l * (3 * b * s * (8 * h * h + 4 * h * f) + 12 * h * b * s * (s + 1) / 2) +
      3 * 2 * b * s * h * v;
  const double tflops = perMicrobatch * m * dp / seconds / gpus / 1e12;
  EXPECT_NEAR(std::stod(th[3]), tflops, 0.06);
  EXPECT_NEAR(std::stod(th[4]), 100 * tflops / 989, 0.06);
  // An abstract model's times are its own units: no line.
  Result abstract = pipec(compileArgs(""));
  ASSERT_EQ(abstract.code, 0) << abstract.err;
  EXPECT_EQ(abstract.out.find("throughput:"), std::string::npos) << abstract.out;
}

TEST(CliTest, MicrobatchSizeOverridesTheSpecInCompileAndImport) {
  // tiny-gpt's spec says microbatch size 2. --microbatch-size 4 gives the plan of a spec that
  // says 4 (the same step time, twice the tokens of a step), in compile and in import of the
  // same order; an abstract model's costs are per microbatch: exit 2, one line, no file.
  const std::string dir = tmpDir(), four = dir + "/tiny-gpt-4.json", plan = dir + "/t.json",
                    csv = dir + "/t.csv";
  std::string spec = slurp("examples/tiny-gpt.json");
  const std::string two = "\"microbatch_size\": 2";
  ASSERT_NE(spec.find(two), std::string::npos);
  spec.replace(spec.find(two), two.size(), "\"microbatch_size\": 4");
  spit(four, spec);
  const std::string layout = " --schedule 1f1b --pp 2 --microbatches 4 ";
  auto stepLine = [](const std::string &out) {
    size_t at = out.find("\nmakespan ");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at + 1) - at);
  };
  Result fromSpec = pipec("compile --model " + four + layout + "-o " + plan);
  ASSERT_EQ(fromSpec.code, 0) << fromSpec.err;
  Result flag = pipec("compile --model examples/tiny-gpt.json" + layout + "--microbatch-size 4");
  ASSERT_EQ(flag.code, 0) << flag.err;
  EXPECT_EQ(stepLine(flag.out), stepLine(fromSpec.out)) << flag.out;
  Result spec2 = pipec("compile --model examples/tiny-gpt.json" + layout);
  ASSERT_EQ(spec2.code, 0) << spec2.err;
  EXPECT_NE(stepLine(spec2.out), stepLine(fromSpec.out)) << spec2.out;
  ASSERT_EQ(pipec("export " + plan + " --format torch-csv -o " + csv).code, 0);
  Result imported = pipec("import " + csv + " --model examples/tiny-gpt.json --microbatch-size 4");
  ASSERT_EQ(imported.code, 0) << imported.err;
  EXPECT_EQ(stepLine(imported.out), stepLine(fromSpec.out)) << imported.out;
  expectBadInput("compile --model examples/uniform-8.json" + layout + "--microbatch-size 4",
                 "--microbatch-size: the model is an abstract layer list with given costs");
  expectBadInput("import " + csv + " --model examples/uniform-8.json --microbatch-size 4",
                 "--microbatch-size: the model is an abstract layer list with given costs");
  expectBadInput("compile --model examples/tiny-gpt.json" + layout + "--microbatch-size 0",
                 "--microbatch-size");
}

TEST(CliTest, ATransformersTimesOnAnUncalibratedClusterSaySo) {
  // The embedded default cluster and a spec without a calibration record time a transformer
  // with factors no published run has checked: compile and import say so under the summary and
  // name the calibrated specs. A calibrated spec, an abstract model (its own costs) and --quiet: no
  // note.
  const std::string llama = "compile --model examples/llama3-8b.json --schedule 1f1b --pp 4 "
                            "--microbatches 8 ";
  // The same sentence as plan's "calibration: none:" line (PlannerTest).
  const std::string note = " carries no calibration record, so these step times rest on factors "
                           "no published run has checked; --cluster examples/a100-selene.json "
                           "or examples/h100-nemo.json are fitted to published runs "
                           "(docs/planner.md#calibration-out-of-sample)\n";
  // `args` prints the note naming `who`, or (who empty) none.
  auto expectNote = [&](const std::string &args, const std::string &who) {
    Result r = pipec(args);
    ASSERT_EQ(r.code, 0) << args << ": " << r.err;
    if (who.empty())
      EXPECT_EQ(r.out.find("calibration record"), std::string::npos) << args << ": " << r.out;
    else
      EXPECT_NE(r.out.find("\nnote: " + who + note), std::string::npos) << args << ": " << r.out;
  };
  const std::string embedded = "the embedded default cluster (no --cluster)";
  expectNote(llama, embedded);
  expectNote(llama + "--cluster examples/a100-80g.json", "the cluster spec");
  for (const std::string &args :
       {llama + "--cluster examples/h100-nemo.json", compileArgs(""), llama + "--quiet"})
    expectNote(args, "");
  // import times an order the same way: the same note, the same exceptions.
  const std::string dir = tmpDir(), plan = dir + "/llama.json", csv = dir + "/llama.csv";
  ASSERT_EQ(pipec(llama + "--quiet -o " + plan).code, 0);
  ASSERT_EQ(pipec("export " + plan + " --format torch-csv -o " + csv).code, 0);
  const std::string import = "import " + csv + " --model examples/llama3-8b.json ";
  expectNote(import, embedded);
  expectNote(import + "--cluster examples/h100-nemo.json", "");
}

TEST(CliTest, ALayoutOverTheDeviceIsWarnedAboutUnderTheClustersMemoryRule) {
  // Narayanan et al.'s 1.7B layout (Table 1: no pipeline, dp 32, microbatch 16, full
  // recomputation) ran on 80 GB A100s. Under piperun's rule its fused backward keeps the whole
  // stage's weight-gradient state, past the device: the warning names the rank and the rule's
  // alternative. Under Megatron-LM's ("kept_activations": "megatron") it fits: no warning.
  const std::string dir = tmpDir();
  const std::string model = dir + "/gpt-1.7b.json", megatron = dir + "/megatron.json";
  spit(model, R"({"format": "pipemodel/1", "name": "gpt-1.7b", "transformer": {
      "num_layers": 24, "hidden_size": 2304, "num_attention_heads": 24, "ffn_hidden_size": 9216,
      "vocab_size": 51200, "seq_length": 2048, "microbatch_size": 16, "dtype": "bf16",
      "attention": "materialized"}})");
  std::string spec = slurp("examples/a100-selene.json");
  spec.insert(spec.find("\"block_kernels\""), "\"kept_activations\": \"megatron\", ");
  spit(megatron, spec);
  const std::string args = "compile --model " + model +
                           " --schedule 1f1b --pp 1 --microbatches 1 --dp 32 --recompute full "
                           "--cluster ";
  Result over = pipec(args + "examples/a100-selene.json");
  ASSERT_EQ(over.code, 0) << over.err;
  EXPECT_TRUE(std::regex_search(
      over.out, std::regex("\nwarning: rank 0 needs [0-9.]+ GiB but the cluster's "
                           "A100-SXM4-80GB has 80.00 GiB; raise --pp or --tp, or pick a schedule "
                           "with less memory \\(counted as piperun keeps activations; for a "
                           "Megatron-LM or NeMo job add \"kept_activations\": \"megatron\" to "
                           "the cluster spec\\)\n")))
      << over.out;
  Result fits = pipec(args + megatron);
  ASSERT_EQ(fits.code, 0) << fits.err;
  EXPECT_EQ(fits.out.find("warning:"), std::string::npos) << fits.out;
}

TEST(CliTest, PartitionEvenSplitsTheBlocksAsMegatronDoes) {
  // Llama 3 8B's 32 blocks on 4 stages: 8 each, the embedding (layer 0) with the first and
  // the head (layer 33) with the last, as Megatron-LM splits them by default; pipec's own
  // partition balances times instead (the head weighs more than a block).
  const std::string llama = "compile --model examples/llama3-8b.json --schedule 1f1b "
                            "--microbatches 8 ";
  Result even = pipec(llama + "--pp 4 --partition even");
  ASSERT_EQ(even.code, 0) << even.err;
  EXPECT_NE(even.out.find("stages (layers, rank): 0:[0,9)@r0 1:[9,17)@r1 2:[17,25)@r2 "
                          "3:[25,34)@r3\n"),
            std::string::npos)
      << even.out;
  Result balanced = pipec(llama + "--pp 4");
  ASSERT_EQ(balanced.code, 0) << balanced.err;
  EXPECT_EQ(balanced.out.find("3:[25,34)@r3"), std::string::npos) << balanced.out;
  // Interleaved: 32 blocks in 8 chunks of 4.
  Result chunks = pipec("compile --model examples/llama3-8b.json --schedule interleaved-1f1b "
                        "--pp 4 --vpp 2 --microbatches 8 --partition even");
  ASSERT_EQ(chunks.code, 0) << chunks.err;
  EXPECT_NE(chunks.out.find("0:[0,5)@r0 1:[5,9)@r1"), std::string::npos) << chunks.out;
  EXPECT_NE(chunks.out.find("7:[29,34)@r3"), std::string::npos) << chunks.out;
  // Stages that do not divide the blocks, and a value that is no rule: one line each.
  expectBadInput(llama + "--pp 3 --partition even",
                 "--partition even: the model's 32 blocks do not split evenly into 3 stages "
                 "(--pp 3 x --vpp 1); try --partition balanced, or a --pp and --vpp whose "
                 "product divides 32");
  expectBadInput(llama + "--pp 4 --partition megatron",
                 "--partition: expected balanced or even (got 'megatron'); try --partition even");
}

TEST(CliTest, SequenceParallelAndDistributedOptimizerAreRecordedAndPiperunRefusesThem) {
  // pipec compiles them (memory and communication) and records them in the plan; piperun does
  // not execute them yet: exit 2, one line naming the flag, before any step.
  for (const char *flag : {"--sequence-parallel", "--distributed-optimizer"}) {
    SCOPED_TRACE(flag);
    std::string out = tmpDir() + "/option" + std::string(flag).substr(1) + ".json";
    Result c = pipec(std::string("compile --model examples/tiny-gpt.json --schedule 1f1b --pp 2 "
                                 "--microbatches 4 --tp 2 --dp 2 --quiet ") +
                     flag + " -o " + out);
    ASSERT_EQ(c.code, 0) << c.err;
    auto j = nlohmann::json::parse(slurp(out));
    std::string key = std::string(flag).substr(2);
    std::replace(key.begin(), key.end(), '-', '_');
    EXPECT_EQ(j["parallel"][key], true) << j["parallel"].dump();
    Result r = piperun(out + " --backend cpu --steps 1");
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_EQ(lines(r.err), 1u) << r.err;
    EXPECT_NE(r.err.find(flag), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("step 0"), std::string::npos) << r.out;
  }
}

TEST(CliTest, ASwitchThatChangesNothingIsRecordedOffAndPiperunRunsThePlan) {
  // Sequence parallelism with one tp rank and ZeRO-1 with one replica change nothing (Megatron-LM
  // turns them off the same way): the plan is byte for byte the one without the switch, and
  // piperun runs it (it refused such a plan when the switch was recorded on).
  const std::string base = "compile --model examples/tiny-gpt.json --schedule 1f1b --pp 2 "
                           "--microbatches 4 --tp 1 --dp 1 --quiet -o ";
  const std::string plain = tmpDir() + "/no-switch.json";
  ASSERT_EQ(pipec(base + plain).code, 0);
  for (const char *flag : {"--sequence-parallel", "--distributed-optimizer"}) {
    SCOPED_TRACE(flag);
    std::string out = tmpDir() + "/no-op" + std::string(flag).substr(1) + ".json";
    Result c = pipec(base + out + " " + flag);
    ASSERT_EQ(c.code, 0) << c.err;
    EXPECT_EQ(slurp(out), slurp(plain));
    Result r = piperun(out + " --backend cpu --steps 1");
    EXPECT_EQ(r.code, 0) << r.out << r.err;
  }
}

TEST(CliTest, IdenticalInputsGiveByteIdenticalPlans) {
  std::string a = tmpDir() + "/a.json", b = tmpDir() + "/b.json";
  ASSERT_EQ(pipec(compileArgs("--tp 2 --dp 2 -o " + a)).code, 0);
  ASSERT_EQ(pipec(compileArgs("--tp 2 --dp 2 -o " + b)).code, 0);
  EXPECT_EQ(slurp(a), slurp(b));
  EXPECT_FALSE(slurp(a).empty());
}

TEST(CliTest, MissingModelFileIsExitTwo) {
  expectBadInput("compile --model /no/such.json --schedule 1f1b --pp 4 --microbatches 8",
                 "--model: /no/such.json: cannot read: No such file or directory");
}

TEST(CliTest, MalformedJsonIsExitTwoWithLineAndColumn) {
  std::string m = tmpDir() + "/bad.json";
  spit(m, "{\"format\": \"pipemodel/1\",\n \"layers\": [}\n");
  expectBadInput("compile --model " + m + " --schedule 1f1b --pp 2 --microbatches 2",
                 "bad.json:2:13: malformed JSON");
}

TEST(CliTest, StringWhereANumberBelongsNamesTheField) {
  std::string m = tmpDir() + "/str.json";
  spit(m, R"({"format": "pipemodel/1", "layers": [{"count": 4, "forward": "1.0",
      "backward_input": 1, "backward_weight": 1}]})");
  expectBadInput("compile --model " + m + " --schedule 1f1b --pp 2 --microbatches 2",
                 "$.layers[0].forward: expected a number >= 0, got string \"1.0\"");
}

TEST(CliTest, ZeroPipelineRanksIsExitTwo) {
  expectBadInput(std::string("compile --model ") + kModel +
                     " --schedule 1f1b --pp 0 --microbatches 8",
                 "--pp must be at least 1 (got 0); try --pp 1");
}

TEST(CliTest, MoreStagesThanLayersIsExitTwo) {
  expectBadInput(std::string("compile --model ") + kModel +
                     " --schedule 1f1b --pp 16 --microbatches 8",
                 "16 stages but the model has 8 layers; every stage needs at least one layer; "
                 "try --pp 8");
}

// A suggested fix, applied as written, compiles (a helper's sweep found loops: "try --pp 1" for
// a --vpp past the layers, "try --tp 4" where the key/value groups need 2, a schedule's fix
// that ran into the layer count, a bound's fix that ran into the next bound).
TEST(CliTest, AFlagsSuggestedFixAppliedAsWrittenCompiles) {
  const std::regex fixRe(R"(; try (--[a-z-]+) (\S+?)(?: or .*)?\n$)");
  for (std::string line :
       {"--model examples/tiny-gpt.json --schedule interleaved-1f1b --pp 2 --vpp 9 "
        "--microbatches 4",
        "--model examples/tiny-gpt.json --schedule 1f1b --pp 4 --vpp 100000 --microbatches 4",
        "--model examples/tiny-gpt.json --schedule interleaved-1f1b --pp 4 --vpp 2 "
        "--microbatches 6",
        "--model examples/tiny-llama.json --schedule 1f1b --pp 2 --microbatches 4 --tp 8",
        "--model examples/tiny-gpt.json --schedule 1f1b --pp 9 --microbatches 9",
        "--model examples/tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 4 --dp 1000000000",
        "--model examples/tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 4 --tp 2 --dp "
        "65536",
        "--model examples/uniform-8.json --schedule interleaved-1f1b --pp 4 --vpp 2 "
        "--microbatches 5 --microbatch-group-size 1",
        "--model examples/uniform-8.json --schedule seq1f1b-interleaved --pp 4 --vpp 2 "
        "--seq-splits 3 --microbatches 3 --microbatch-group-size 1",
        "--model examples/uniform-8.json --schedule interleaved-1f1b --pp 4 --vpp 2 "
        "--microbatches 3 --microbatch-group-size 5"}) {
    SCOPED_TRACE(line);
    Result r = pipec("compile --quiet " + line);
    std::string history;
    for (int fixes = 0; r.code == 2 && fixes < 3; ++fixes) {
      std::smatch fix;
      ASSERT_TRUE(std::regex_search(r.err, fix, fixRe)) << history << r.err;
      history += r.err;
      // The flag's value replaced (the first fix names a flag the line has).
      const std::regex flagValue(fix[1].str() + " \\S+");
      ASSERT_TRUE(std::regex_search(line, flagValue)) << history;
      line = std::regex_replace(line, flagValue, fix[1].str() + " " + fix[2].str());
      r = pipec("compile --quiet " + line);
    }
    EXPECT_EQ(r.code, 0) << history << r.err;
    EXPECT_LE(std::count(history.begin(), history.end(), '\n'), 1) << history;
  }
}

TEST(CliTest, UnknownScheduleIsExitTwoAndSuggestsTheNearest) {
  expectBadInput(std::string("compile --model ") + kModel +
                     " --schedule 1f1c --pp 4 --microbatches 8",
                 "--schedule: unknown schedule '1f1c' (known: gpipe, 1f1b, ");
  Result r =
      pipec(std::string("compile --model ") + kModel + " --schedule 1f1c --pp 4 --microbatches 8");
  EXPECT_NE(r.err.find("); try 1f1b\n"), std::string::npos) << r.err;
}

TEST(CliTest, NegativeMicrobatchesIsExitTwo) {
  expectBadInput(std::string("compile --model ") + kModel +
                     " --schedule 1f1b --pp 4 --microbatches -3",
                 "--microbatches must be at least 1 (got -3)");
}

TEST(CliTest, NonNumericFlagIsExitTwo) {
  expectBadInput(std::string("compile --model ") + kModel +
                     " --schedule 1f1b --pp four --microbatches 8",
                 "--pp expects an integer (got 'four')");
}

TEST(CliTest, UnknownFlagSuggestsTheNearest) {
  expectBadInput(std::string("compile --model ") + kModel +
                     " --schedule 1f1b --pp 4 --microbatch 8",
                 "unknown flag --microbatch; did you mean --microbatches?");
}

TEST(CliTest, ZbAutoWithoutAMemoryLimitIsExitTwoWithASuggestion) {
  expectBadInput(std::string("compile --model ") + kModel +
                     " --schedule zb-auto --pp 4 --microbatches 8",
                 "zb-auto needs --memory-limit (bytes per rank of activations); try "
                 "--memory-limit ");
}

TEST(CliTest, ScheduleConstraintNamesTheFlagAndTheFix) {
  expectBadInput(std::string("compile --model ") + kModel +
                     " --schedule 1f1b --pp 4 --microbatches 8 --seq-splits 2",
                 "1f1b needs --seq-splits 1 (got 2)");
}

TEST(CliTest, AnUnwritableTraceLeavesNoPlanBehind) {
  std::string out = tmpDir() + "/plan-with-bad-trace.json";
  Result r = pipec(compileArgs("-o " + out + " --trace /no/such/dir/trace.json"));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--trace: /no/such/dir/trace.json: cannot write"), std::string::npos)
      << r.err;
  EXPECT_FALSE(exists(out));
  EXPECT_FALSE(exists(out + ".tmp"));
}

TEST(CliTest, TheSameFileForPlanAndTraceIsRefusedBeforeWriting) {
  std::string out = tmpDir() + "/same.json";
  std::remove(out.c_str());
  Result r = pipec(compileArgs("-o " + out + " --trace " + out));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("is also the -o output; give each output its own file"), std::string::npos)
      << r.err;
  EXPECT_FALSE(exists(out));
}

TEST(CliTest, ANumberTooLargeForADoubleIsExitTwo) {
  std::string m = tmpDir() + "/huge.json";
  spit(m, R"({"format": "pipemodel/1", "layers": [{"count": 4, "forward": 1e400,
      "backward_input": 1, "backward_weight": 1}]})");
  expectBadInput("compile --model " + m + " --schedule 1f1b --pp 2 --microbatches 2",
                 "huge.json: a number is out of range (too large for a double)");
}

TEST(CliTest, DeeplyNestedJsonIsExitTwo) {
  std::string p = tmpDir() + "/deep.json";
  spit(p, "{\"format\": \"pipeplan/1\", \"parallel\": " + std::string(100000, '[') +
              std::string(100000, ']') + "}");
  Result r = pipec("validate " + p);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("JSON nested 100001 levels deep"), std::string::npos) << r.err;
}

TEST(CliTest, ValidateAcceptsACompiledPlanAndRejectsABrokenOne) {
  std::string good = tmpDir() + "/good.json";
  ASSERT_EQ(pipec(compileArgs("-o " + good)).code, 0);
  Result ok = pipec("validate " + good);
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.out.find("deadlock-free"), std::string::npos);
  // Swap rank 1's first two instructions' microbatches: a FIFO mismatch or a dependency error.
  auto j = nlohmann::json::parse(slurp(good));
  auto &ins = j["ranks"][0]["instructions"];
  std::swap(ins[0], ins[2]); // F1 before F0's send... and F0 after its own send
  std::string bad = tmpDir() + "/broken.json";
  spit(bad, j.dump());
  Result r = pipec("validate " + bad);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("<-- here"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 0 step"), std::string::npos) << r.err;
}

TEST(CliTest, ValidateOfAPlanWithAWrongFieldIsExitTwo) {
  std::string good = tmpDir() + "/good2.json";
  ASSERT_EQ(pipec(compileArgs("-o " + good)).code, 0);
  auto j = nlohmann::json::parse(slurp(good));
  j["ranks"][1]["instructions"][0]["peer"] = 9;
  std::string bad = tmpDir() + "/badpeer.json";
  spit(bad, j.dump());
  Result r = pipec("validate " + bad);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("$.ranks[1].instructions[0].peer: expected a pipeline rank below 4, got "
                       "number 9"),
            std::string::npos)
      << r.err;
}

TEST(CliTest, SimulateWritesAChromeTraceWithOneTrackPerRank) {
  std::string plan = tmpDir() + "/sim.json", trace = tmpDir() + "/trace.json";
  ASSERT_EQ(pipec(compileArgs("-o " + plan)).code, 0);
  Result r = pipec("simulate " + plan + " --trace " + trace);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("bubble ratio 0.2727"), std::string::npos) << r.out;
  auto j = nlohmann::json::parse(slurp(trace));
  std::set<int> tracks;
  int slices = 0;
  for (const auto &e : j["traceEvents"]) {
    if (e["ph"] == "X") {
      tracks.insert(e["tid"].get<int>());
      ++slices;
      EXPECT_GE(e["dur"].get<double>(), 0);
    }
  }
  EXPECT_EQ(tracks, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(slices, 4 * 8 * 2); // every F and B of every rank
}

TEST(CliTest, ShowPrintsTheGridAndTheTextForm) {
  std::string plan = tmpDir() + "/show.json";
  ASSERT_EQ(pipec(compileArgs("-o " + plan)).code, 0);
  Result grid = pipec("show " + plan + " --compute-only");
  ASSERT_EQ(grid.code, 0);
  EXPECT_NE(grid.out.find("step 00: 0F0"), std::string::npos) << grid.out;
  Result text = pipec("show " + plan + " --text --compute-only");
  EXPECT_NE(text.out.find("rank 3: 3F0 3B0 3F1 3B1"), std::string::npos) << text.out;
}

TEST(CliTest, ListSchedulesNamesEachWithItsConstraints) {
  Result r = pipec("list-schedules");
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("gpipe"), std::string::npos);
  EXPECT_NE(r.out.find("1f1b"), std::string::npos);
  EXPECT_NE(r.out.find("constraints:"), std::string::npos);
}

TEST(CliTest, MemoryLimitBelowThePeakIsAFinding) {
  Result r = pipec(compileArgs("--memory-limit 4MiB"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("rank 0 holds 8.00 MiB of activations at its peak, over --memory-limit "
                       "4.00 MiB"),
            std::string::npos)
      << r.err;
}

std::string tinyPlan(const std::string &name, const std::string &flags) {
  std::string plan = tmpDir() + "/" + name + ".json";
  Result r = pipec("compile --model examples/tiny-gpt.json " + flags + " --quiet -o " + plan);
  EXPECT_EQ(r.code, 0) << r.err;
  return plan;
}

// A job killed after its last save but before its --export-hf: the relaunch of the same command
// line said "nothing to train" and exited 0 with no export (a helper's probe). It now exports
// the checkpoint's weights, byte for byte the uninterrupted run's export.
TEST(CliTest, ARelaunchOfAFinishedJobExportsItsWeights) {
  const std::string plan = tinyPlan("finished", "--schedule 1f1b --pp 2 --microbatches 2");
  const std::string d = tmpDir() + "/finished-job";
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  Result whole = piperun(plan + " --steps 3 --export-hf " + d + "/whole");
  ASSERT_EQ(whole.code, 0) << whole.err;
  // The launch that saved step 3 and was killed before exporting.
  Result saved = piperun(plan + " --steps 3 --save-dir " + d + "/ck");
  ASSERT_EQ(saved.code, 0) << saved.err;
  const std::string line =
      plan + " --steps 3 --save-dir " + d + "/ck --resume " + d + "/ck --export-hf " + d + "/hf";
  Result relaunch = piperun(line);
  ASSERT_EQ(relaunch.code, 0) << relaunch.err;
  EXPECT_NE(relaunch.out.find("at or past --steps 3: nothing to train; exporting its weights"),
            std::string::npos)
      << relaunch.out;
  EXPECT_EQ(slurp(d + "/hf/model.safetensors"), slurp(d + "/whole/model.safetensors"));
  EXPECT_EQ(slurp(d + "/hf/config.json"), slurp(d + "/whole/config.json"));
  // Without --export-hf there is nothing to do, as before.
  Result again = piperun(plan + " --steps 3 --resume " + d + "/ck");
  EXPECT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find("nothing to train\n"), std::string::npos) << again.out;
}

TEST(PiperunTest, RunsStepsAndPrintsTheirLoss) {
  std::string plan = tinyPlan("run", "--schedule 1f1b --pp 2 --microbatches 4");
  Result r = piperun(plan + " --backend cpu --steps 3 --seed 5");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("step 0 loss "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step 2 loss "), std::string::npos) << r.out;
}

TEST(PiperunTest, CheckReferencePrintsTheGradientDifference) {
  std::string plan = tinyPlan("ref", "--schedule zb-h1 --pp 2 --microbatches 4 --tp 2 --dp 2");
  Result r = piperun(plan + " --backend cpu --steps 2 --check-reference");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("max_abs_grad_diff="), std::string::npos) << r.out;
  // ... and where its largest difference was (ReferenceRunTest checks the place itself).
  EXPECT_NE(r.out.find("largest difference: step "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("max_tensor_grad_diff="), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("against the reference's "), std::string::npos) << r.out;
  // The weights after the last step (ReferenceRunTest checks what makes them fail).
  EXPECT_NE(r.out.find("max_weight_diff=0.000e+00 of its bound after 2 AdamW step(s)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\ntp_copies=identical (the 2 tp ranks' copies of every tensor they hold "
                       "whole, bit for bit)\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\ndp_copies=identical (the 2 dp replicas' weights, bit for bit)\n"),
            std::string::npos)
      << r.out;
}

TEST(PiperunTest, AVocabularyTheTpRanksCannotSplitIsOneLineWithTheFix) {
  // The runtime splits wte and the LM head by vocabulary rows across the tp ranks.
  auto model = nlohmann::json::parse(slurp("examples/tiny-gpt.json"));
  model["transformer"]["vocab_size"] = 33;
  const std::string spec = tmpDir() + "/vocab33.json", plan = tmpDir() + "/vocab33-plan.json";
  spit(spec, model.dump());
  Result c = pipec("compile --model " + spec +
                   " --schedule 1f1b --pp 2 --microbatches 2 --tp 2 --quiet -o " + plan);
  ASSERT_EQ(c.code, 0) << c.err;
  Result r = piperun(plan + " --backend cpu");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("--tp 2 must divide vocab_size (33)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("pad vocab_size to a multiple of 2 (e.g. 34)"), std::string::npos) << r.err;
}

TEST(PiperunTest, RefusesAPlanThatFailsVerification) {
  std::string plan = tinyPlan("bad", "--schedule gpipe --pp 2 --microbatches 2");
  auto j = nlohmann::json::parse(slurp(plan));
  auto &ins = j["ranks"][1]["instructions"];
  ins.erase(ins.begin()); // rank 1 loses its first recv
  spit(plan, j.dump());
  Result r = piperun(plan + " --backend cpu");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("refusing to run a plan that fails verification"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("<-- here"), std::string::npos) << r.err;
}

TEST(PiperunTest, AnExtraCopyOfATpAllReduceIsAFindingOfValidateAndPiperun) {
  // Issue 36's reproducer: it passed `pipec validate` and corrupted piperun's heap.
  std::string plan = tinyPlan("extra-tp", "--schedule 1f1b --pp 2 --microbatches 4 --tp 2");
  auto j = nlohmann::json::parse(slurp(plan));
  auto &ins = j["ranks"][0]["instructions"];
  nlohmann::json copy;
  for (const auto &i : ins)
    if (i["op"] == "all_reduce" && i["group"] == "tp")
      copy = i;
  ins.insert(ins.begin() + 5, copy);
  spit(plan, j.dump());
  Result v = pipec("validate " + plan);
  EXPECT_EQ(v.code, 1) << v.out << v.err;
  EXPECT_NE(v.err.find("a tp all-reduce must come right after the part it reduces"),
            std::string::npos)
      << v.err;
  Result r = piperun(plan + " --backend cpu");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("refusing to run a plan that fails verification"), std::string::npos)
      << r.err;
}

TEST(PiperunTest, GpuBackendsSayTheyAreNotAvailableInOneLine) {
  std::string plan = tinyPlan("gpu", "--schedule 1f1b --pp 2 --microbatches 2");
  for (const char *b : {"cuda", "nccl"}) {
    Result r = piperun(plan + " --backend " + b);
    EXPECT_EQ(r.code, 2);
    EXPECT_EQ(lines(r.err), 1u) << r.err;
    EXPECT_NE(r.err.find(std::string("--backend ") + b), std::string::npos) << r.err;
  }
}

TEST(PiperunTest, AnUnknownFlagIsOneLineThatNamesTheToolOnce) {
  std::string plan = tinyPlan("flag", "--schedule 1f1b --pp 2 --microbatches 2");
  Result r = piperun(plan + " --backend cpu --stepz 2");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "piperun: error: unknown flag --stepz; did you mean --steps?\n");
  Result twice = piperun(plan + " --backend cpu --steps 1 --steps 2");
  EXPECT_EQ(twice.code, 2);
  EXPECT_EQ(twice.err, "piperun: error: --steps given twice ('1' and '2'); give it once\n");
}

TEST(PiperunTest, TheCpuBackendRefusesBf16InOneLine) {
  std::string plan = tinyPlan("dtype", "--schedule 1f1b --pp 2 --microbatches 2");
  Result r = piperun(plan + " --backend cpu --dtype bf16");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("--dtype bf16: the cpu backend computes in fp32 only"), std::string::npos)
      << r.err;
  Result bad = piperun(plan + " --backend cpu --dtype int8");
  EXPECT_EQ(bad.code, 2);
  EXPECT_EQ(lines(bad.err), 1u) << bad.err;
  EXPECT_NE(bad.err.find("--dtype: expected fp32 or bf16 (got 'int8'); try --dtype fp32"),
            std::string::npos)
      << bad.err;
  EXPECT_EQ(piperun(plan + " --backend cpu --dtype fp32").code, 0);
}

TEST(PiperunTest, AnAbstractModelOrAMissingDataFileIsExitTwo) {
  std::string abstract = tmpDir() + "/abstract.json";
  ASSERT_EQ(pipec(compileArgs("-o " + abstract)).code, 0);
  Result r = piperun(abstract + " --backend cpu");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("abstract layer list"), std::string::npos) << r.err;
  std::string plan = tinyPlan("data", "--schedule 1f1b --pp 2 --microbatches 2");
  Result d = piperun(plan + " --backend cpu --data /no/such/tokens.bin");
  EXPECT_EQ(d.code, 2);
  EXPECT_NE(d.err.find("--data: /no/such/tokens.bin: cannot read"), std::string::npos) << d.err;
}

} // namespace

namespace {

// Every command answers --help (and -h, and `pipec help COMMAND`): its usage on standard
// output, exit 0, nothing on standard error, and every flag the command takes in it. The flag
// lists are the commands' own parse lists as docs/commands.md states them; each is also
// checked to be accepted (not "unknown flag").
TEST(CliTest, EveryCommandAnswersHelpWithEveryFlag) {
  const std::map<std::string, std::vector<std::string>> flags = {
      {"compile",
       {"--model", "--schedule", "--pp", "--vpp", "--microbatches", "--seq-splits", "--tp", "--dp",
        "--cluster", "--memory-limit", "--microbatch-group-size", "-o", "--output", "--trace",
        "--svg", "--recompute", "--show", "--quiet"}},
      {"validate", {}},
      {"simulate", {"--trace"}},
      {"show", {"--svg", "--compute-only", "--text"}},
      {"list-schedules", {}},
      {"export", {"--format", "-o", "--output"}},
      {"import",
       {"--model", "--vpp", "--tp", "--dp", "--cluster", "--memory-limit",
        "--microbatch-group-size", "--schedule", "-o", "--output", "--trace", "--show", "--quiet"}},
      {"plan",
       {"--model",
        "--gpus",
        "--global-batch",
        "--cluster",
        "--schedules",
        "--memory-limit",
        "--min-headroom",
        "--top",
        "-o",
        "--output",
        "--csv",
        "--recompute",
        "--microbatch-sizes",
        "--seq-splits",
        "--max-vpp",
        "--tp",
        "--pp",
        "--tp-across-nodes",
        "--threads",
        "--quiet"}},
  };
  Result all = pipec("--help");
  EXPECT_EQ(all.code, 0) << all.err;
  for (const auto &[cmd, list] : flags) {
    SCOPED_TRACE(cmd);
    EXPECT_NE(all.out.find("  " + cmd), std::string::npos) << all.out;
    for (const std::string &form :
         {cmd + " --help", cmd + " -h", "help " + cmd, cmd + " --model x.json --help"}) {
      Result r = pipec(form);
      EXPECT_EQ(r.code, 0) << form << ": " << r.out << r.err;
      EXPECT_EQ(r.err, "") << form;
      EXPECT_EQ(r.out.rfind("usage: pipec " + cmd, 0), 0u) << form << ": " << r.out;
      EXPECT_NE(r.out.find("exit codes:"), std::string::npos) << r.out;
    }
    Result r = pipec(cmd + " --help");
    for (const std::string &flag : list) {
      // The flag as a word of the usage: followed by a space, ']' , '|' or '='.
      bool found = false;
      for (char after : std::string(" ]|="))
        found |= r.out.find(flag + after) != std::string::npos;
      EXPECT_TRUE(found) << flag << " missing from:\n" << r.out;
      Result probe = pipec(cmd + " " + flag + " 1 x y");
      EXPECT_EQ(probe.err.find("unknown flag"), std::string::npos) << flag << ": " << probe.err;
    }
    // A flag the command does not take is still refused.
    Result bogus = pipec(cmd + " --bogus-flag 1");
    EXPECT_EQ(bogus.code, 2) << bogus.err;
  }
}

} // namespace
