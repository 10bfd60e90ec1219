//===- JsonScanTest.cpp - The fast JSON scanner against nlohmann's parser ----------===//
//
// ir/formats/JsonScan.h must give nlohmann::json::sax_parse's events, value for value, for every
// text it scans, and leave to nlohmann (Unsupported) every text nlohmann refuses. Checked on the
// JSON pipec writes (plans of every shape, the example specs), on hand-made edge cases and on
// thousands of mutations of them; then at the level of the plan reader: the fast reader and
// nlohmann's alone give the same plan or the same error, from a string and from a file read in
// small blocks.
//
//===----------------------------------------------------------------------===//
#include "tests/TestUtil.h"

#include "ir/formats/JsonScan.h"
#include "ir/formats/PlanJson.h"

#include <nlohmann/json.hpp>

#include <bit>
#include <filesystem>
#include <fstream>
#include <random>

namespace pipec::test {
namespace {

using Json = nlohmann::json;

/// A file in Bazel's per-test temporary directory.
std::string tmpPath(const char *name) {
  const char *dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

/// Every event as a line of text; stops (returns false) after `stopAfter` events if set.
struct Recorder {
  using number_integer_t = Json::number_integer_t;
  using number_unsigned_t = Json::number_unsigned_t;
  using number_float_t = Json::number_float_t;
  using string_t = Json::string_t;
  using binary_t = Json::binary_t;

  std::vector<std::string> events;
  size_t stopAfter = SIZE_MAX;
  bool failed = false;

  bool add(std::string e) {
    events.push_back(std::move(e));
    return events.size() < stopAfter;
  }
  bool null() { return add("null"); }
  bool boolean(bool b) { return add(b ? "true" : "false"); }
  bool number_integer(number_integer_t v) { return add("int " + std::to_string(v)); }
  bool number_unsigned(number_unsigned_t v) { return add("unsigned " + std::to_string(v)); }
  bool number_float(number_float_t v, const string_t &text) {
    return add(fmt::format("float {:x} {}", std::bit_cast<uint64_t>(v), text));
  }
  bool string(string_t &s) { return add("string " + s); }
  bool binary(binary_t &) { return add("binary"); }
  bool key(string_t &k) { return add("key " + k); }
  bool start_object(std::size_t n) { return add(fmt::format("{{ {}", n)); }
  bool end_object() { return add("}"); }
  bool start_array(std::size_t n) { return add(fmt::format("[ {}", n)); }
  bool end_array() { return add("]"); }
  bool parse_error(std::size_t, const std::string &, const nlohmann::detail::exception &) {
    failed = true;
    return false;
  }
};

struct Outcome {
  json::ScanResult scan;
  std::vector<std::string> fast, reference;
  bool referenceOk;
};

Outcome both(const std::string &text, size_t stopAfter = SIZE_MAX) {
  Recorder fast, reference;
  fast.stopAfter = reference.stopAfter = stopAfter;
  json::TextInput in(text.data(), text.data() + text.size());
  Outcome o;
  o.scan = json::scanJson(in, fast);
  o.referenceOk = Json::sax_parse(text, &reference) && !reference.failed;
  o.fast = std::move(fast.events);
  o.reference = std::move(reference.events);
  return o;
}

/// The scanner's contract for one text: the same events as nlohmann where it scans the text
/// (all of them, or up to where the handler stopped), and nothing scanned that nlohmann refuses.
void expectAgrees(const std::string &text, size_t stopAfter = SIZE_MAX) {
  Outcome o = both(text, stopAfter);
  switch (o.scan) {
  case json::ScanResult::Done:
    EXPECT_TRUE(o.referenceOk) << "scanned a text nlohmann refuses: " << text.substr(0, 200);
    EXPECT_EQ(o.fast, o.reference) << text.substr(0, 200);
    break;
  case json::ScanResult::Stopped:
    EXPECT_EQ(o.fast.size(), stopAfter);
    EXPECT_EQ(o.fast, o.reference) << text.substr(0, 200);
    break;
  case json::ScanResult::Unsupported:
    break; // nlohmann reads it again, whatever it is
  }
}

std::vector<std::string> writtenPlans() {
  std::vector<std::string> out;
  out.push_back(writePlanJson(compileOrFail(uniformModel(8), options("1f1b", 4, 8, 1, 1, 2, 2))));
  out.push_back(writePlanJson(compileOrFail(uniformModel(8), options("zb-v", 2, 4, 2))));
  out.push_back(writePlanJson(compileOrFail(uniformModel(8), options("seq1f1b", 2, 4, 1, 2))));
  out.push_back(
      writePlanJson(compileOrFail(tinyGpt(), options("interleaved-1f1b", 2, 4, 2, 1, 2))));
  out.push_back(writePlanJson(compileOrFail(tinyGpt(), options("dualpipe-v", 2, 4, 2))));
  return out;
}

std::vector<std::string> exampleSpecs() {
  std::vector<std::string> out;
  for (const auto &entry : std::filesystem::directory_iterator("examples"))
    if (entry.path().extension() == ".json") {
      std::ifstream f(entry.path());
      out.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
  return out;
}

TEST(JsonScanTest, ScansWhatPipecWritesWithNlohmannsEvents) {
  std::vector<std::string> texts = writtenPlans();
  for (std::string &s : exampleSpecs())
    texts.push_back(std::move(s));
  ASSERT_GE(texts.size(), 10u);
  for (const std::string &text : texts) {
    Outcome o = both(text);
    // Not left to nlohmann: the point of the scanner is that these are its own.
    EXPECT_EQ(o.scan, json::ScanResult::Done) << text.substr(0, 200);
    ASSERT_TRUE(o.referenceOk);
    EXPECT_EQ(o.fast, o.reference);
    EXPECT_GT(o.fast.size(), 10u);
  }
}

TEST(JsonScanTest, EdgeCases) {
  struct Case {
    const char *text;
    bool scanned; // false: left to nlohmann
  };
  const Case cases[] = {
      {R"({"a": [1, -2, 0, -0, 3.5, -0.0, 1e3, 2E-2, 1.5e+300, true, false, null]})", true},
      {R"(["", "\"\\\/\b\f\n\r\t", "é", "日本", "𝄞", "\u0041"])", false}, // \u: nlohmann's
      {R"(["", "\"\\\/\b\f\n\r\t", "é", "日本", "𝄞"])", true},
      {"  [ ]  ", true},
      {"{}", true},
      {"[[[[[]]]]]", true},
      {"123456789012345678", false}, // a lone number: its end is the input's end
      {"[123456789012345678, -123456789012345678]", true},
      {"[1234567890123456789]", false},     // 19 digits: nlohmann decides
      {"[99999999999999999999999]", false}, // past 64 bits: a double, nlohmann's
      {"[1e400]", false},                   // out of range
      {"[01]", false},
      {"[1.]", false},
      {"[.5]", false},
      {"[-]", false},
      {"[1e]", false},
      {"[+1]", false},
      {"[1,]", false},
      {"{\"a\":1,}", false},
      {"{\"a\" 1}", false},
      {"{1: 2}", false},
      {"[tru]", false},
      {"[nul", false},
      {"[\"\x01\"]", false},
      {"[\"\xC0\x80\"]", false},         // overlong
      {"[\"\xED\xA0\x80\"]", false},     // a surrogate
      {"[\"\xF4\x90\x80\x80\"]", false}, // past U+10FFFF
      {"[\"\xE2\x82\"]", false},         // cut short
      {"[\"\\x\"]", false},
      {"\xEF\xBB\xBF{}", false}, // a byte-order mark: nlohmann skips it
      {"{} x", false},
      {"{} {}", false},
      {"// c\n{}", false},
      {"", false},
      {"   ", false},
      {"[1] ", true},
      {"\"unterminated", false},
      {"[\"a\\", false},
  };
  for (const Case &c : cases) {
    std::string text = c.text;
    Outcome o = both(text);
    EXPECT_EQ(o.scan == json::ScanResult::Done, c.scanned) << text;
    expectAgrees(text);
  }
}

/// A text with one random edit made of JSON's own characters, or a cut, a repeat, a move.
std::string mutate(const std::string &text, std::mt19937_64 &rng) {
  static const std::string alphabet = "\"\\{}[],:-+.0123456789eEtrufalsn \n\t\x01\x7f\x80\xC3\xA9"
                                      "\xED\xF0u/";
  std::string s = text;
  auto pos = [&](size_t n) { return n == 0 ? 0 : size_t(rng() % n); };
  int edits = 1 + int(rng() % 3);
  for (int e = 0; e < edits && !s.empty(); ++e) {
    size_t at = pos(s.size());
    switch (rng() % 6) {
    case 0:
      s[at] = alphabet[pos(alphabet.size())];
      break;
    case 1:
      s.insert(s.begin() + long(at), alphabet[pos(alphabet.size())]);
      break;
    case 2:
      s.erase(at, 1 + pos(16));
      break;
    case 3:
      s.insert(at, s.substr(pos(s.size()), 1 + pos(24)));
      break;
    case 4:
      s.resize(at);
      break;
    case 5: // another digit where there is one: often a text that still reads
      for (size_t i = at; i < s.size(); ++i)
        if (s[i] >= '0' && s[i] <= '9') {
          s[i] = char('0' + rng() % 10);
          break;
        }
      break;
    }
  }
  return s;
}

TEST(JsonScanTest, MutatedTextsAgreeWithNlohmann) {
  std::vector<std::string> texts;
  texts.push_back(writePlanJson(compileOrFail(uniformModel(2), options("1f1b", 2, 2, 1, 1, 2))));
  texts.push_back(R"({"a": [1, -2, 3.25e-1, "x\ty", "é", true, null, {"b": {}}], "c": []})");
  for (std::string &s : exampleSpecs())
    if (s.size() < 4000)
      texts.push_back(std::move(s));
  std::mt19937_64 rng(7);
  size_t scanned = 0, total = 0;
  for (const std::string &text : texts)
    for (int n = 0; n < 1500; ++n) {
      std::string m = mutate(text, rng);
      Outcome o = both(m);
      ++total;
      if (o.scan == json::ScanResult::Done)
        ++scanned;
      expectAgrees(m);
      expectAgrees(m, /*stopAfter=*/1 + rng() % 40);
      if (HasFailure())
        return;
    }
  // Most mutations break the text (nlohmann's then), but many do not: both kinds were tried.
  EXPECT_GT(scanned, total / 10);
  EXPECT_LT(scanned, total);
}

TEST(JsonScanTest, FileBlocksGiveTheTextsEvents) {
  const std::string text =
      writePlanJson(compileOrFail(uniformModel(8), options("1f1b", 4, 32, 1, 1, 2, 2)));
  ASSERT_GT(text.size(), 100000u); // many 4 KiB blocks, tokens cut at every kind of place
  const std::string path = tmpPath("scan-plan.json");
  {
    std::ofstream f(path, std::ios::binary);
    f << text;
  }
  Recorder fromText, fromFile;
  json::TextInput t(text.data(), text.data() + text.size());
  ASSERT_EQ(json::scanJson(t, fromText), json::ScanResult::Done);
  std::FILE *file = std::fopen(path.c_str(), "rb");
  ASSERT_NE(file, nullptr);
  json::FileInput f(file, /*block=*/4096);
  EXPECT_EQ(json::scanJson(f, fromFile), json::ScanResult::Done);
  std::fclose(file);
  EXPECT_EQ(fromFile.events, fromText.events);
}

/// The plan reader, fast and nlohmann-only: the same plan (written back byte for byte) or the
/// same one-line error.
std::string readOutcome(llvm::Expected<Plan> plan);

// loadPlan reads a file in 256 KiB blocks and decodes instructions straight from each block:
// on a plan of several blocks (instructions cut at every block boundary) it must give the plan
// nlohmann's parse of the whole text gives, and the same error for a break late in the file.
TEST(JsonScanTest, LoadPlanAcrossBlocksGivesNlohmannsPlan) {
  const std::string text =
      writePlanJson(compileOrFail(uniformModel(8), options("1f1b", 8, 256, 1, 1, 2)));
  ASSERT_GT(text.size(), size_t(2) << 20); // eight and more blocks
  const std::string path = tmpPath("big-plan.json");
  {
    std::ofstream f(path, std::ios::binary);
    f << text;
  }
  EXPECT_EQ(readOutcome(loadPlan(path)), text);
  EXPECT_EQ(readOutcome(parsePlanJson(text, "x", JsonParser::Nlohmann)), text);
  // A wrong value in the last instructions, and a cut file: the same messages both ways.
  for (int edit = 0; edit < 2; ++edit) {
    std::string bad = text;
    if (edit == 0)
      bad.replace(bad.rfind("\"mb\": "), 6, "\"mb\": -");
    else
      bad.resize(bad.size() - 1000);
    {
      std::ofstream f(path, std::ios::binary);
      f << bad;
    }
    std::string fromFile = readOutcome(loadPlan(path));
    std::string reference = readOutcome(parsePlanJson(bad, path, JsonParser::Nlohmann));
    EXPECT_EQ(fromFile, reference);
    EXPECT_EQ(fromFile.rfind("error: ", 0), 0u) << fromFile.substr(0, 200);
  }
}

std::string readOutcome(llvm::Expected<Plan> plan) {
  if (!plan)
    return "error: " + errorText(plan.takeError());
  return writePlanJson(*plan);
}

TEST(JsonScanTest, PlanReaderGivesNlohmannsPlanOrError) {
  const std::string text =
      writePlanJson(compileOrFail(tinyGpt(), options("zb-v", 2, 4, 2, 1, 2, 2)));
  EXPECT_EQ(readOutcome(parsePlanJson(text, "p.json")), text);
  std::mt19937_64 rng(11);
  int errors = 0, plans = 0;
  for (int n = 0; n < 2000; ++n) {
    std::string m = mutate(text, rng);
    std::string fast = readOutcome(parsePlanJson(m, "p.json", JsonParser::Fast));
    std::string reference = readOutcome(parsePlanJson(m, "p.json", JsonParser::Nlohmann));
    ASSERT_EQ(fast, reference) << m;
    (fast.rfind("error: ", 0) == 0 ? errors : plans) += 1;
    if (n % 10 == 0) { // and from a file
      const std::string path = tmpPath("p.json");
      {
        std::ofstream f(path, std::ios::binary);
        f << m;
      }
      std::string fromFile = readOutcome(loadPlan(path));
      if (fast.rfind("error: ", 0) == 0) // the same message with the file's name
        EXPECT_EQ(fromFile.substr(fromFile.find(": ", 7)), fast.substr(fast.find(": ", 7)));
      else
        EXPECT_EQ(fromFile, fast);
    }
  }
  EXPECT_GT(errors, 200); // refusals of every kind: syntax, types, ranges, unknown fields
  EXPECT_GT(plans, 40);
}

// An instruction the scanner decodes from the text and one it leaves to the events give the
// same messages: a wrong value is reported with its JSON path either way.
TEST(JsonScanTest, InstructionErrorsNameTheirPath) {
  Plan plan = compileOrFail(uniformModel(2), options("1f1b", 2, 2));
  std::string text = writePlanJson(plan);
  size_t at = text.find("\"mb\": 0");
  ASSERT_NE(at, std::string::npos);
  for (const char *bad : {"\"mb\": -1", "\"mb\": 1.5", "\"mb\": 99999999999999999999",
                          "\"mb\": 0, \"extra\": 1", "\"mb\": \"\\u0030\""}) {
    std::string m = text;
    m.replace(at, 7, bad);
    std::string fast = readOutcome(parsePlanJson(m, "p.json"));
    EXPECT_EQ(fast, readOutcome(parsePlanJson(m, "p.json", JsonParser::Nlohmann))) << bad;
    EXPECT_NE(fast.find("$.ranks[0].instructions[0]"), std::string::npos) << fast;
  }
}

} // namespace
} // namespace pipec::test
