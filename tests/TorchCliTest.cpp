//===- TorchCliTest.cpp - pipec export / import end to end ---------------===//
//
// The real binary: exit codes, one-line errors naming the flag or the cell, no output file
// unless everything passed, and export-then-import giving compile's file byte for byte.
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <sys/stat.h>

namespace {

using pipec::testing::slurp;
using pipec::testing::tmpDir;
using Result = pipec::testing::CommandResult;

Result pipec(const std::string &args) { return pipec::testing::runCommand("tools/pipec " + args); }

bool exists(const std::string &path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

size_t lines(const std::string &s) {
  size_t n = 0;
  for (char c : s)
    n += c == '\n';
  return n;
}

std::string compiled(const std::string &name, const std::string &flags) {
  std::string path = tmpDir() + "/" + name + ".json";
  Result r = pipec("compile --model examples/uniform-8.json " + flags + " -o " + path + " --quiet");
  EXPECT_EQ(r.code, 0) << r.err;
  return path;
}

std::string written(const std::string &name, const std::string &text) {
  std::string path = tmpDir() + "/" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

/// Exit `code`; for 2, one line on stderr; `needle` in it; nothing at `out`.
void expectError(const std::string &args, int code, const std::string &needle,
                 const std::string &out) {
  std::remove(out.c_str());
  Result r = pipec(args + " -o " + out);
  EXPECT_EQ(r.code, code) << args << "\n" << r.err;
  if (code == 2) {
    EXPECT_EQ(lines(r.err), 1u) << r.err;
  }
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_FALSE(exists(out)) << "wrote " << out << " although the command failed";
}

TEST(TorchCli, ExportThenImportGivesCompilesFileByteForByte) {
  std::string plan = compiled("dualpipe", "--schedule dualpipe-v --pp 2 --vpp 2 --microbatches 6");
  for (const char *form : {"torch-csv", "torch-csv-comms"}) {
    std::string csv = tmpDir() + "/sched-" + form + ".csv";
    Result e = pipec("export " + plan + " --format " + form + " -o " + csv);
    ASSERT_EQ(e.code, 0) << e.err;
    EXPECT_NE(e.out.find("wrote " + csv), std::string::npos) << e.out;
    std::string back = tmpDir() + "/back.json";
    Result i = pipec("import " + csv + " --model examples/uniform-8.json -o " + back);
    ASSERT_EQ(i.code, 0) << i.err;
    EXPECT_NE(i.out.find("the order is pipec's dualpipe-v"), std::string::npos) << i.out;
    EXPECT_NE(i.out.find("verified: dependencies hold, FIFO-matched, deadlock-free"),
              std::string::npos)
        << i.out;
    EXPECT_EQ(slurp(back), slurp(plan)) << form;
  }
}

TEST(TorchCli, ExportWithoutOutputWritesTheCsvToStdout) {
  std::string plan = compiled("f1b", "--schedule 1f1b --pp 2 --microbatches 2");
  Result r = pipec("export " + plan + " --format torch-csv");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "0F0,0F1,0B0,0B1\r\n1F0,1B0,1F1,1B1\r\n");
}

TEST(TorchCli, ExportRefusalsAreOneLineNamingTheFlag) {
  std::string out = tmpDir() + "/refused.csv";
  std::string plan = compiled("f1b", "--schedule 1f1b --pp 2 --microbatches 2");
  expectError("export " + plan + " --format torch", 2, "--format: unknown format 'torch'", out);
  expectError("export " + plan, 2, "missing --format", out);
  std::string seq = compiled("seq", "--schedule seq1f1b --pp 2 --microbatches 2 --seq-splits 2");
  expectError("export " + seq + " --format torch-csv", 2, "compile with --seq-splits 1", out);
  std::string tp = tmpDir() + "/tp.json";
  ASSERT_EQ(pipec("compile --model examples/tiny-gpt.json --schedule 1f1b --pp 2 --tp 2 "
                  "--microbatches 2 --quiet -o " +
                  tp)
                .code,
            0);
  expectError("export " + tp + " --format torch-csv-comms", 2, "compile with --tp 1", out);
}

TEST(TorchCli, ExportOfAWrongPlanIsTheVerifiersFinding) {
  std::string plan = compiled("f1b", "--schedule 1f1b --pp 2 --microbatches 2");
  std::string text = slurp(plan);
  // The first recv names microbatch 1 instead of 0: microbatch 1 is received twice.
  size_t recv = text.find("\"op\": \"recv\"");
  ASSERT_NE(recv, std::string::npos);
  size_t mb = text.find("\"mb\": 0", recv);
  ASSERT_NE(mb, std::string::npos);
  std::string broken = written("broken.json", text.replace(mb, 7, "\"mb\": 1"));
  expectError("export " + broken + " --format torch-csv", 1, "appears twice", tmpDir() + "/x.csv");
}

TEST(TorchCli, ImportOfAMalformedCellIsOneLineNamingRowAndColumn) {
  std::string csv = written("bad.csv", "0F0,0B0\r\n1F0,1B0,1Z0\r\n");
  expectError("import " + csv + " --model examples/uniform-8.json", 2,
              "row 2 (rank 1), column 3: '1Z0'", tmpDir() + "/never.json");
}

TEST(TorchCli, ImportOfAWrongScheduleIsAFindingWithTheGrid) {
  std::string csv = written("wrong.csv", "0F0,0F1,0B0,0B1\r\n1F0,1B1,1F1,1B0\r\n");
  std::string out = tmpDir() + "/never.json";
  expectError("import " + csv + " --model examples/uniform-8.json", 1,
              "rank 1 step 1 (1B1): runs before its input 1F1", out);
  Result r = pipec("import " + csv + " --model examples/uniform-8.json");
  EXPECT_NE(r.err.find("<-- here (rank 1)"), std::string::npos) << r.err;
}

TEST(TorchCli, ImportFlagsAreCheckedAsCompilesAre) {
  std::string csv = written("ok.csv", "0F0,0B0\r\n1F0,1B0\r\n");
  std::string out = tmpDir() + "/never.json";
  expectError("import " + csv, 2, "missing --model", out);
  expectError("import " + csv + " --model examples/uniform-8.json --vpp 2", 2, "try --vpp 1", out);
  expectError("import " + csv + " --model examples/uniform-8.json --schedule zb-v", 2,
              "--schedule zb-v places stages in a v-shape", out);
  expectError("import " + csv + " --model examples/uniform-8.json --tp 0", 2,
              "--tp must be at least 1", out);
  expectError("import " + tmpDir() + "/no-such.csv --model examples/uniform-8.json", 2,
              "cannot read", out);
  expectError("import " + csv + " --model examples/uniform-8.json --memory-limit 1MiB", 1,
              "over --memory-limit", out);
  // The fix it names is one import can make (its stages and microbatches are the file's).
  expectError("import " + csv + " --model examples/uniform-8.json --memory-limit 1MiB", 1,
              "over --memory-limit 1.00 MiB; the order is the file's: give a larger "
              "--memory-limit or --tp, or import an order with more stages",
              out);
}

TEST(TorchCli, ImportReadsPipecsOwnTextForm) {
  std::string plan = compiled("zbh2", "--schedule zb-h2 --pp 4 --microbatches 8");
  Result shown = pipec("show " + plan + " --text");
  ASSERT_EQ(shown.code, 0);
  std::string txt = written("zbh2.txt", shown.out);
  std::string back = tmpDir() + "/zbh2-back.json";
  Result r = pipec("import " + txt + " --model examples/uniform-8.json -o " + back);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("(pipec text;"), std::string::npos) << r.out;
  EXPECT_EQ(slurp(back), slurp(plan));
}

} // namespace
