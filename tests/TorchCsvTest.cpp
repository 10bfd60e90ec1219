//===- TorchCsvTest.cpp - PyTorch schedule CSV: export, import, round trip -===//
//
// What PyTorch itself says about these files (its loader, validator and runtime) is checked in
// python/tests/; here: the round trip over a sweep of every schedule PyTorch can express
// (export, import, byte-identical plan), pipec's text form for every schedule, the refusals,
// the diagnostics for malformed and wrong schedules, and the invariants of the comms form.
// Golden CSVs for small configs: tests/golden/torch_*.csv, regenerated (never hand-edited) with
//   bazel run //tests:torch_csv_test -- --update
//
//===----------------------------------------------------------------------===//
#include "tests/Golden.h"
#include "tests/TestUtil.h"

#include "compiler/Import.h"
#include "compiler/Verifier.h"
#include "compiler/torch/TorchCsv.h"
#include "ir/PlanText.h"
#include "ir/formats/PlanJson.h"
#include "schedules/Policy.h"

#include "llvm/ADT/StringExtras.h"

#include <map>
#include <set>

namespace pipec::test {
namespace {

struct Config {
  std::string schedule;
  int pp, microbatches, vpp;
  int64_t memoryLimit = 0;
};

std::string name(const Config &c) {
  return fmt::format("{} p={} m={} v={}", c.schedule, c.pp, c.microbatches, c.vpp);
}

/// F = 1, B = 2, W = 1 with a transfer time: zb-auto then differs from the hand-made orders.
ModelSpec sweepModel() { return uniformModel(24, 1, 2, 1, 1 << 20, 1 << 18, 0.1); }

/// Every schedule PyTorch can express, over pp 2..6 and microbatch counts around pp.
std::vector<Config> sweep() {
  std::vector<Config> out;
  for (const SchedulePolicy *p : allPolicies()) {
    std::string s = p->name().str();
    std::vector<int> vpps = {1};
    if (s == "interleaved-1f1b" || s == "seq1f1b-interleaved")
      vpps = {2, 3};
    if (s == "zb-v" || s == "dualpipe-v")
      vpps = {2};
    for (int pp = 2; pp <= 6; ++pp)
      for (int m : {1, pp - 1, pp, pp + 1, 2 * pp, 3 * pp + 1})
        for (int v : vpps) {
          Config c{s, pp, m, v};
          CompileOptions o = options(s, pp, m, v);
          if (auto err = p->check(o.parallel)) {
            llvm::consumeError(std::move(err));
            continue;
          }
          if (s == "zb-auto")
            c.memoryLimit = int64_t(pp) * 2 * (4 << 20); // two microbatches beyond 1F1B's
          out.push_back(c);
        }
  }
  return out;
}

Plan compileConfig(const ModelSpec &model, const Config &c) {
  CompileOptions o = options(c.schedule, c.pp, c.microbatches, c.vpp);
  o.memoryLimit = c.memoryLimit;
  return compileOrFail(model, o);
}

ImportOptions importOptions(const Config &c, bool named) {
  ImportOptions o;
  o.memoryLimit = c.memoryLimit;
  if (named)
    o.schedule = c.schedule;
  return o;
}

/// Import with the verifier after every pass (the final verify pass runs anyway).
llvm::Expected<ImportResult> importText(const ModelSpec &model, llvm::StringRef text,
                                        const ImportOptions &o, bool verifyEach = true) {
  auto order = parseSchedule(text, "sched.csv");
  if (!order)
    return order.takeError();
  return compileImported(model, ClusterSpec::defaults(), *order, o, "sched.csv", verifyEach);
}

std::string exportOrFail(const Plan &plan, TorchCsvForm form) {
  auto csv = writeTorchCsv(plan, form);
  if (!csv) {
    ADD_FAILURE() << "export failed: " << takeMessage(csv.takeError());
    return "";
  }
  return *csv;
}

TEST(TorchCsvRoundTrip, EveryExpressibleScheduleImportsBackByteForByte) {
  ModelSpec model = sweepModel();
  size_t configs = 0, recognisedFirst = 0;
  std::set<std::string> collisions;
  for (const Config &c : sweep()) {
    Plan plan = compileConfig(model, c);
    if (::testing::Test::HasFailure())
      return;
    std::string json = writePlanJson(plan);
    for (TorchCsvForm form : {TorchCsvForm::ComputeOnly, TorchCsvForm::ComputeComms}) {
      std::string csv = exportOrFail(plan, form);
      // Recognised: the original policy is among those whose order this is.
      auto recognised =
          importText(model, csv, importOptions(c, /*named=*/false), /*verifyEach=*/false);
      ASSERT_TRUE(bool(recognised)) << name(c) << ": " << takeMessage(recognised.takeError());
      const auto &matches = recognised->matches;
      ASSERT_TRUE(llvm::is_contained(matches, c.schedule))
          << name(c) << " imported as " << recognised->plan.schedule;
      if (matches.front() == c.schedule) {
        EXPECT_EQ(writePlanJson(recognised->plan), json) << name(c);
        ++recognisedFirst;
      } else {
        // An earlier policy emits the very same order here (gpipe and 1f1b at one
        // microbatch, say): the plan is the same but for its name.
        collisions.insert(fmt::format("{} = {}", c.schedule, matches.front()));
        Plan renamed = recognised->plan;
        renamed.schedule = c.schedule;
        EXPECT_EQ(writePlanJson(renamed), json) << name(c);
      }
      if (matches.front() == c.schedule)
        continue;
      // Named with --schedule: byte for byte, always.
      auto named = importText(model, csv, importOptions(c, /*named=*/true), /*verifyEach=*/false);
      ASSERT_TRUE(bool(named)) << name(c) << ": " << takeMessage(named.takeError());
      EXPECT_EQ(writePlanJson(named->plan), json) << name(c) << " (" << toString(form).str() << ")";
    }
    ++configs;
  }
  EXPECT_GT(configs, 150u);
  std::cout << configs << " configurations, " << recognisedFirst << " of " << 2 * configs
            << " imports recognised by order alone; shared orders: "
            << llvm::join(collisions.begin(), collisions.end(), ", ") << "\n";
}

TEST(TorchCsvRoundTrip, TransformerPlanOnAClusterImportsBackByteForByte) {
  ModelSpec model = tinyGpt(/*tied=*/false, /*layers=*/6);
  Plan plan = compileOrFail(model, options("zb-v", 2, 6, 2));
  std::string csv = exportOrFail(plan, TorchCsvForm::ComputeComms);
  auto back = importText(model, csv, {});
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_EQ(back->plan.schedule, "zb-v");
  EXPECT_EQ(writePlanJson(back->plan), writePlanJson(plan));
}

TEST(TorchCsvRoundTrip, DataParallelPlansImportBackWithTheirDpFlag) {
  ModelSpec model = sweepModel();
  Plan plan = compileOrFail(model, options("1f1b", 4, 8, 1, 1, 1, /*dp=*/2));
  std::string csv = exportOrFail(plan, TorchCsvForm::ComputeComms);
  ImportOptions o;
  o.dp = 2;
  auto back = importText(model, csv, o);
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_EQ(writePlanJson(back->plan), writePlanJson(plan));
}

TEST(TorchCsvRoundTrip, ContextParallelPlansImportBackWithTheirCpFlag) {
  // Context parallelism changes what a stage computes, not the order: --cp gives the plan back
  // byte for byte (its gradient reductions over the cp ranks at dp 1 included).
  ModelSpec model = tinyGpt(/*tied=*/false, /*layers=*/6);
  CompileOptions co = options("zb-h1", 2, 4);
  co.parallel.cp = 2;
  Plan plan = compileOrFail(model, co);
  std::string csv = exportOrFail(plan, TorchCsvForm::ComputeComms);
  ImportOptions o;
  o.cp = 2;
  auto back = importText(model, csv, o);
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_EQ(writePlanJson(back->plan), writePlanJson(plan));
}

TEST(TorchCsvRoundTrip, ImportedPlansAreNamedAndPostValidateAsThePolicyTheirOrderIs) {
  // The plan takes its name and its optimizer step from the policy the schedule pass
  // identifies: zero-bubble orders post-validate, an order that is no policy's does not.
  ModelSpec model = sweepModel();
  Plan zb = compileOrFail(model, options("zb-h1", 4, 8));
  ASSERT_TRUE(zb.postValidation);
  auto back = importText(model, exportOrFail(zb, TorchCsvForm::ComputeOnly), {});
  ASSERT_TRUE(bool(back)) << takeMessage(back.takeError());
  EXPECT_EQ(back->plan.schedule, "zb-h1");
  EXPECT_TRUE(back->plan.postValidation);
  auto custom = importText(model, "0F0,0F1,0B1,0B0\r\n1F0,1B0,1F1,1B1\r\n", {});
  ASSERT_TRUE(bool(custom)) << takeMessage(custom.takeError());
  EXPECT_EQ(custom->plan.schedule, kCustomSchedule);
  EXPECT_FALSE(custom->plan.postValidation);
  // Named: the named policy's, checked against the order.
  ImportOptions named;
  named.schedule = "zb-h1";
  auto again = importText(model, exportOrFail(zb, TorchCsvForm::ComputeOnly), named);
  ASSERT_TRUE(bool(again)) << takeMessage(again.takeError());
  EXPECT_EQ(writePlanJson(again->plan), writePlanJson(zb));
  EXPECT_EQ(again->matches.front(), "zb-h1");
}

TEST(PipecTextRoundTrip, EveryScheduleImportsBackFromItsTextForm) {
  // pipec's own text form can say everything: sub-sequences and tp parts too.
  ModelSpec model = tinyGpt(/*tied=*/true, /*layers=*/8, /*seq=*/16);
  struct Case {
    const char *schedule;
    int pp, m, vpp, k, tp, dp;
  } cases[] = {{"gpipe", 2, 3, 1, 2, 1, 1},
               {"1f1b", 4, 8, 1, 1, 2, 2},
               {"interleaved-1f1b", 2, 4, 2, 1, 1, 1},
               {"seq1f1b", 4, 4, 1, 4, 1, 1},
               {"seq1f1b-interleaved", 2, 2, 2, 2, 2, 1},
               {"zb-h1", 3, 5, 1, 2, 1, 1},
               {"zb-h2", 4, 8, 1, 1, 1, 2},
               {"zb-v", 2, 4, 2, 2, 1, 1},
               {"dualpipe-v", 2, 4, 2, 1, 2, 1}};
  for (const Case &c : cases) {
    Plan plan = compileOrFail(model, options(c.schedule, c.pp, c.m, c.vpp, c.k, c.tp, c.dp));
    ImportOptions o;
    o.tp = c.tp;
    o.dp = c.dp;
    auto back = importText(model, formatStreams(plan), o);
    ASSERT_TRUE(bool(back)) << c.schedule << ": " << takeMessage(back.takeError());
    EXPECT_EQ(back->plan.schedule, c.schedule);
    EXPECT_EQ(writePlanJson(back->plan), writePlanJson(plan)) << c.schedule;
  }
}

TEST(TorchCsvExport, RefusesSubSequencesNamingSeqSplits) {
  Plan plan = compileOrFail(uniformModel(8), options("seq1f1b", 4, 8, 1, /*seqSplits=*/2));
  auto csv = writeTorchCsv(plan, TorchCsvForm::ComputeOnly);
  ASSERT_FALSE(bool(csv));
  std::string msg = takeMessage(csv.takeError());
  EXPECT_NE(msg.find("sub-sequences"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--seq-splits 1"), std::string::npos) << msg;
}

TEST(TorchCsvExport, RefusesTensorParallelPartsNamingTp) {
  Plan plan = compileOrFail(tinyGpt(), options("1f1b", 2, 4, 1, 1, /*tp=*/2));
  auto csv = writeTorchCsv(plan, TorchCsvForm::ComputeComms);
  ASSERT_FALSE(bool(csv));
  std::string msg = takeMessage(csv.takeError());
  EXPECT_NE(msg.find("--tp 1"), std::string::npos) << msg;
}

TEST(TorchCsvExport, RefusesTiedEmbeddingsNamingTheModelField) {
  Plan plan = compileOrFail(tinyGpt(/*tied=*/true), options("1f1b", 2, 4));
  auto csv = writeTorchCsv(plan, TorchCsvForm::ComputeOnly);
  ASSERT_FALSE(bool(csv));
  std::string msg = takeMessage(csv.takeError());
  EXPECT_NE(msg.find("\"tie_embeddings\": false"), std::string::npos) << msg;
}

TEST(TorchCsvExport, ComputeOnlyRowsAreTheComputeOpsInStreamOrder) {
  Plan plan = compileOrFail(uniformModel(8), options("1f1b", 2, 3));
  EXPECT_EQ(exportOrFail(plan, TorchCsvForm::ComputeOnly),
            "0F0,0F1,0B0,0F2,0B1,0B2\r\n1F0,1B0,1F1,1B1,1F2,1B2\r\n");
}

TEST(TorchCsvExport, DualPipeVPairsAreOverlappedActionsExceptTheLastRanksFirst) {
  Plan plan = compileOrFail(uniformModel(8), options("dualpipe-v", 2, 4, 2));
  std::string csv = exportOrFail(plan, TorchCsvForm::ComputeOnly);
  llvm::SmallVector<llvm::StringRef, 2> rows;
  llvm::StringRef(csv).split(rows, "\r\n", -1, false);
  ASSERT_EQ(rows.size(), 2u);
  // Rank 1 = P-1: its first F&B adjacency (1F2, 2B0) stays two actions, as in PyTorch's
  // ScheduleDualPipeV; the next ones are pairs.
  EXPECT_NE(rows[1].find("1F2,2B0,(2F2;1B0)OVERLAP_F_B,(1F3;2B1)OVERLAP_F_B"), std::string::npos)
      << rows[1].str();
  EXPECT_NE(rows[0].find("(0F3;3B1)OVERLAP_F_B,(3F2;0B0)OVERLAP_F_B"), std::string::npos)
      << rows[0].str();
}

/// The cells of a comms row.
std::vector<std::string> cellsOf(llvm::StringRef row) {
  llvm::SmallVector<llvm::StringRef, 64> cells;
  row.split(cells, ',');
  return std::vector<std::string>(cells.begin(), cells.end());
}

TEST(TorchCsvExport, CommsFormRetiresEverySendAndReducesEveryStageOnceAfterItsLastGradient) {
  ModelSpec model = sweepModel();
  for (const Config &c : sweep()) {
    if (c.pp != 4)
      continue;
    Plan plan = compileConfig(model, c);
    std::string csv = exportOrFail(plan, TorchCsvForm::ComputeComms);
    llvm::SmallVector<llvm::StringRef, 8> rows;
    llvm::StringRef(csv).split(rows, "\r\n", -1, false);
    ASSERT_EQ(int(rows.size()), plan.numRanks()) << name(c);
    for (size_t r = 0; r < rows.size(); ++r) {
      std::vector<std::string> cells = cellsOf(rows[r]);
      std::map<std::string, int> sends; // "SEND_F<s>:<m>" -> waits seen after it
      std::map<int, size_t> lastGrad, reduceAt, waitReduceAt, firstCompute, unshardAt;
      for (size_t i = 0; i < cells.size(); ++i) {
        llvm::StringRef cell = cells[i];
        // Sub-actions of an overlapped pair count as compute at this position.
        llvm::SmallVector<llvm::StringRef, 2> parts;
        if (cell.consume_front("(")) {
          cell.split(')').first.split(parts, ';');
        } else {
          parts.push_back(cell);
        }
        for (llvm::StringRef part : parts) {
          size_t digits = part.find_first_not_of("0123456789");
          int stage = 0;
          ASSERT_FALSE(part.take_front(digits).getAsInteger(10, stage)) << part.str();
          llvm::StringRef kind = part.drop_front(digits);
          if (kind.startswith("SEND_")) {
            EXPECT_TRUE(sends.emplace(part.str(), 0).second) << "send twice: " << part.str();
          } else if (kind.startswith("WAIT_SEND_")) {
            std::string send = part.str();
            send.erase(send.find("WAIT_"), 5);
            ASSERT_TRUE(sends.count(send)) << name(c) << ": wait before its send " << part.str();
            EXPECT_EQ(++sends[send], 1) << part.str();
          } else if (kind == "REDUCE_GRAD") {
            EXPECT_TRUE(reduceAt.emplace(stage, i).second) << name(c) << " stage " << stage;
          } else if (kind == "WAIT_REDUCE_GRAD") {
            waitReduceAt[stage] = i;
          } else if (kind == "UNSHARD") {
            unshardAt.emplace(stage, i);
          } else if (kind.size() > 1 && llvm::StringRef("FIWB").contains(kind[0]) &&
                     llvm::isDigit(kind[1])) {
            firstCompute.emplace(stage, i);
            if (kind[0] == 'W' || kind[0] == 'B')
              lastGrad[stage] = i;
          }
        }
      }
      for (auto &[send, waits] : sends)
        EXPECT_EQ(waits, 1) << name(c) << " rank " << r << ": " << send << " never waited";
      for (auto &[stage, at] : lastGrad) {
        ASSERT_TRUE(reduceAt.count(stage)) << name(c) << ": stage " << stage << " not reduced";
        EXPECT_GT(reduceAt[stage], at) << name(c) << ": stage " << stage;
        EXPECT_EQ(waitReduceAt[stage], reduceAt[stage] + 1) << name(c) << ": stage " << stage;
        ASSERT_TRUE(unshardAt.count(stage)) << name(c) << ": stage " << stage;
        EXPECT_LT(unshardAt[stage], firstCompute[stage]) << name(c) << ": stage " << stage;
      }
      EXPECT_EQ(reduceAt.size(), lastGrad.size()) << name(c);
    }
  }
}

TEST(TorchCsvExport, CommsFormKeepsPipecsSendAndRecvOrderPerRankPair) {
  // What PyTorch's runtime matches is the order of the sends (and of the recvs) between each
  // pair of ranks: it must be pipec's verified order, even where pairs moved a recv earlier.
  ModelSpec model = sweepModel();
  Plan plan = compileOrFail(model, options("dualpipe-v", 4, 10, 2));
  std::string csv = exportOrFail(plan, TorchCsvForm::ComputeComms);
  llvm::SmallVector<llvm::StringRef, 8> rows;
  llvm::StringRef(csv).split(rows, "\r\n", -1, false);
  for (int r = 0; r < plan.numRanks(); ++r) {
    std::vector<std::string> fromPlan, fromCsv;
    for (const Instruction &i : plan.ranks[size_t(r)])
      if (i.isP2P()) {
        std::string tok = formatToken(plan, i);
        fromPlan.push_back(tok.substr(0, tok.find('#')));
      }
    for (const std::string &cell : cellsOf(rows[size_t(r)]))
      if (cell.find("SEND_") != std::string::npos || cell.find("RECV_") != std::string::npos)
        if (cell.find("WAIT_") == std::string::npos)
          fromCsv.push_back(cell);
    auto byKind = [](const std::vector<std::string> &v, const char *kind) {
      std::vector<std::string> out;
      for (const std::string &s : v)
        if (s.find(kind) != std::string::npos)
          out.push_back(s);
      return out;
    };
    EXPECT_EQ(byKind(fromCsv, "SEND_"), byKind(fromPlan, "SEND_")) << "rank " << r;
    EXPECT_EQ(byKind(fromCsv, "RECV_"), byKind(fromPlan, "RECV_")) << "rank " << r;
  }
}

/// The comms rows as a plan whose every send and recv is its own group (PyTorch issues each
/// action by itself), so that pipec's verifier can judge them under NCCL's blocking rules.
llvm::Expected<Plan> commsRowsAsPlan(const Plan &plan, llvm::StringRef csv) {
  Plan out = plan;
  llvm::SmallVector<llvm::StringRef, 8> rows;
  csv.split(rows, "\r\n", -1, false);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<Instruction> stream;
    for (const std::string &cell : cellsOf(rows[r])) {
      llvm::StringRef c = cell;
      if (c.contains("WAIT_") || c.contains("REDUCE_GRAD") || c.contains("SHARD"))
        continue;
      llvm::SmallVector<llvm::StringRef, 2> parts;
      if (c.consume_front("("))
        c.split(')').first.split(parts, ';');
      else
        parts.push_back(c);
      for (llvm::StringRef part : parts) {
        auto ins = parseToken(out, int(r), part);
        if (!ins)
          return ins.takeError();
        stream.push_back(*ins);
      }
    }
    out.ranks[r] = std::move(stream);
  }
  return out;
}

TEST(TorchCsvExport, CommsFormReducesWhereTheSamePlanWithDataParallelismDoes) {
  // With dp > 1 the REDUCE_GRADs stand where the plan's dp all-reduces are; with dp = 1 the
  // export asks lower-collectives' rule where they would be. Same order, same rows.
  ModelSpec model = sweepModel();
  size_t compared = 0;
  for (const Config &c : sweep()) {
    if (c.schedule == "zb-auto")
      continue; // its search weighs memory, which dp changes
    CompileOptions o = options(c.schedule, c.pp, c.microbatches, c.vpp);
    Plan one = compileOrFail(model, o);
    o.parallel.dp = 2;
    Plan two = compileOrFail(model, o);
    if (::testing::Test::HasFailure())
      return;
    ASSERT_EQ(exportOrFail(one, TorchCsvForm::ComputeOnly),
              exportOrFail(two, TorchCsvForm::ComputeOnly))
        << name(c);
    std::string csv = exportOrFail(one, TorchCsvForm::ComputeComms);
    EXPECT_EQ(csv, exportOrFail(two, TorchCsvForm::ComputeComms)) << name(c);
    // Every stage reduced (REDUCE_GRAD and its WAIT_REDUCE_GRAD), so the rows say something.
    size_t reductions = 0;
    for (size_t at = csv.find("REDUCE_GRAD"); at != std::string::npos;
         at = csv.find("REDUCE_GRAD", at + 1))
      ++reductions;
    EXPECT_EQ(reductions, 2u * size_t(one.numStages())) << name(c);
    ++compared;
  }
  EXPECT_GT(compared, 150u);
}

TEST(TorchCsvExport, CommsFormIsDeadlockFreeWithEveryActionIssuedAlone) {
  // PyTorch posts each send and recv as its own batch: pipec's groups are gone, so the order
  // itself must be deadlock-free under NCCL's blocking rules (each op waits for its partner).
  ModelSpec model = sweepModel();
  size_t checked = 0;
  for (const Config &c : sweep()) {
    if (c.pp > 4)
      continue;
    Plan plan = compileConfig(model, c);
    auto ops = commsRowsAsPlan(plan, exportOrFail(plan, TorchCsvForm::ComputeComms));
    ASSERT_TRUE(bool(ops)) << name(c) << ": " << takeMessage(ops.takeError());
    VerifyOptions o;
    o.requireCollectives = false;
    if (auto err = verifyPlan(*ops, o)) {
      FAIL() << name(c) << ":\n" << takeMessage(std::move(err));
    }
    ++checked;
  }
  EXPECT_GT(checked, 100u);
}

ModelSpec eight() { return uniformModel(8); }

std::string importError(llvm::StringRef text, bool &isFinding, ImportOptions o = {}) {
  auto r = importText(eight(), text, o);
  if (r) {
    ADD_FAILURE() << "imported without an error:\n" << text.str();
    return "";
  }
  llvm::Error err = r.takeError();
  isFinding = exitCodeFor(err) == 1;
  return takeMessage(std::move(err));
}

TEST(TorchCsvImport, MalformedCellIsBadInputNamingRowAndColumn) {
  bool isFinding = true;
  std::string msg = importError("0F0,0B0\r\n1F0,1X0,1B0\r\n", isFinding);
  EXPECT_FALSE(isFinding);
  EXPECT_NE(msg.find("sched.csv: row 2 (rank 1), column 2: '1X0'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
}

TEST(TorchCsvImport, HugeStageOrMicrobatchNumbersAreBadInput) {
  bool isFinding = true;
  std::string msg = importError("0F0,999999999F0\r\n", isFinding);
  EXPECT_FALSE(isFinding);
  EXPECT_NE(msg.find("stage 999999999 is beyond"), std::string::npos) << msg;
  msg = importError("0F999999999,0B999999999\r\n", isFinding);
  EXPECT_FALSE(isFinding);
  EXPECT_NE(msg.find("--microbatches"), std::string::npos) << msg;
}

TEST(TorchCsvImport, ComputeActionWithoutMicrobatchIsBadInput) {
  bool isFinding = true;
  std::string msg = importError("0F0,0F,0B0\r\n", isFinding);
  EXPECT_FALSE(isFinding);
  EXPECT_NE(msg.find("column 2"), std::string::npos) << msg;
}

TEST(TorchCsvImport, BackwardBeforeItsForwardIsAFindingNamingRankAndStep) {
  bool isFinding = false;
  std::string msg = importError("0F0,0B1,0F1,0B0\r\n1F0,1B0,1F1,1B1\r\n", isFinding);
  EXPECT_TRUE(isFinding);
  EXPECT_NE(msg.find("rank 0 step 1 (0B1)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("<-- here"), std::string::npos) << msg;
}

TEST(TorchCsvImport, MissingMicrobatchIsAFinding) {
  bool isFinding = false;
  std::string msg = importError("0F0,0F1,0B0,0B1\r\n1F0,1B0\r\n", isFinding);
  EXPECT_TRUE(isFinding);
  EXPECT_NE(msg.find("1F1 is missing"), std::string::npos) << msg;
}

TEST(TorchCsvImport, DuplicateMicrobatchIsAFinding) {
  bool isFinding = false;
  std::string msg = importError("0F0,0B0,0F0,0B0\r\n1F0,1B0\r\n", isFinding);
  EXPECT_TRUE(isFinding);
  EXPECT_NE(msg.find("appears twice"), std::string::npos) << msg;
}

TEST(TorchCsvImport, StageOnTwoRanksIsAFindingNamingRankAndStep) {
  bool isFinding = false;
  std::string msg = importError("0F0,0F1,0B0,0B1\r\n1F0,1B0,0F1,1F1,1B1\r\n", isFinding);
  EXPECT_TRUE(isFinding);
  EXPECT_NE(msg.find("rank 1 step 2 (0F1): stage 0 lives on rank 0"), std::string::npos) << msg;
}

TEST(TorchCsvImport, CrossRankCycleIsAFinding) {
  // Rank 0 waits for 1's gradient of microbatch 1 before it has sent the forward of it.
  bool isFinding = false;
  std::string msg = importError("0F0,0B0,0F1,0B1\r\n1F1,1F0,1B0,1B1\r\n", isFinding);
  EXPECT_TRUE(isFinding);
  EXPECT_NE(msg.find("cannot run"), std::string::npos) << msg;
}

TEST(TorchCsvImport, PlacementNeitherLoopNorVIsBadInputNamingPlacement) {
  bool isFinding = true;
  std::string msg = importError("1F0,1B0\r\n0F0,0B0\r\n", isFinding);
  EXPECT_FALSE(isFinding);
  EXPECT_NE(msg.find("placement: stage 0 runs on rank 1"), std::string::npos) << msg;
}

TEST(TorchCsvImport, VppFlagThatDisagreesIsBadInput) {
  bool isFinding = true;
  ImportOptions o;
  o.vpp = 2;
  std::string msg = importError("0F0,0B0\r\n1F0,1B0\r\n", isFinding, o);
  EXPECT_FALSE(isFinding);
  EXPECT_NE(msg.find("try --vpp 1"), std::string::npos) << msg;
}

TEST(TorchCsvImport, NamedScheduleThatDiffersIsAFindingNamingTheStep) {
  bool isFinding = false;
  ImportOptions o;
  o.schedule = "1f1b";
  std::string msg = importError("0F0,0F1,0B0,0B1\r\n1F0,1F1,1B0,1B1\r\n", isFinding, o);
  EXPECT_TRUE(isFinding);
  EXPECT_NE(msg.find("rank 1 compute step 1 is 1F1, 1f1b has 1B0 there"), std::string::npos) << msg;
}

TEST(TorchCsvImport, InfersAVShapeAndIdleCellsAndOverlappedPairs) {
  auto r = importText(eight(),
                      "0F0,,0F1,3F0,3B0,(3F1;0B0)OVERLAP_F_B,3B1,0B1\r\n"
                      "1F0,2F0,1F1,2B0,(2F1;1B0)OVERLAP_F_B,2B1,1B1\r\n",
                      {});
  ASSERT_TRUE(bool(r)) << takeMessage(r.takeError());
  EXPECT_EQ(r->plan.placement, Placement::VShape);
  EXPECT_EQ(r->plan.parallel.vpp, 2);
  EXPECT_EQ(r->plan.parallel.microbatches, 2);
  EXPECT_EQ(r->plan.schedule, kCustomSchedule);
  EXPECT_EQ(r->matches.size(), 0u);
}

TEST(TorchCsvImport, CommActionsAreDroppedAndReDerived) {
  auto order = parseSchedule("0UNSHARD,0F0,0SEND_F0,1RECV_B0,0B0,0REDUCE_GRAD,0WAIT_REDUCE_GRAD,"
                             "0WAIT_SEND_F0,0RESHARD\r\n"
                             "1RECV_F0,1F0,1B0,1SEND_B0,1WAIT_SEND_B0\r\n",
                             "s.csv");
  ASSERT_TRUE(bool(order)) << takeMessage(order.takeError());
  EXPECT_EQ(order->source, ImportedOrder::Source::TorchCsvComms);
  EXPECT_EQ(order->droppedComms, 10u);
  ASSERT_EQ(order->ranks.size(), 2u);
  EXPECT_EQ(order->ranks[0].size(), 2u);
  EXPECT_EQ(order->ranks[1].size(), 2u);
}

TEST(TorchCsvImport, QuotedCellsAndUnixLineEndsAreRead) {
  auto order = parseSchedule("\"0F0\",0B0\n1F0,\"1B0\"\n", "s.csv");
  ASSERT_TRUE(bool(order)) << takeMessage(order.takeError());
  ASSERT_EQ(order->ranks.size(), 2u);
  EXPECT_EQ(order->ranks[1][1], Instruction::compute(OpKind::Backward, 1, 0, 0));
}

TEST(PipecTextImport, MalformedTokenIsBadInputNamingLineAndToken) {
  auto order =
      parseSchedule("1f1b on uniform-8: pp=2\nrank 0: 0F0 0B0\nrank 1: 1F0 1Q0\n", "s.txt");
  ASSERT_FALSE(bool(order));
  std::string msg = takeMessage(order.takeError());
  EXPECT_NE(msg.find("s.txt: line 3 (rank 1), token 2: '1Q0'"), std::string::npos) << msg;
}

TEST(PipecTextImport, ReadsExactlyTheTokensTheTextFormsLexerReads) {
  // One grammar: a token between two compute ops is accepted by the importer exactly when
  // PlanText's lexer reads it.
  const char *tokens[] = {"0F1",
                          "0F0.1",
                          "0F0:0/2",
                          "0F0:1/2",
                          "0F0:2/2",
                          "0F0:0/0",
                          "0F0#1",
                          "0W3",
                          "0I0.0:1/3",
                          "1SEND_F0",
                          "1SEND_F0.1#4",
                          "1RECV_B0#",
                          "1SEND_X0",
                          "1SEND_F0:0/2",
                          "0ALLREDUCE_DP",
                          "0ALLREDUCE_EMB",
                          "0ALLREDUCE_DPX",
                          "0ALLREDUCE_TP_F0:0/2",
                          "0ALLREDUCE_TP_W0:0/2",
                          "0ALLREDUCE_TP_I0",
                          "OPTIMIZER_STEP",
                          "0",
                          "F0",
                          "0f0",
                          "0F",
                          "0F1234567890",
                          "0Q0"};
  for (const char *tok : tokens) {
    auto lexed = lexToken(tok);
    bool lexes = bool(lexed);
    if (!lexes)
      llvm::consumeError(lexed.takeError());
    auto order = parseSchedule(fmt::format("rank 0: 0F0 {} 0B0\n", tok), "s.txt");
    EXPECT_EQ(bool(order), lexes) << tok;
    if (!order)
      llvm::consumeError(order.takeError());
  }
}

TEST(TorchCsvImport, ComputeActionsAreTextFormComputeTokensWithoutSlicesOrParts) {
  struct Case {
    const char *cell;
    bool accepted;
  } cases[] = {{"0F1", true},       {"12W3", true},          {" 0I0 ", true},
               {"00B01", true},     {"0F1.0", false},        {"0F1:0/2", false},
               {"0F1#2", false},    {"0f1", false},          {"0F", false},
               {"F0", false},       {"0F1234567890", false}, {"0ALLREDUCE_DP", false},
               {"0SEND_X1", false}, {"0SEND_F0.1", false}};
  for (const Case &c : cases) {
    auto order = parseSchedule(fmt::format("{},0B0\r\n", c.cell), "s.csv");
    EXPECT_EQ(bool(order), c.accepted) << c.cell;
    if (!order)
      llvm::consumeError(order.takeError());
  }
}

class TorchCsvGolden : public ::testing::TestWithParam<Config> {};

TEST_P(TorchCsvGolden, MatchesTheCheckedInCsv) {
  const Config &c = GetParam();
  Plan plan = compileConfig(eight(), c);
  for (TorchCsvForm form : {TorchCsvForm::ComputeOnly, TorchCsvForm::ComputeComms}) {
    std::string csv = exportOrFail(plan, form);
    std::string file = fmt::format("torch_{}_p{}_m{}{}.csv", c.schedule, c.pp, c.microbatches,
                                   form == TorchCsvForm::ComputeComms ? "_comms" : "");
    std::replace(file.begin(), file.end(), '-', '_');
    expectMatchesGoldenFile(file, csv, "torch_csv_test");
  }
}

INSTANTIATE_TEST_SUITE_P(SmallConfigs, TorchCsvGolden,
                         ::testing::Values(Config{"1f1b", 4, 8, 1},
                                           Config{"interleaved-1f1b", 2, 4, 2},
                                           Config{"zb-h1", 4, 8, 1}, Config{"zb-v", 2, 4, 2},
                                           Config{"dualpipe-v", 2, 4, 2}),
                         [](const auto &info) {
                           std::string n = fmt::format("{}_p{}_m{}", info.param.schedule,
                                                       info.param.pp, info.param.microbatches);
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

} // namespace
} // namespace pipec::test

int main(int argc, char **argv) { return pipec::test::goldenMain(argc, argv); }
