//===- OptionsTest.cpp - The option tables against the docs and the parser ------===//
//
// docs/commands.md's synopsis block is the tables' synopsis (tools/Options.h), line for line:
// a flag added to a table and not to the docs (or the other way round, or with another
// placeholder) fails here with the block the docs should hold. The decision: the test compares
// the generated text with the file's, rather than parsing the file's flags, so that the
// placeholders, the required flags and the nesting are checked too, and the docs' block can be
// pasted from the failure message.
//
//===----------------------------------------------------------------------===//
#include "tools/Options.h"
#include "ir/support/Limits.h"
#include "tools/Args.h"

#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

using namespace pipec;

namespace {

std::string readDoc(const std::string &path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// The first ``` block of the file, without its fences.
std::string firstBlock(const std::string &text) {
  size_t open = text.find("```\n");
  if (open == std::string::npos)
    return "";
  open += 4;
  size_t close = text.find("```", open);
  return text.substr(open, close == std::string::npos ? std::string::npos : close - open);
}

std::string expectedSynopsis() {
  std::string out;
  for (const Command &c : pipecCommands())
    out += synopsis(c);
  return out + "\n" + synopsis(piperunCommand());
}

TEST(OptionsTest, TheDocsSynopsisIsTheTables) {
  std::string doc = readDoc("docs/commands.md");
  ASSERT_FALSE(doc.empty()) << "docs/commands.md is not in the test's runfiles";
  EXPECT_EQ(firstBlock(doc), expectedSynopsis())
      << "docs/commands.md's first block should read:\n```\n"
      << expectedSynopsis() << "```";
}

TEST(OptionsTest, EveryTableIsWellFormed) {
  std::vector<const Command *> all;
  for (const Command &c : pipecCommands())
    all.push_back(&c);
  all.push_back(&piperunCommand());
  for (const Command *c : all) {
    SCOPED_TRACE(std::string(c->tool) + " " + c->name);
    std::set<std::string> seen;
    for (const Option &o : c->options) {
      SCOPED_TRACE(o.name);
      EXPECT_TRUE(seen.insert(o.name).second) << "declared twice";
      if (o.alias) {
        EXPECT_TRUE(seen.insert(o.alias).second) << "spelled twice";
      }
      EXPECT_EQ(c->find(o.name), &o);
      EXPECT_NE(std::string(o.help), "") << "every flag has a line of help";
      EXPECT_EQ(o.isSwitch(), std::string(o.value).empty()) << "a value iff not a switch";
      if (o.kind == OptionKind::Int) {
        EXPECT_LE(o.min, o.max);
        // The value when absent is a valid one, or 0 for "not given" (--microbatch-group-size).
        EXPECT_TRUE(o.fallback == 0 || (o.min <= o.fallback && o.fallback <= o.max));
      }
      if (o.within) {
        EXPECT_NE(c->find(o.within), nullptr) << "nested in a flag the command has";
      }
    }
  }
}

/// Parse `line` (words split at spaces) by the compile table.
llvm::Expected<Args> parseCompile(std::vector<std::string> words,
                                  OptionUse caller = OptionUse::Cli) {
  std::vector<char *> argv;
  for (std::string &w : words)
    argv.push_back(w.data());
  return Args::parse(int(argv.size()), argv.data(), 0, *findPipecCommand("compile"), caller);
}

std::string errorOf(llvm::Error err) { return llvm::toString(std::move(err)); }

TEST(OptionsTest, TheParserChecksEachKindFromTheTable) {
  auto a = parseCompile({"--pp", "4", "--output", "x.json", "--recompute", "full",
                         "--sequence-parallel", "--memory-limit=2GiB"});
  ASSERT_TRUE(bool(a)) << errorOf(a.takeError());
  EXPECT_EQ(a->get("-o"), "x.json") << "--output is stored as -o";
  EXPECT_EQ(*a->integer("--pp"), 4);
  EXPECT_EQ(*a->integer("--vpp"), 1) << "the table's value when absent";
  EXPECT_EQ(*a->bytes("--memory-limit"), int64_t(2) << 30);
  EXPECT_EQ(**a->choice("--recompute"), "full");
  EXPECT_TRUE(a->has("--sequence-parallel"));

  auto big = parseCompile({"--pp", std::to_string(kMaxFlagCount + 1)});
  ASSERT_TRUE(bool(big));
  EXPECT_EQ(errorOf(big->integer("--pp").takeError()),
            "--pp must be at most 16777216 (got 16777217); try --pp 16777216");
  auto bad = parseCompile({"--recompute", "most"});
  ASSERT_TRUE(bool(bad));
  EXPECT_EQ(errorOf(bad->choice("--recompute").takeError()),
            "--recompute: expected none, selective or full (got 'most'); try --recompute full");
  EXPECT_EQ(errorOf(parseCompile({"--show=1"}).takeError()),
            "compile: --show takes no value (got '1')");
  EXPECT_EQ(errorOf(parseCompile({"-o", "a", "--output", "b"}).takeError()),
            "compile: --output given twice ('a' and 'b'); give it once");
}

TEST(OptionsTest, PythonOnlyFlagsAreNotTheCommandLines) {
  EXPECT_EQ(errorOf(parseCompile({"--model-json", "{}"}).takeError()),
            "compile: unknown flag --model-json; did you mean --model?");
  EXPECT_TRUE(bool(parseCompile({"--model-json", "{}"}, OptionUse::Python)));
  EXPECT_FALSE(bool(parseCompile({"--show"}, OptionUse::Python)))
      << "the command line's printing is no keyword argument";
}

} // namespace
