//===- BadInputTest.cpp - A catalogue of bad inputs, each with its one line -------------===//
//
// Every case runs the real pipec or piperun in a directory of its own, prepared with the files
// it needs, and expects what the house rules promise for bad input (docs/reliability.md): exit
// code 2, exactly one line on standard error naming the problem, and not one file more, less or
// changed in the directory afterwards (no output, no temporary, no input overwritten). The
// cases are those a hostile user tried (issue 36): flags out of range, special files and
// oversized inputs, outputs onto inputs or devices, sizes past the machine's memory, a full
// disk and a closed pipe on standard output, fields past their types, long values, checkpoints
// of another model.
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

namespace {

namespace fs = std::filesystem;
using pipec::testing::slurp;
using pipec::testing::tmpDir;
using Json = nlohmann::json;

/// Where a case's standard output goes.
enum class Stdout {
  File,       // a file outside the case's directory
  Full,       // /dev/full: every write fails with ENOSPC
  ClosedPipe, // a pipe whose read end is closed: every write fails with EPIPE
};

struct Case {
  std::string name;
  /// Prepares the case's directory (its files are what must be unchanged afterwards).
  std::function<void(const std::string &dir)> setup;
  /// A shell command run in the directory; $PIPEC and $PIPERUN are the tools.
  std::string command;
  /// What the one line must contain.
  std::string needle;
  Stdout out = Stdout::File;
};

std::string runfiles() { return fs::current_path().string(); }

void spit(const std::string &path, const std::string &text) {
  std::ofstream(path, std::ios::binary) << text;
}

/// A file of `bytes` bytes that takes no room on disk (a hole).
void sparse(const std::string &path, off_t bytes) {
  spit(path, "");
  ASSERT_EQ(::truncate(path.c_str(), bytes), 0) << path;
}

void copyExample(const std::string &dir, const std::string &name) {
  fs::copy_file(runfiles() + "/examples/" + name, dir + "/" + name);
}

/// `pipec compile` of examples/<model> into dir/<out>, for cases that start from a good plan.
void compileInto(const std::string &dir, const std::string &model, const std::string &flags,
                 const std::string &out) {
  std::string cmd = runfiles() + "/tools/pipec compile --quiet --model " + runfiles() +
                    "/examples/" + model + " " + flags + " -o " + dir + "/" + out;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

/// `pipec compile` of dir/<model> (a spec a case wrote or edited) into dir/<out>.
void compileLocal(const std::string &dir, const std::string &model, const std::string &flags,
                  const std::string &out) {
  std::string cmd = "cd " + dir + " && " + runfiles() + "/tools/pipec compile --quiet --model " +
                    model + " " + flags + " -o " + out;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

/// Read, edit and write back a JSON file.
void editJson(const std::string &path, const std::function<void(Json &)> &edit) {
  Json j = Json::parse(slurp(path));
  edit(j);
  spit(path, j.dump(1));
}

/// Every file under `dir` with its size and contents' hash: what must not change.
std::map<std::string, std::string> snapshot(const std::string &dir) {
  std::map<std::string, std::string> files;
  for (auto it = fs::recursive_directory_iterator(dir); it != fs::recursive_directory_iterator();
       ++it) {
    std::string rel = fs::relative(it->path(), dir).string();
    if (it->is_symlink()) {
      files[rel] = "-> " + fs::read_symlink(it->path()).string();
      continue;
    }
    if (it->is_directory()) {
      files[rel] = "dir";
      continue;
    }
    if (!it->is_regular_file()) {
      files[rel] = "special";
      continue;
    }
    std::error_code ec;
    const uintmax_t size = fs::file_size(it->path(), ec);
    std::string sig = std::to_string(size);
    if (size <= (1u << 20)) // small files: their bytes too
      sig += ":" + std::to_string(std::hash<std::string>()(slurp(it->path().string())));
    files[rel] = sig;
  }
  return files;
}

size_t lines(const std::string &s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

struct Outcome {
  int code = -1;
  std::string out, err;
};

/// Runs `command` in `dir` through the shell with standard output as `where` says.
Outcome runIn(const std::string &dir, const std::string &command, Stdout where) {
  const std::string errPath = tmpDir() + "/case-stderr.txt",
                    outPath = tmpDir() + "/case-stdout.txt";
  const std::string env = "PIPEC=" + runfiles() + "/tools/pipec PIPERUN=" + runfiles() +
                          "/tools/piperun; export PIPEC PIPERUN; cd " + dir + " && ";
  const std::string script = env + "(" + command + ")";
  Outcome o;
  if (where != Stdout::ClosedPipe) {
    std::string sink = where == Stdout::Full ? std::string("/dev/full") : outPath;
    std::string full = "/bin/sh -c '" + script + "' >" + sink + " 2>" + errPath;
    int status = std::system(full.c_str());
    o.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    o.out = where == Stdout::File ? slurp(outPath) : "";
    o.err = slurp(errPath);
    return o;
  }
  // A pipe nobody reads: its read end is closed before the command starts, so its first write
  // fails with EPIPE (the tools ignore SIGPIPE) whatever the timing.
  int fds[2];
  if (::pipe(fds) != 0)
    return o;
  ::close(fds[0]);
  pid_t pid = ::fork();
  if (pid == 0) {
    int err = ::open(errPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fds[1], 1);
    ::dup2(err, 2);
    ::signal(SIGPIPE, SIG_DFL); // as a shell would start it: the tool itself must ignore it
    ::execl("/bin/sh", "sh", "-c", script.c_str(), static_cast<char *>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  o.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  o.err = slurp(errPath);
  return o;
}

const char *kTiny = "tiny-gpt.json";
const char *kUniform = "uniform-8.json";
const std::string kCompileUniform =
    "$PIPEC compile --model uniform-8.json --schedule 1f1b --pp 4 --microbatches 8";

void withUniform(const std::string &dir) { copyExample(dir, kUniform); }
void withTiny(const std::string &dir) { copyExample(dir, kTiny); }
void withPlan(const std::string &dir) {
  compileInto(dir, kUniform, "--schedule 1f1b --pp 2 --microbatches 2", "p.json");
}
void withTinyPlan(const std::string &dir) {
  compileInto(dir, kTiny, "--schedule 1f1b --pp 2 --microbatches 2", "p.json");
}

/// A model spec with `edit` applied to the uniform-8 example.
std::function<void(const std::string &)> modelWith(std::function<void(Json &)> edit) {
  return [edit](const std::string &dir) {
    copyExample(dir, kUniform);
    editJson(dir + "/" + kUniform, edit);
  };
}

/// A transformer spec with `edit` applied to the tiny-gpt example.
std::function<void(const std::string &)> tinyWith(std::function<void(Json &)> edit) {
  return [edit](const std::string &dir) {
    copyExample(dir, kTiny);
    editJson(dir + "/" + kTiny, edit);
  };
}

/// A cluster spec of the H100 example with `edit` applied.
std::function<void(const std::string &)> clusterWith(std::function<void(Json &)> edit) {
  return [edit](const std::string &dir) {
    copyExample(dir, kUniform);
    copyExample(dir, "h100-2nodes.json");
    editJson(dir + "/h100-2nodes.json", edit);
  };
}

/// A compiled tiny-gpt plan with `edit` applied.
std::function<void(const std::string &)> planWith(std::function<void(Json &)> edit) {
  return [edit](const std::string &dir) {
    withTinyPlan(dir);
    editJson(dir + "/p.json", edit);
  };
}

/// A checkpoint of tiny-gpt (pp 2, 2 microbatches) after 1 step in dir/ck, and its plan p.json.
void withCheckpoint(const std::string &dir) {
  withTinyPlan(dir);
  std::string cmd = "cd " + dir + " && " + runfiles() +
                    "/tools/piperun p.json --steps 1 --save-dir ck >/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

/// tiny-gpt's plan p.json and, in dir/hf, its weights after one step in Hugging Face's layout.
void withHfExport(const std::string &dir) {
  withTinyPlan(dir);
  std::string cmd = "cd " + dir + " && " + runfiles() +
                    "/tools/piperun p.json --steps 1 --export-hf hf >/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

const std::string kClusterCompile =
    "$PIPEC compile --model uniform-8.json --schedule 1f1b --pp 2 --microbatches 2 --cluster "
    "h100-2nodes.json";

std::vector<Case> catalogue() {
  std::vector<Case> c;
  auto add = [&](std::string name, std::function<void(const std::string &)> setup,
                 std::string command, std::string needle, Stdout out = Stdout::File) {
    c.push_back(
        Case{std::move(name), std::move(setup), std::move(command), std::move(needle), out});
  };
  // --- Flags -----------------------------------------------------------------------------
  add("PpZero", withUniform,
      "$PIPEC compile --model uniform-8.json --schedule 1f1b --pp 0 "
      "--microbatches 8",
      "--pp must be at least 1 (got 0); try --pp 1");
  add("PpNotANumber", withUniform,
      "$PIPEC compile --model uniform-8.json --schedule 1f1b "
      "--pp four --microbatches 8",
      "--pp expects an integer (got 'four')");
  // The rule names what narrows it: --microbatch-sizes, the tp values that divide the GPUs.
  add("PlanBatchUnderMicrobatchSizes", withTiny,
      "$PIPEC plan --model tiny-gpt.json --gpus 16 --global-batch 64 --microbatch-sizes 3",
      "(--microbatch-sizes 3); try --global-batch");
  // plan's outputs are checked before its search (which would fail here, naming --gpus).
  add("PlanOutputInAMissingDirectory", withUniform,
      "$PIPEC plan --model uniform-8.json --gpus 1048573 --global-batch 64 -o gone/best.json",
      "-o: gone/best.json: cannot write: no directory gone");
  // Digits past 2^63: an integer, too large for the flag (not "expects an integer").
  add("GpusPastInt64", withUniform,
      "$PIPEC plan --model uniform-8.json --gpus 18446744073709551617 --global-batch 8",
      "--gpus must be at most 1048576 (got 18446744073709551617); try --gpus 1048576");
  add("PpAboveItsMaximum", withUniform,
      "$PIPEC compile --model uniform-8.json --schedule 1f1b "
      "--pp 99999999999 --microbatches 8",
      "--pp must be at most 16777216");
  add("MicrobatchesMissing", withUniform,
      "$PIPEC compile --model uniform-8.json --schedule 1f1b "
      "--pp 4",
      "missing --microbatches");
  add("UnknownSchedule", withUniform,
      "$PIPEC compile --model uniform-8.json --schedule 1f1c "
      "--pp 4 --microbatches 8",
      "--schedule: unknown schedule '1f1c'");
  add("UnknownFlagSuggestsTheNearest", withUniform, kCompileUniform + " --ppp 4",
      "unknown flag --ppp; did you mean --pp?");
  add("FlagGivenTwice", withUniform, kCompileUniform + " --pp 2", "--pp given twice");
  add("FlagWithoutItsValue", withUniform, kCompileUniform + " --tp", "--tp needs a value");
  // Not "unexpected argument 'x.json'": the next flag is not taken for the missing value.
  add("FlagWithoutItsValueBeforeAnotherFlag", withUniform, kCompileUniform + " --tp -o x.json",
      "compile: --tp needs a value; give it as --tp T");
  add("PiperunFlagWithoutItsValueBeforeAnotherFlag", nullptr,
      "$PIPERUN p.json --steps --backend cpu", "--steps needs a value; give it as --steps N");
  add("MemoryLimitNotABytes", withUniform, kCompileUniform + " --memory-limit lots",
      "--memory-limit expects a positive byte count");
  add("UnexpectedPositional", withUniform, kCompileUniform + " extra.json",
      "unexpected argument 'extra.json'");
  add("TpNotDividingTheHeads", withTiny,
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b "
      "--pp 2 --microbatches 2 --tp 3",
      "--tp 3 must divide num_attention_heads (4)");
  add("MoreStagesThanLayers", withUniform,
      "$PIPEC compile --model uniform-8.json --schedule 1f1b "
      "--pp 16 --microbatches 8",
      "every stage needs at least one layer; try --pp 8");
  add("UnknownCommand", nullptr, "$PIPEC compiel", "unknown command 'compiel'");
  add("PipecWithoutArguments", nullptr, "$PIPEC", "expected a command");
  add("PiperunWithoutArguments", nullptr, "$PIPERUN", "expected a plan file");
  // --- Sizes: run, or refused up front with the memory they need ---------------------------
  // (4096 layers: the stage count holds them, and the units' bound is what is reached.)
  add("PpTimesMicrobatchesAtTheMaximum", modelWith([](Json &j) { j["layers"][0]["count"] = 4096; }),
      "$PIPEC compile --model uniform-8.json "
      "--schedule gpipe --pp 4096 --microbatches 16777216",
      "beyond what pipec plans (2^24)");
  // 4096 layers, each with its two tp reduction points: tens of TiB, past any machine.
  add("PlanLargerThanTheMachineRefusedWithItsMemory",
      modelWith([](Json &j) { j["layers"][0]["count"] = 4096; }),
      "$PIPEC compile --model uniform-8.json --schedule 1f1b --pp 8 --microbatches 2097152 "
      "--tp 8",
      "instructions) needs about");
  add("PlanLargerThanTheMachineNamesTheFlags",
      modelWith([](Json &j) { j["layers"][0]["count"] = 4096; }),
      "$PIPEC compile --model uniform-8.json --schedule 1f1b --pp 8 --microbatches 2097152 "
      "--tp 8",
      "TiB of memory, more than this machine's");
  add(
      "VocabularyOf2To20OnTheCpuBackendRefusedWithItsMemory",
      [](const std::string &dir) {
        spit(dir + "/big.json",
             R"({"format": "pipemodel/1", "name": "big-vocab", "transformer": {"num_layers": 4,
                "hidden_size": 4096, "num_attention_heads": 32, "vocab_size": 1048576,
                "seq_length": 16, "microbatch_size": 1, "dtype": "fp32"}})");
        compileLocal(dir, "big.json", "--schedule 1f1b --pp 1 --microbatches 1", "p.json");
      },
      "$PIPERUN p.json --backend cpu",
      "the cpu backend's run of model 'big-vocab' (vocab_size 1048576, hidden_size 4096, 4 "
      "layers; 1 rank threads) needs about");
  // A model with dropout compiles (its memory under a "megatron" cluster counts the masks);
  // piperun runs no dropout and refuses the plan rather than train without it.
  add(
      "PiperunRefusesDropout",
      [](const std::string &dir) {
        tinyWith([](Json &j) { j["transformer"]["hidden_dropout"] = 0.1; })(dir);
        compileLocal(dir, kTiny, "--schedule 1f1b --pp 2 --microbatches 2", "p.json");
      },
      "$PIPERUN p.json --backend cpu",
      "the plan's model has dropout ($.transformer.hidden_dropout: 0.1), which piperun does not "
      "execute; compile a model with \"hidden_dropout\": 0");
  // Context parallelism: compiled and sized, not executed; its rules named with the flag.
  add(
      "PiperunRefusesContextParallelism",
      [](const std::string &dir) {
        copyExample(dir, kTiny);
        compileLocal(dir, kTiny, "--schedule 1f1b --pp 2 --microbatches 2 --cp 2", "p.json");
      },
      "$PIPERUN p.json --backend cpu",
      "the plan was compiled with --cp 2 ($.parallel.cp), which piperun does not execute; "
      "compile it without --cp");
  add("CpNotCuttingTheSequence", withTiny,
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 2 --cp 3",
      "--cp 3 needs seq_length (16) to be a multiple of 2 x 3 (each rank holds two of its 2 x cp "
      "chunks); try --cp 2");
  add("CpWithSeqSplits", withTiny,
      "$PIPEC compile --model tiny-gpt.json --schedule seq1f1b --pp 2 --microbatches 2 "
      "--seq-splits 2 --cp 2",
      "--cp 2 and --seq-splits 2 both cut the sequence; give one of them");
  add("CpOnAnAbstractModel", withUniform,
      "$PIPEC compile --model uniform-8.json --schedule 1f1b --pp 2 --microbatches 2 --cp 2",
      "--cp 2 needs a transformer model");
  add("CpZero", withTiny,
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 2 --cp 0",
      "--cp must be at least 1");
  add("PlanCpNotCuttingTheSequence", withTiny,
      "$PIPEC plan --model tiny-gpt.json --gpus 8 --global-batch 16 --cp 1,3",
      "--cp 3 needs seq_length (16)");
  // The suggestion divides --gpus as well as the sequence (8 would, then fail on 4 GPUs).
  add("PlanCpSuggestionDividesTheGpus", withTiny,
      "$PIPEC plan --model tiny-gpt.json --gpus 4 --global-batch 16 --cp 16",
      "--cp 16 needs seq_length (16) to be a multiple of 2 x 16 (each rank holds two of its 2 x "
      "cp chunks); try --cp 4");
  add("PlanCpWithNoLayout", withTiny,
      "$PIPEC plan --model tiny-gpt.json --gpus 7 --global-batch 16 --cp 2",
      "--cp 2: no layout tp x cp x pp x dp = 7 GPUs");
  // Every reader of a plan holds it to compile's rules: validate, simulate and piperun alike.
  add("PlanFileCpNotCuttingTheSequence", planWith([](Json &j) { j["parallel"]["cp"] = 3; }),
      "$PIPEC validate p.json",
      "p.json: $.parallel.cp: cp 3 needs seq_length (16) to be a multiple of 2 x 3");
  add(
      "PlanFileCpOnAnAbstractModel",
      [](const std::string &dir) {
        withPlan(dir);
        editJson(dir + "/p.json", [](Json &j) { j["parallel"]["cp"] = 2; });
      },
      "$PIPEC simulate p.json", "p.json: $.parallel.cp: cp 2 needs a transformer model");
  add("CpWithSequenceParallelismTooFewTokens", withTiny,
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 2 --cp 8 --tp 4 "
      "--sequence-parallel",
      "--cp 8 with sequence parallelism needs each rank's 2 tokens to split into tp 4 parts; try "
      "--cp 4");
  // With cp 1 among the sizes, the nearest layout without context parallelism is named.
  add("PlanCpListWithOneNamesTheBatch", withTiny,
      "$PIPEC plan --model tiny-gpt.json --gpus 7 --global-batch 32 --pp 1 --cp 1,2",
      "--global-batch 32: no layout of 7 GPUs");
  add("PlanFileCpWithSeqSplits", planWith([](Json &j) {
        j["parallel"]["cp"] = 2;
        j["parallel"]["seq_splits"] = 2;
      }),
      "$PIPERUN p.json --backend cpu", "cp 2 with seq_splits 2: a plan cuts the sequence one way");
  add("ModelDropoutNegative",
      tinyWith([](Json &j) { j["transformer"]["attention_dropout"] = -0.1; }),
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 2",
      "$.transformer.attention_dropout: expected a probability in [0, 1), got -0.1");
  add("ClusterKeptActivationsUnknown",
      clusterWith([](Json &j) { j["kept_activations"] = "deepspeed"; }), kClusterCompile,
      "h100-2nodes.json: $.kept_activations: expected \"megatron\" or \"piperun\", got "
      "\"deepspeed\"");
  // --- Input files -------------------------------------------------------------------------
  add("ModelFileMissing", nullptr,
      "$PIPEC compile --model gone.json --schedule 1f1b --pp 2 "
      "--microbatches 2",
      "--model: gone.json: cannot read: No such file or directory");
  add("SpecFromHfMissing", nullptr, "$PIPEC spec --from-hf gone.json",
      "--from-hf: gone.json: cannot read: No such file or directory");
  add(
      "SpecFromHfMalformed", [](const std::string &dir) { spit(dir + "/config.json", "{\"a\""); },
      "$PIPEC spec --from-hf config.json", "--from-hf: config.json:1:5: malformed JSON");
  add(
      "ModelIsADirectory", [](const std::string &dir) { fs::create_directory(dir + "/m"); },
      "$PIPEC compile --model m --schedule 1f1b --pp 2 --microbatches 2",
      "--model: m: cannot read: is a directory");
  add("ModelIsDevZero", nullptr,
      "$PIPEC compile --model /dev/zero --schedule 1f1b --pp 2 "
      "--microbatches 2",
      "/dev/zero: cannot read: is a character device, not a model spec");
  add("ModelIsDevUrandom", nullptr,
      "$PIPEC compile --model /dev/urandom --schedule 1f1b --pp 2 "
      "--microbatches 2",
      "is a character device, not a model spec");
  add(
      "ModelLargerThanTheFormatNeeds",
      [](const std::string &dir) { sparse(dir + "/huge.json", off_t(300) << 20); },
      "$PIPEC compile --model huge.json --schedule 1f1b --pp 2 --microbatches 2",
      "huge.json: 300.00 MiB is more than a model spec can need (at most 256.00 MiB)");
  add(
      "ClusterLargerThanTheFormatNeeds",
      [](const std::string &dir) {
        withUniform(dir);
        sparse(dir + "/c.json", off_t(2) << 20);
      },
      "$PIPEC compile --model uniform-8.json --schedule 1f1b --pp 2 --microbatches 2 --cluster "
      "c.json",
      "c.json: 2.00 MiB is more than a cluster spec can need (at most 1.00 MiB)");
  add(
      "ModelEmpty", [](const std::string &dir) { spit(dir + "/e.json", ""); },
      "$PIPEC compile --model e.json --schedule 1f1b --pp 2 --microbatches 2", "malformed JSON");
  add(
      "ModelMalformed", [](const std::string &dir) { spit(dir + "/m.json", "{\"format\": [}"); },
      "$PIPEC compile --model m.json --schedule 1f1b --pp 2 --microbatches 2",
      "m.json:1:13: malformed JSON");
  // A key given twice: JSON parsers keep one silently; pipec names it (its path).
  add(
      "ModelKeyGivenTwice",
      [](const std::string &dir) {
        spit(dir + "/m.json", "{\"format\": \"pipemodel/1\", \"name\": \"u\", \"layers\": "
                              "[{\"forward\": 1, \"backward\": 2}, {\"forward\": 1, "
                              "\"backward\": 2, \"forward\": 3}]}");
      },
      "$PIPEC compile --model m.json --schedule 1f1b --pp 2 --microbatches 2",
      "m.json: $.layers[1].forward: given twice in one object (say it once)");
  add(
      "ClusterKeyGivenTwice",
      [](const std::string &dir) {
        withUniform(dir);
        copyExample(dir, "h100-2nodes.json");
        std::string text = slurp(dir + "/h100-2nodes.json");
        text.replace(text.rfind('}'), 1, ", \"format\": \"pipecluster/1\"}");
        spit(dir + "/c.json", text);
      },
      "$PIPEC compile --model uniform-8.json --schedule 1f1b --pp 2 --microbatches 2 --cluster "
      "c.json",
      "c.json: $.format: given twice in one object (say it once)");
  add(
      "ModelNestedTooDeep",
      [](const std::string &dir) { spit(dir + "/m.json", std::string(100, '[')); },
      "$PIPEC compile --model m.json --schedule 1f1b --pp 2 --microbatches 2",
      "JSON nested 100 levels deep");
  add("ModelUnknownField", modelWith([](Json &j) { j["pp"] = 4; }), kCompileUniform,
      "$.pp: unknown field");
  add("ModelFieldNameOf50MBShortened",
      modelWith([](Json &j) { j[std::string(50u << 20, 'k')] = 1; }), kCompileUniform,
      "more bytes]");
  add("ModelValueOf50MBShortened",
      modelWith([](Json &j) { j["format"] = std::string(50u << 20, 'v'); }), kCompileUniform,
      "$.format: expected \"pipemodel/1\", got \"vvvv");
  add(
      "ModelNumberPastADouble",
      [](const std::string &dir) {
        spit(dir + "/m.json", R"({"format": "pipemodel/1", "layers": [{"forward": 1e400,
            "backward_input": 1, "backward_weight": 1}]})");
      },
      "$PIPEC compile --model m.json --schedule 1f1b --pp 1 --microbatches 2",
      "a number is out of range");
  add("ModelLayerCountOfTenMillion", modelWith([](Json &j) { j["layers"][0]["count"] = 10000000; }),
      kCompileUniform, "$.layers[0].count: expected at most 1000000");
  add("ModelTpAllReducesPastItsBound",
      modelWith([](Json &j) { j["layers"][0]["tp_allreduces"] = 5000; }), kCompileUniform,
      "$.layers[0].tp_allreduces: expected at most 1000, got 5000");
  add("ModelWeightGradPastActivation",
      modelWith([](Json &j) { j["layers"][0]["weight_grad_bytes"] = 2097152; }), kCompileUniform,
      "weight_grad_bytes: expected at most activation_bytes");
  add("ModelBothLayersAndTransformer", tinyWith([](Json &j) { j["layers"] = Json::array(); }),
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 2",
      "expected exactly one of \"layers\" (abstract model) or \"transformer\", got both");
  add("ModelDtypeUnknown", tinyWith([](Json &j) { j["transformer"]["dtype"] = "fp8"; }),
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 2",
      "$.transformer.dtype: expected \"bf16\", \"fp16\" or \"fp32\", got \"fp8\"");
  add("ModelHeadsNotDividingHidden",
      tinyWith([](Json &j) { j["transformer"]["num_attention_heads"] = 5; }),
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 2",
      "num_attention_heads: expected a divisor of hidden_size (32), got 5");
  add("ModelVocabularyPastItsBound",
      tinyWith([](Json &j) { j["transformer"]["vocab_size"] = int64_t(1) << 28; }),
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 2",
      "$.transformer.vocab_size: expected at most 134217728");
  add("ClusterGpusPerNode2To32",
      clusterWith([](Json &j) { j["gpus_per_node"] = int64_t(1) << 32; }), kClusterCompile,
      "$.gpus_per_node: expected an integer in [1, 65536], got number 4294967296");
  add("ClusterGpusPerNode2To31",
      clusterWith([](Json &j) { j["gpus_per_node"] = int64_t(1) << 31; }), kClusterCompile,
      "$.gpus_per_node: expected an integer in [1, 65536], got number 2147483648");
  add("ClusterGpusPerNodeZero", clusterWith([](Json &j) { j["gpus_per_node"] = 0; }),
      kClusterCompile, "$.gpus_per_node: expected an integer in [1, 65536], got number 0");
  add("ClusterAchievedFractionAboveOne",
      clusterWith([](Json &j) { j["device"]["achieved_fraction"] = 2; }), kClusterCompile,
      "achieved_fraction: expected a number in (0, 1], got 2");
  // A memory rate below the other rates' floor (1e-9) would take a kernel's time past the
  // largest double: refused where it is read.
  add("ClusterMemoryRateBelowItsFloor",
      clusterWith([](Json &j) { j["device"]["memory_GBps"] = 1e-310; }), kClusterCompile,
      "h100-2nodes.json: $.device.memory_GBps: expected 0 (memory-bound kernels not timed) or a "
      "number in [1e-9, 1e15], got 1e-310");
  add("ClusterWrongFormat", clusterWith([](Json &j) { j["format"] = "pipemodel/1"; }),
      kClusterCompile, "$.format: expected \"pipecluster/1\", got \"pipemodel/1\"");
  // --- Outputs -----------------------------------------------------------------------------
  add("OutputIsTheModel", withUniform, kCompileUniform + " -o uniform-8.json",
      "-o: uniform-8.json is the --model input; give the output its own file");
  add(
      "OutputIsAHardLinkOfTheModel",
      [](const std::string &dir) {
        withUniform(dir);
        fs::create_hard_link(dir + "/uniform-8.json", dir + "/linked.json");
      },
      kCompileUniform + " -o linked.json", "-o: linked.json is the --model input");
  add(
      "OutputIsASymlinkToTheModel",
      [](const std::string &dir) {
        withUniform(dir);
        fs::create_symlink("uniform-8.json", dir + "/alias.json");
      },
      kCompileUniform + " -o alias.json", "-o: alias.json is the --model input");
  add(
      "OutputIsTheModelSpelledAnotherWay",
      [](const std::string &dir) {
        withUniform(dir);
        fs::create_directory(dir + "/sub");
      },
      kCompileUniform + " -o sub/../uniform-8.json", "is the --model input");
  add(
      "OutputIsTheCluster",
      [](const std::string &dir) {
        withUniform(dir);
        copyExample(dir, "h100-2nodes.json");
      },
      kCompileUniform + " --cluster h100-2nodes.json --trace h100-2nodes.json",
      "--trace: h100-2nodes.json is the --cluster input");
  add("OutputOntoDevNull", withUniform, kCompileUniform + " -o /dev/null",
      "-o: /dev/null: is a character device; outputs go to regular files or - (standard output)");
  add(
      "OutputIsADirectory",
      [](const std::string &dir) {
        withUniform(dir);
        fs::create_directory(dir + "/out");
      },
      kCompileUniform + " -o out", "-o: out: is a directory; give a file name");
  add("OutputInAMissingDirectory", withUniform, kCompileUniform + " -o no/such/plan.json",
      "-o: no/such/plan.json: cannot write: no directory no/such");
  add("TraceIsAlsoTheOutput", withUniform, kCompileUniform + " -o p.json --trace p.json",
      "--trace: p.json is also the -o output");
  add("BothOutputsOnStandardOutput", withUniform, kCompileUniform + " -o - --trace -",
      "--trace: - is also the -o output");
  add("ShowWithThePlanOnStandardOutput", withUniform, kCompileUniform + " -o - --show",
      "--show prints the grid to standard output, which -o - fills");
  add("SimulateTraceOntoThePlan", withPlan, "$PIPEC simulate p.json --trace p.json",
      "--trace: p.json is the plan input");
  // Every writer of every command against every input of the call (issue 44): the path, a
  // symbolic link to it, a hard link to it.
  auto withTinyPlanAndCsv = [](const std::string &dir) {
    withTinyPlan(dir);
    withTiny(dir);
    std::string cmd = "cd " + dir + " && " + runfiles() +
                      "/tools/pipec export p.json --format torch-csv -o s.csv >/dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  };
  add("ExportOntoItsPlan", withPlan, "$PIPEC export p.json --format torch-csv -o p.json",
      "-o: p.json is the plan input; give the output its own file");
  add(
      "ExportOntoASymlinkToItsPlan",
      [](const std::string &dir) {
        withPlan(dir);
        fs::create_symlink("p.json", dir + "/alias.csv");
      },
      "$PIPEC export p.json --format torch-csv -o alias.csv",
      "-o: alias.csv is the plan input (p.json)");
  add(
      "ExportOntoAHardLinkOfItsPlan",
      [](const std::string &dir) {
        withPlan(dir);
        fs::create_hard_link(dir + "/p.json", dir + "/linked.csv");
      },
      "$PIPEC export p.json --format torch-csv -o linked.csv",
      "-o: linked.csv is the plan input (p.json)");
  // A --schedule the file's layout does not take: the way out is the file's (its fix "try --vpp
  // 2, or --schedule 1f1b" led to "--vpp 2 disagrees with s.csv; try --vpp 1", and back).
  add("ImportScheduleTheFilesLayoutDoesNotTake", withTinyPlanAndCsv,
      "$PIPEC import s.csv --model tiny-gpt.json --schedule interleaved-1f1b",
      "--schedule interleaved-1f1b: interleaved-1f1b needs --vpp >= 2 (got 1) (s.csv's layout: "
      "pp 2, 1 chunk per rank, 2 microbatches, 1 sub-sequence); drop --schedule to have the "
      "order recognised");
  add("ImportOntoItsCsv", withTinyPlanAndCsv, "$PIPEC import s.csv --model tiny-gpt.json -o s.csv",
      "-o: s.csv is the schedule input");
  add("ImportOntoItsModel", withTinyPlanAndCsv,
      "$PIPEC import s.csv --model tiny-gpt.json --output tiny-gpt.json",
      "-o: tiny-gpt.json is the --model input");
  add("ImportTraceOntoItsCsv", withTinyPlanAndCsv,
      "$PIPEC import s.csv --model tiny-gpt.json --trace s.csv",
      "--trace: s.csv is the schedule input");
  add("ImportTraceOntoItsModel", withTinyPlanAndCsv,
      "$PIPEC import s.csv --model tiny-gpt.json --trace tiny-gpt.json",
      "--trace: tiny-gpt.json is the --model input");
  add("ShowSvgOntoItsPlan", withPlan, "$PIPEC show p.json --svg p.json",
      "--svg: p.json is the plan input");
  add("CompileSvgOntoItsModel", withUniform, kCompileUniform + " --svg uniform-8.json",
      "--svg: uniform-8.json is the --model input");
  add("PlanOutputOntoItsModel", withTiny,
      "$PIPEC plan --model tiny-gpt.json --gpus 2 --global-batch 4 -o tiny-gpt.json",
      "-o: tiny-gpt.json is the --model input");
  add(
      "PlanCsvOntoItsCluster",
      [](const std::string &dir) {
        withTiny(dir);
        copyExample(dir, "h100-2nodes.json");
      },
      "$PIPEC plan --model tiny-gpt.json --gpus 2 --global-batch 4 --cluster h100-2nodes.json "
      "--csv h100-2nodes.json",
      "--csv: h100-2nodes.json is the --cluster input");
  add("CompileSummaryOntoAFullDisk", withUniform, kCompileUniform,
      "standard output: cannot write: No space left on device", Stdout::Full);
  add("CompilePlanOntoAFullDisk", withUniform, kCompileUniform + " -o -",
      "-o: standard output: cannot write: No space left on device", Stdout::Full);
  add("ShowOntoAFullDisk", withPlan, "$PIPEC show p.json",
      "standard output: cannot write: No space left on device", Stdout::Full);
  add("ListSchedulesOntoAFullDisk", nullptr, "$PIPEC list-schedules",
      "standard output: cannot write: No space left on device", Stdout::Full);
  add("ShowIntoAClosedPipe", withPlan, "$PIPEC show p.json",
      "standard output: cannot write: Broken pipe", Stdout::ClosedPipe);
  add("CompileIntoAClosedPipe", withUniform, kCompileUniform + " -o -",
      "standard output: cannot write: Broken pipe", Stdout::ClosedPipe);
  add("PiperunLossesOntoAFullDisk", withTinyPlan, "$PIPERUN p.json --steps 2",
      "standard output: cannot write: No space left on device", Stdout::Full);
  add("PiperunLossesIntoAClosedPipe", withTinyPlan, "$PIPERUN p.json --steps 2",
      "standard output: cannot write: Broken pipe", Stdout::ClosedPipe);
  // --- Plans -------------------------------------------------------------------------------
  add("PlanIsDevZero", nullptr, "$PIPEC validate /dev/zero",
      "/dev/zero: cannot read: is a character device, not a plan");
  add(
      "PlanIsADirectory", [](const std::string &dir) { fs::create_directory(dir + "/p"); },
      "$PIPEC validate p", "p: cannot read: is a directory");
  add(
      "PlanLargerThanTheFormatNeeds",
      [](const std::string &dir) { sparse(dir + "/p.json", off_t(5) << 30); },
      "$PIPEC validate p.json", "p.json: 5.00 GiB is more than a plan can need (at most 4.00 GiB)");
  add("PiperunPlanIsDevZero", nullptr, "$PIPERUN /dev/zero",
      "/dev/zero: cannot read: is a character device, not a plan");
  add("PlanSeqSlicesPastTheSequence", planWith([](Json &j) { j["seq_slices"][0][1] = 32; }),
      "$PIPEC validate p.json",
      "$.seq_slices[0]: expected [0, end) with 0 < end <= seq_length 16, got an array");
  add("PlanSeqSlicesShortOfTheSequence", planWith([](Json &j) { j["seq_slices"][0][1] = 8; }),
      "$PIPEC validate p.json",
      "$.seq_slices[0]: expected a last slice ending at the model's seq_length 16");
  add("PlanTopologyGpusPerNode2To32",
      planWith([](Json &j) { j["topology"]["gpus_per_node"] = int64_t(1) << 32; }),
      "$PIPEC validate p.json", "$.topology.gpus_per_node: expected an integer in [1, 65536]");
  // The rank order is derived from the parallel sizes: another one is refused, not ignored.
  add("PlanTopologyOrderNotPipecs", planWith([](Json &j) { j["topology"]["order"] = "pp-dp-tp"; }),
      "$PIPERUN p.json",
      "$.topology.order: expected \"tp-dp-pp\" (pipec's rank order for this plan's $.parallel), "
      "got string \"pp-dp-tp\"");
  add("PlanTopologyUnknownField", planWith([](Json &j) { j["topology"]["ordr"] = "tp-dp-pp"; }),
      "$PIPEC validate p.json",
      "$.topology.ordr: unknown field (valid fields: order, gpus_per_node)");
  add("PlanStageLayersPastAnyModel",
      planWith([](Json &j) { j["stages"][1]["layers"][1] = int64_t(1) << 40; }),
      "$PIPEC validate p.json", "$.stages[1].layers: expected [first, end) with 0 <= first < end");
  add("PlanPp2To31", planWith([](Json &j) { j["parallel"]["pp"] = int64_t(1) << 31; }),
      "$PIPEC validate p.json", "$.parallel.pp: expected an integer below 2^31");
  add("PlanFieldNameOf50MBShortened", planWith([](Json &j) { j[std::string(50u << 20, 'x')] = 0; }),
      "$PIPEC validate p.json", "more bytes]");
  // Names are printed in summaries, grids and the text form: a newline in one made `show
  // --text` output that `import` refused.
  add("ModelNameWithANewline", modelWith([](Json &j) { j["name"] = "a\nb"; }), kCompileUniform,
      "$.name: expected a name without control characters");
  add("PlanScheduleWithAnEscape", planWith([](Json &j) { j["schedule"] = "1f1b\x1b[2J"; }),
      "$PIPEC validate p.json", "$.schedule: expected a name without control characters");
  add("PlanWrongFormat", planWith([](Json &j) { j["format"] = "pipeplan/9"; }),
      "$PIPEC validate p.json", "$.format: expected \"pipeplan/1\", got \"pipeplan/9\"");
  // --- piperun -----------------------------------------------------------------------------
  // An empty path is named as one (it read ": cannot read: No such file or directory").
  // Another of pipec's files given to the wrong flag is named by its format, not by the
  // first field the expected format lacks.
  add(
      "ClusterSpecGivenAsTheModel",
      [](const std::string &dir) { copyExample(dir, "h100-2nodes.json"); },
      "$PIPEC compile --model h100-2nodes.json --schedule 1f1b --pp 2 --microbatches 2",
      "--model: h100-2nodes.json: $.format: expected \"pipemodel/1\", got \"pipecluster/1\" (a "
      "cluster spec)");
  add(
      "PlanGivenAsTheCosts",
      [](const std::string &dir) {
        withTinyPlan(dir);
        withTiny(dir);
      },
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 2 --costs p.json",
      "--costs: p.json: $.format: expected \"pipecost/1\", got \"pipeplan/1\" (a plan)");
  // A control character from an input is escaped in the message: a NUL cut the line there (no
  // closing quote, no newline), an ESC drove the terminal.
  add(
      "ImportCellWithANulAndAnEscape",
      [](const std::string &dir) {
        withUniform(dir);
        static constexpr char kCells[] = "0F0,0B0\0x\x1b[31m\n";
        spit(dir + "/s.csv", std::string(kCells, sizeof kCells - 1));
      },
      "$PIPEC import s.csv --model uniform-8.json",
      "s.csv: row 1 (rank 0), column 2: '0B0\\x00x\\x1b[31m' is not a PyTorch action");
  // Accepted silently before (a helper's sweep): a typo'd list, a fractional byte count, an
  // argument to a command that takes none, a data type with no data.
  add("PlanTpListWithAnEmptyEntry", withTiny,
      "$PIPEC plan --model tiny-gpt.json --gpus 8 --global-batch 8 --tp 2,,4",
      "--tp expects a comma-separated list of positive integers such as 1,2,4 (got '2,,4')");
  add("PlanSchedulesWithAnEmptyEntry", withTiny,
      "$PIPEC plan --model tiny-gpt.json --gpus 8 --global-batch 8 --schedules 1f1b,",
      "--schedules: an empty entry in '1f1b,'");
  add("MemoryLimitAFractionOfAByte", withUniform, kCompileUniform + " --memory-limit 1.5",
      "--memory-limit expects a positive byte count such as 85899345920 or 80GiB (got '1.5')");
  add("ListSchedulesWithAnArgument", nullptr, "$PIPEC list-schedules x",
      "list-schedules: unexpected argument 'x'");
  add("DataDtypeWithoutData", withTinyPlan, "$PIPERUN p.json --data-dtype uint32",
      "--data-dtype needs --data");
  // A resumed job trains fewer steps than --steps: its costs file held no samples (exit 0),
  // which --costs then refused.
  add("ProfileOfAResumeWithOneStepToTrain", withCheckpoint,
      "$PIPERUN p.json --steps 2 --resume ck --profile c.json",
      "--profile needs 2 or more steps to train, and ck/step-00000001 is at step 1 of --steps 2");
  add("ModelPathEmpty", nullptr,
      "$PIPEC compile --model \"\" --schedule 1f1b --pp 2 --microbatches 2",
      "--model: expected the path of a model spec, got an empty one");
  add("CostsPathEmpty", withTiny,
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 2 --costs \"\"",
      "--costs: expected the path of");
  // An empty --export-hf skipped the export (exit 0) and an empty --resume started afresh.
  add("ExportHfEmpty", withTinyPlan, "$PIPERUN p.json --steps 2 --export-hf \"\"",
      "--export-hf: expected a path, got an empty one");
  // A full disk (a file size limit of 100 blocks) while the export is written: named as a
  // checkpoint's is, with the space it needs, and nothing of it left.
  add("ExportHfFullDisk", withTinyPlan, "ulimit -f 100; $PIPERUN p.json --steps 1 --export-hf hf",
      "cannot write: File too large; the export needs about 217.07 KiB beside hf: free that much");
  add(
      "ExportHfThroughALink",
      [](const std::string &dir) {
        withTinyPlan(dir);
        fs::create_directory(dir + "/real");
        fs::create_directory_symlink("real", dir + "/hf");
      },
      "$PIPERUN p.json --steps 1 --export-hf hf",
      "--export-hf: hf is a symbolic link; give the directory itself");
  add("ResumeEmpty", withTinyPlan, "$PIPERUN p.json --steps 2 --resume \"\"",
      "--resume: expected a path, got an empty one");
  // A pipe in a model directory: its open waited for a writer forever.
  add(
      "InitFromADirectoryWhoseConfigIsAPipe",
      [](const std::string &dir) {
        withHfExport(dir);
        fs::remove(dir + "/hf/config.json");
        ASSERT_EQ(::mkfifo((dir + "/hf/config.json").c_str(), 0644), 0);
      },
      "$PIPERUN p.json --steps 1 --init-from hf",
      "hf/config.json: is a pipe, not a file of a model directory");
  add("PiperunPlanPathEmpty", nullptr, "$PIPERUN \"\"",
      "expected the path of a plan, got an empty one");
  add("DataIsDevZero", withTinyPlan, "$PIPERUN p.json --data /dev/zero",
      "--data: /dev/zero: cannot read: is a character device, not a token file");
  add(
      "DataIsADirectory",
      [](const std::string &dir) {
        withTinyPlan(dir);
        fs::create_directory(dir + "/d");
      },
      "$PIPERUN p.json --data d", "--data: d: cannot read: is a directory");
  add(
      "DataOfAnOddByteCount",
      [](const std::string &dir) {
        withTinyPlan(dir);
        spit(dir + "/t.bin", std::string(101, '\1'));
      },
      "$PIPERUN p.json --data t.bin", "101 bytes is not a whole number of uint16 ids");
  add(
      "DataTokenPastTheVocabulary",
      [](const std::string &dir) {
        withTinyPlan(dir);
        spit(dir + "/t.bin", std::string(200, '\x7f'));
      },
      "$PIPERUN p.json --data t.bin", "is outside the model's vocab_size 64");
  add("StepsZero", withTinyPlan, "$PIPERUN p.json --steps 0", "--steps must be at least 1");
  add("UnknownBackend", withTinyPlan, "$PIPERUN p.json --backend tpu",
      "--backend: unknown backend 'tpu' (known: cpu, cuda, nccl); try cpu");
  add("CpuBackendInBf16", withTinyPlan, "$PIPERUN p.json --dtype bf16",
      "--dtype bf16: the cpu backend computes in fp32 only");
  add("LearningRateNegative", withTinyPlan, "$PIPERUN p.json --lr -1",
      "--lr expects a positive number");
  add("AbstractModelOnTheCpuBackend", withPlan, "$PIPERUN p.json",
      "is an abstract layer list; the cpu backend runs transformer models");
  // --- Checkpoints -------------------------------------------------------------------------
  add("SaveEveryWithoutSaveDir", withTinyPlan, "$PIPERUN p.json --save-every 2",
      "--save-every needs --save-dir");
  add(
      "SaveDirIsAFile",
      [](const std::string &dir) {
        withTinyPlan(dir);
        spit(dir + "/ck", "x");
      },
      "$PIPERUN p.json --save-dir ck", "--save-dir: ck: is a file, not a directory");
  // Found before step 0, not at the first save after hours of training.
  add(
      "SaveDirIsALinkToNothing",
      [](const std::string &dir) {
        withTinyPlan(dir);
        fs::create_symlink("gone", dir + "/ck");
      },
      "$PIPERUN p.json --steps 2 --save-dir ck",
      "--save-dir: ck is a symbolic link to nothing; give a directory, or a new name in one");
  add("SaveDirHoldingCheckpointsNotResumed", withCheckpoint, "$PIPERUN p.json --save-dir ck",
      "--save-dir: ck already holds checkpoints (step 1)");
  // (--resume on a missing or empty directory starts at step 0: CheckpointTest.)
  add(
      "ResumeAnotherModel",
      [](const std::string &dir) {
        withCheckpoint(dir);
        copyExample(dir, kTiny);
        editJson(dir + "/" + kTiny, [](Json &j) { j["transformer"]["hidden_size"] = 64; });
        compileLocal(dir, "tiny-gpt.json", "--schedule 1f1b --pp 2 --microbatches 2", "wide.json");
      },
      "$PIPERUN wide.json --resume ck",
      "is of another model: its hidden_size is 32, the plan's is 64");
  add(
      "ResumeAnotherGlobalBatch",
      [](const std::string &dir) {
        withCheckpoint(dir);
        compileInto(dir, kTiny, "--schedule 1f1b --pp 2 --microbatches 4", "four.json");
      },
      "$PIPERUN four.json --resume ck",
      "was saved with 2 microbatches a step (dp 1 x microbatches 2), this plan takes 4");
  add("ResumeWithAnotherSeed", withCheckpoint, "$PIPERUN p.json --resume ck --seed 7",
      "was saved by a run with --seed 1, not 7");
  add(
      "ResumeADamagedLayerFile",
      [](const std::string &dir) {
        withCheckpoint(dir);
        std::string layer = dir + "/ck/step-00000001/layer-00002.bin";
        std::fstream f(layer, std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(100);
        f.put('\x55');
      },
      "$PIPERUN p.json --resume ck --steps 2", "layer-00002.bin: its digest is");
  add(
      "ResumeAManifestOfAnotherFormat",
      [](const std::string &dir) {
        withCheckpoint(dir);
        editJson(dir + "/ck/step-00000001/manifest.json",
                 [](Json &j) { j["format"] = "pipeckpt/0"; });
      },
      "$PIPERUN p.json --resume ck", "$.format: expected \"pipeckpt/1\", got \"pipeckpt/0\"");
  // (Without a GPU or a CUDA build the backend itself is refused first, with the same advice.)
  add("ResumeOnTheCudaBackend", withCheckpoint, "$PIPERUN p.json --backend cuda --resume ck",
      "use --backend cpu");
  // --- Attacks on the checkpoint directory (issue 44): nothing outside it is read or deleted,
  // nothing inside it that piperun did not write. The case directory holds `outside` too, so the
  // snapshot sees whether a file there was read through or emptied.
  auto withOutside = [](const std::string &dir) {
    fs::create_directories(dir + "/outside");
    spit(dir + "/outside/secret.txt", "x\n");
  };
  add(
      "SaveDirStepThatIsALinkOutside",
      [=](const std::string &dir) {
        withTinyPlan(dir);
        withOutside(dir);
        fs::create_directories(dir + "/D");
        fs::create_directory_symlink("../outside", dir + "/D/step-00000000");
      },
      "$PIPERUN p.json --backend cpu --steps 2 --save-dir D --save-every 1",
      "--save-dir: D/step-00000000 is a symbolic link; piperun reads and deletes only the "
      "checkpoints it wrote there");
  add(
      "SaveDirStepOfTheUsersOwnFiles",
      [](const std::string &dir) {
        withTinyPlan(dir);
        fs::create_directories(dir + "/D/step-00000099");
        spit(dir + "/D/step-00000099/important.txt", "mine\n");
      },
      "$PIPERUN p.json --steps 2 --save-dir D --save-every 1",
      "--save-dir: D/step-00000099 is a directory of files piperun did not write");
  add(
      "ResumeAndSaveBesideALinkedOlderStep",
      [=](const std::string &dir) {
        withCheckpoint(dir);
        withOutside(dir);
        fs::create_directory_symlink("../outside", dir + "/ck/step-00000000");
      },
      "$PIPERUN p.json --steps 3 --save-every 1 --resume ck --save-dir ck",
      "--save-dir: ck/step-00000000 is a symbolic link");
  add(
      "ResumeThroughALinkedStepDirectory",
      [=](const std::string &dir) {
        withCheckpoint(dir);
        fs::rename(dir + "/ck/step-00000001", dir + "/elsewhere");
        fs::create_directory_symlink("../elsewhere", dir + "/ck/step-00000001");
      },
      "$PIPERUN p.json --steps 1 --resume ck",
      "--resume: ck/step-00000001 is a symbolic link; piperun reads only the checkpoint "
      "directories it wrote inside ck");
  add(
      "ResumeAManifestLinkedToEtcPasswd",
      [](const std::string &dir) {
        withCheckpoint(dir);
        fs::remove(dir + "/ck/step-00000001/manifest.json");
        fs::create_symlink("/etc/passwd", dir + "/ck/step-00000001/manifest.json");
      },
      "$PIPERUN p.json --steps 1 --resume ck",
      "--resume: ck/step-00000001/manifest.json: is a symbolic link");
  add(
      "ResumeALayerFileLinkedOutside",
      [=](const std::string &dir) {
        withCheckpoint(dir);
        withOutside(dir);
        fs::rename(dir + "/ck/step-00000001/layer-00002.bin", dir + "/outside/layer.bin");
        fs::create_symlink("../../outside/layer.bin", dir + "/ck/step-00000001/layer-00002.bin");
      },
      // --steps 2: a step to train, so the layers are read (at step 1 there is nothing to do).
      "$PIPERUN p.json --steps 2 --resume ck",
      "ck/step-00000001/layer-00002.bin: is a symbolic link");
  // piperun's --profile against every file it reads and every directory it reads or writes,
  // and --save-dir against --export-hf: each checked before anything is read or trained (a
  // costs file written at the end used to overwrite the token data, the weights or a
  // checkpoint's manifest, exit 0; onto --save-dir's name it failed after the save).
  add(
      "ProfileOntoItsTokenData",
      [](const std::string &dir) {
        withTinyPlan(dir);
        spit(dir + "/t.bin", std::string(400, '\0'));
      },
      "$PIPERUN p.json --steps 3 --data t.bin --profile t.bin",
      "--profile: t.bin is the --data input; give the output its own file");
  add("ProfileOntoTheWeightsItStartsFrom", withHfExport,
      "$PIPERUN p.json --steps 3 --init-from hf/model.safetensors --profile "
      "hf/model.safetensors",
      "--profile: hf/model.safetensors is the --init-from input");
  add("ProfileIntoTheModelDirectoryItStartsFrom", withHfExport,
      "$PIPERUN p.json --steps 3 --init-from hf --profile hf/config.json",
      "--profile: hf/config.json is inside the --init-from directory hf");
  add("ProfileOntoTheManifestItResumes", withCheckpoint,
      "$PIPERUN p.json --steps 3 --resume ck --profile ck/step-00000001/manifest.json",
      "--profile: ck/step-00000001/manifest.json is inside the --resume directory ck");
  add(
      "ProfileIntoTheSaveDirectory",
      [](const std::string &dir) {
        withTinyPlan(dir);
        fs::create_directory(dir + "/ck");
      },
      "$PIPERUN p.json --steps 3 --save-dir ck --profile ck/costs.json",
      "--profile: ck/costs.json is inside the --save-dir directory ck");
  add("ProfileOnTheSaveDirectorysName", withTinyPlan,
      "$PIPERUN p.json --steps 3 --save-dir c.json --profile c.json",
      "--profile: c.json is the --save-dir directory; give it a path of its own");
  add("ProfileOnTheExportsName", withTinyPlan,
      "$PIPERUN p.json --steps 3 --export-hf c.json --profile c.json",
      "--profile: c.json is the --export-hf directory");
  add("ExportOntoTheSaveDirectory", withTinyPlan,
      "$PIPERUN p.json --steps 2 --save-dir ck --export-hf ck",
      "--export-hf: ck is the --save-dir directory");
  add("ExportIntoTheSaveDirectory", withCheckpoint,
      "$PIPERUN p.json --steps 2 --resume ck --save-dir ck --export-hf ck/hf",
      "--export-hf: ck/hf is inside the --save-dir directory ck");
  add(
      "SaveDirectoryInsideTheExport",
      [](const std::string &dir) {
        withTinyPlan(dir);
        fs::create_directory(dir + "/e");
      },
      "$PIPERUN p.json --steps 2 --save-dir e/ck --export-hf e",
      "--save-dir: e/ck is inside the --export-hf directory e");
  add(
      "ResumeAManifestThatIsAFifo",
      [](const std::string &dir) {
        withCheckpoint(dir);
        fs::remove(dir + "/ck/step-00000001/manifest.json");
        ASSERT_EQ(::mkfifo((dir + "/ck/step-00000001/manifest.json").c_str(), 0644), 0);
      },
      "$PIPERUN p.json --steps 1 --resume ck",
      "--resume: ck/step-00000001/manifest.json: is a pipe, not an input");
  add(
      "ResumeAdamStepsPastAnInt",
      [](const std::string &dir) {
        withCheckpoint(dir);
        editJson(dir + "/ck/step-00000001/manifest.json",
                 [](Json &j) { j["adam_steps"] = 2147483647; });
      },
      "$PIPERUN p.json --steps 1 --resume ck",
      "$.adam_steps: expected an integer in [0, 99999999], got number 2147483647");
  add(
      "ResumeAStepPastTheNamesOfStepDirectories",
      [](const std::string &dir) {
        withCheckpoint(dir);
        editJson(dir + "/ck/step-00000001/manifest.json", [](Json &j) { j["step"] = 100000000; });
      },
      "$PIPERUN p.json --steps 1 --resume ck",
      "$.step: expected an integer in [1, 99999999], got number 100000000");
  add(
      "PlanFollowedByANulByteAndGarbage",
      [](const std::string &dir) {
        withTinyPlan(dir);
        std::ofstream(dir + "/p.json", std::ios::binary | std::ios::app)
            << std::string("\0junk", 5);
      },
      "$PIPEC validate p.json", "p.json:");
  add(
      "ModelFollowedByANulByteAndGarbage",
      [](const std::string &dir) {
        withTiny(dir);
        std::ofstream(dir + "/" + kTiny, std::ios::binary | std::ios::app)
            << std::string("\0junk", 5);
      },
      "$PIPEC compile --model tiny-gpt.json --schedule 1f1b --pp 2 --microbatches 2",
      "malformed JSON (unexpected character)");
  // --- Llama-style blocks ------------------------------------------------------------------
  auto llamaWith = [](std::function<void(Json &)> edit) {
    return [edit](const std::string &dir) {
      copyExample(dir, "llama3-8b.json");
      editJson(dir + "/llama3-8b.json", edit);
    };
  };
  const std::string llamaCompile =
      "$PIPEC compile --model llama3-8b.json --schedule 1f1b --pp 4 --microbatches 8";
  add("QueryGroupsNotDividingTheHeads",
      llamaWith([](Json &j) { j["transformer"]["num_query_groups"] = 5; }), llamaCompile,
      "$.transformer.num_query_groups: expected a divisor of num_attention_heads (32), got 5");
  add("TpNotDividingTheQueryGroups", llamaWith([](Json &) {}), llamaCompile + " --tp 16",
      "--tp 16 must divide num_query_groups (8): each tp rank holds whole key/value groups; try "
      "--tp 8");
  add("UnknownNorm", llamaWith([](Json &j) { j["transformer"]["norm"] = "batchnorm"; }),
      llamaCompile,
      "$.transformer.norm: expected \"layernorm\" or \"rmsnorm\", got "
      "\"batchnorm\"");
  add("UnknownMlp", llamaWith([](Json &j) { j["transformer"]["mlp"] = "relu"; }), llamaCompile,
      "$.transformer.mlp: expected \"gelu\" or \"swiglu\", got \"relu\"");
  add("RopeThetaWithLearnedPositions",
      llamaWith([](Json &j) { j["transformer"]["position"] = "learned"; }), llamaCompile,
      "$.transformer.rope_theta: applies to \"position\": \"rope\" only");
  add(
      "RopeWithAnOddHeadSize",
      [](const std::string &dir) {
        // hidden 24 in 8 heads of 3: pipec compiles it (its costs do not care); piperun's
        // rotary embeddings turn pairs of channels.
        spit(dir + "/odd.json",
             R"({"format": "pipemodel/1", "name": "odd", "transformer": {"num_layers": 2,
                "hidden_size": 24, "num_attention_heads": 8, "ffn_hidden_size": 48,
                "vocab_size": 64, "seq_length": 16, "dtype": "fp32", "position": "rope"}})");
        compileLocal(dir, "odd.json", "--schedule 1f1b --pp 2 --microbatches 2", "p.json");
      },
      "$PIPERUN p.json --backend cpu",
      "the head size (hidden_size / num_attention_heads = 3) must be even; give the model 6 "
      "heads, or learned positions");
  add("NormEpsTooLarge", llamaWith([](Json &j) { j["transformer"]["norm_eps"] = 0.5; }),
      llamaCompile, "$.transformer.norm_eps: expected at most 0.1");
  add("BiasNotABoolean", llamaWith([](Json &j) { j["transformer"]["bias"] = "no"; }), llamaCompile,
      "$.transformer.bias");
  add(
      "TpNotDividingTheQueryGroupsOfAHandEditedPlan",
      [](const std::string &dir) {
        // A plan compiled with --tp 2, its model edited to one key/value group: the compiler
        // would refuse --tp 2; piperun must too, before any thread starts.
        spit(dir + "/tiny-llama.json",
             R"({"format": "pipemodel/1", "name": "tiny-llama", "transformer": {"num_layers": 2,
                "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                "ffn_hidden_size": 64, "vocab_size": 64, "seq_length": 16, "dtype": "fp32",
                "norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "bias": false}})");
        compileLocal(dir, "tiny-llama.json", "--schedule 1f1b --pp 2 --tp 2 --microbatches 2",
                     "p.json");
        editJson(dir + "/p.json", [](Json &j) { j["transformer"]["num_query_groups"] = 1; });
      },
      "$PIPERUN p.json --backend cpu",
      "--tp 2 must divide num_query_groups (1): each tp rank holds whole key/value heads; "
      "compile the plan with --tp 1");
  return c;
}

class BadInput : public ::testing::TestWithParam<Case> {};

TEST_P(BadInput, IsExitTwoWithOneLineNamingItAndLeavesNoFile) {
  const Case &k = GetParam();
  const std::string dir = tmpDir() + "/case-" + k.name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  if (k.setup)
    k.setup(dir);
  const auto before = snapshot(dir);
  Outcome o = runIn(dir, k.command, k.out);
  EXPECT_EQ(o.code, 2) << k.command << "\n" << o.err;
  EXPECT_EQ(lines(o.err), 1u) << o.err.substr(0, 2000);
  EXPECT_EQ(o.err.back(), '\n');
  EXPECT_NE(o.err.find(k.needle), std::string::npos)
      << "wanted: " << k.needle << "\ngot: " << o.err.substr(0, 2000);
  EXPECT_LT(o.err.size(), 4200u) << "the line is not shortened";
  EXPECT_EQ(snapshot(dir), before) << "the directory changed: a file was left, lost or altered";
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Catalogue, BadInput, ::testing::ValuesIn(catalogue()),
                         [](const ::testing::TestParamInfo<Case> &info) {
                           return info.param.name;
                         });

TEST(BadInputCatalogue, HoldsAtLeastSixtyCases) { EXPECT_GE(catalogue().size(), 60u); }

TEST(Usage, WithoutArgumentsGoesToStandardOutput) {
  const std::string dir = tmpDir() + "/usage";
  fs::create_directories(dir);
  Outcome o = runIn(dir, "$PIPEC", Stdout::File);
  EXPECT_EQ(o.code, 2);
  EXPECT_NE(o.out.find("usage: pipec <command>"), std::string::npos) << o.out;
  o = runIn(dir, "$PIPERUN", Stdout::File);
  EXPECT_EQ(o.code, 2);
  EXPECT_NE(o.out.find("usage: piperun plan.json"), std::string::npos) << o.out;
}

// piperun answers --help or -h wherever it stands, as pipec's commands do, even among flags it
// would refuse: the usage, exit 0, nothing on standard error.
TEST(Usage, PiperunAnswersHelpAnywhere) {
  const std::string dir = tmpDir() + "/usage-piperun";
  fs::create_directories(dir);
  for (const char *line : {"$PIPERUN --help", "$PIPERUN -h", "$PIPERUN p.json --help",
                           "$PIPERUN p.json --steps 3 -h", "$PIPERUN --bogus 1 --help"}) {
    SCOPED_TRACE(line);
    Outcome o = runIn(dir, line, Stdout::File);
    EXPECT_EQ(o.code, 0) << o.err;
    EXPECT_EQ(o.err, "");
    EXPECT_EQ(o.out.rfind("usage: piperun plan.json", 0), 0u) << o.out;
  }
}

TEST(Outputs, StandardOutputTakesThePlanAlone) {
  const std::string dir = tmpDir() + "/stdout-plan";
  fs::create_directories(dir);
  withUniform(dir);
  Outcome o = runIn(dir, kCompileUniform + " -o -", Stdout::File);
  ASSERT_EQ(o.code, 0) << o.err;
  Json plan = Json::parse(o.out); // nothing but the plan: no summary mixed in
  EXPECT_EQ(plan["format"], "pipeplan/1");
}

// Every command that writes a file to standard output (-) writes it alone there: no summary,
// header or "wrote -" line around it (export's CSV did not import back, show's SVG was not XML).
TEST(Outputs, StandardOutputTakesEachCommandsFileAlone) {
  const std::string dir = tmpDir() + "/stdout-alone";
  fs::create_directories(dir);
  withUniform(dir);
  withTiny(dir);
  ASSERT_EQ(runIn(dir, kCompileUniform + " --quiet -o p.json", Stdout::File).code, 0);
  ASSERT_EQ(runIn(dir, "$PIPEC export p.json --format torch-csv -o s.csv", Stdout::File).code, 0);
  const std::string plan = "$PIPEC plan --model tiny-gpt.json --gpus 2 --global-batch 8 ";
  for (auto [command, first, last] : {
           std::tuple{std::string("$PIPEC export p.json --format torch-csv -o -"), "0F0", "\n"},
           std::tuple{std::string("$PIPEC show p.json --svg -"), "<?xml", "</svg>\n"},
           std::tuple{kCompileUniform + " --svg -", "<?xml", "</svg>\n"},
           std::tuple{std::string("$PIPEC import s.csv --model uniform-8.json -o -"), "{", "}\n"},
           std::tuple{std::string("$PIPEC import s.csv --model uniform-8.json --trace -"), "{",
                      "}\n"},
           std::tuple{plan + "-o -", "{", "}\n"},
           std::tuple{plan + "--csv -", "recompute,tp,pp,", "\n"},
       }) {
    SCOPED_TRACE(command);
    Outcome o = runIn(dir, command, Stdout::File);
    ASSERT_EQ(o.code, 0) << o.err;
    EXPECT_EQ(o.out.rfind(first, 0), 0u) << o.out.substr(0, 200);
    ASSERT_GE(o.out.size(), std::string(last).size());
    EXPECT_EQ(o.out.substr(o.out.size() - std::string(last).size()), last);
    EXPECT_EQ(o.out.find("wrote "), std::string::npos) << o.out.substr(o.out.size() - 200);
  }
  // The exported CSV on standard output imports back.
  ASSERT_EQ(
      runIn(dir, "$PIPEC export p.json --format torch-csv -o - > again.csv", Stdout::File).code, 0);
  Outcome back = runIn(dir, "$PIPEC import again.csv --model uniform-8.json --quiet", Stdout::File);
  EXPECT_EQ(back.code, 0) << back.err;
}

TEST(Outputs, ARegularFileIsReplacedWholeAndTheModelIsUntouched) {
  const std::string dir = tmpDir() + "/replace";
  fs::create_directories(dir);
  withUniform(dir);
  spit(dir + "/p.json", "old");
  const std::string model = slurp(dir + "/uniform-8.json");
  Outcome o = runIn(dir, kCompileUniform + " -o p.json", Stdout::File);
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_EQ(Json::parse(slurp(dir + "/p.json"))["format"], "pipeplan/1");
  EXPECT_EQ(slurp(dir + "/uniform-8.json"), model);
}

} // namespace
