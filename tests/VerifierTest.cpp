//===- VerifierTest.cpp - The verifier rejects wrong plans, and says where ===//
//
// Each negative test takes a correct compiled plan, breaks one thing through the text form,
// and asserts the diagnostic: the finding names the rank, the step and the instruction and
// marks the grid with "<-- here".
//
//===----------------------------------------------------------------------===//
#include "tests/TestUtil.h"

#include "compiler/Verifier.h"
#include "ir/PlanText.h"

#include <vector>

namespace pipec::test {
namespace {

/// A correct 2-rank, 2-microbatch plan whose streams the tests replace.
Plan base() {
  return compileOrFail(uniformModel(2), options("gpipe", /*pp=*/2, /*microbatches=*/2));
}

Plan withStreams(llvm::StringRef text) {
  Plan plan = base();
  if (auto err = parseStreams(text, plan)) {
    ADD_FAILURE() << takeMessage(std::move(err));
  }
  return plan;
}

TEST(VerifierTest, AcceptsTheCompiledPlan) { EXPECT_FALSE(verifyPlan(base())); }

TEST(VerifierTest, AcceptsAHandWrittenGroupedExchange) {
  Plan plan = withStreams(R"(
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1#0 0RECV_B0#0 0B0 0RECV_B1 0B1 OPTIMIZER_STEP
    rank 1: 1RECV_F0 1F0 1B0 1SEND_B0#0 1RECV_F1#0 1F1 1B1 1SEND_B1 OPTIMIZER_STEP
  )");
  EXPECT_FALSE(verifyPlan(plan));
}

/// A plan broken through its streams, and what the verifier's finding says of it.
struct Rejection {
  const char *name;
  const char *streams;
  std::vector<const char *> says;
};

const Rejection kRejections[] = {
    {"BackwardBeforeItsForward",
     R"(
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 OPTIMIZER_STEP
    rank 1: 1RECV_F0 1RECV_F1 1B0 1F0 1SEND_B0 1F1 1B1 1SEND_B1 OPTIMIZER_STEP
    )",
     {"rank 1 step 2 (1B0)", "runs before its input 1F0", "<-- here (rank 1)"}},
    {"AMissingRecv",
     R"(
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 OPTIMIZER_STEP
    rank 1: 1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1 OPTIMIZER_STEP
    )",
     {"rank 1 step 2 (1F1)", "no recv of it precedes it", "<-- here"}},
    // Rank 0 sends microbatch 1 before 0; rank 1 expects 0 first: NCCL would swap them.
    {"FifoSwappedSends",
     R"(
    rank 0: 0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1 OPTIMIZER_STEP
    rank 1: 1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1 OPTIMIZER_STEP
    )",
     {"FIFO mismatch between rank 0 and rank 1",
      "activation(0,1,0) on the sender (rank 0 step 2: 0SEND_F1)",
      "activation(0,0,0) on the receiver (rank 1 step 0: 1RECV_F0)",
      "*0SEND_F1       1F0  <-- here (rank 0)", "*1RECV_F0  <-- here (rank 1)"}},
    // Both ranks send before they receive, each op on its own: NCCL hangs (nccl#479).
    {"AnUngroupedSendSendDeadlockAndNamesTheCycle",
     R"(
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 OPTIMIZER_STEP
    rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 OPTIMIZER_STEP
    )",
     {"deadlock", "cycle: rank 0 -> rank 1 -> rank 0",
      "rank 0 is stuck at step 3 (0SEND_F1) ungrouped: waits for rank 1 to post step 4 (1RECV_F1)",
      "rank 1 is stuck at step 3 (1SEND_B0) ungrouped: waits for rank 0 to post step 4 (0RECV_B0)",
      "<-- here (rank 0, 1)"}},
    {"ASendBeforeItsProducer",
     R"(
    rank 0: 0SEND_F0 0F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 OPTIMIZER_STEP
    rank 1: 1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1 OPTIMIZER_STEP
    )",
     {"rank 0 step 0 (0SEND_F0): sends activation(0,0,0) before its producer"}},
    {"AMissingBackward",
     R"(
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 OPTIMIZER_STEP
    rank 1: 1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1 OPTIMIZER_STEP
    )",
     {"0B1 is missing"}},
    {"AComputeOpOnTheWrongRank",
     R"(
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 1F0 OPTIMIZER_STEP
    rank 1: 1RECV_F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1 OPTIMIZER_STEP
    )",
     {"rank 0 step 8 (1F0): stage 1 lives on rank 1, not here"}},
    {"ADuplicateForward",
     R"(
    rank 0: 0F0 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 OPTIMIZER_STEP
    rank 1: 1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1 OPTIMIZER_STEP
    )",
     {"rank 0 step 1 (0F0): appears twice"}},
    {"AMissingOptimizerStep",
     R"(
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
    rank 1: 1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1 OPTIMIZER_STEP
    )",
     {"no optimizer step"}},
    {"ARecvThatNoRankSends",
     R"(
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 OPTIMIZER_STEP
    rank 1: 1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 OPTIMIZER_STEP
    )",
     {"never sends gradient(1,1,0) that rank 0 receives at step 6"}},
};

class VerifierRejects : public ::testing::TestWithParam<Rejection> {};

TEST_P(VerifierRejects, TheBrokenPlanAndSaysWhere) {
  std::string msg = errorText(verifyPlan(withStreams(GetParam().streams)));
  for (const char *text : GetParam().says)
    EXPECT_NE(msg.find(text), std::string::npos) << text << "\n  missing from:\n" << msg;
}

INSTANTIATE_TEST_SUITE_P(Plans, VerifierRejects, ::testing::ValuesIn(kRejections),
                         [](const auto &info) { return std::string(info.param.name); });

} // namespace
} // namespace pipec::test

namespace pipec::test {
namespace {

TEST(VerifierTest, LongGridsShowOnlyTheRowsNearTheFinding) {
  Plan plan = compileOrFail(uniformModel(4), options("1f1b", 4, 64));
  // Drop the last forward's recv on rank 3: found near the end of a ~400-step stream.
  auto &s3 = plan.ranks[3];
  for (size_t n = s3.size(); n-- > 0;)
    if (s3[n].op == OpKind::Recv && s3[n].mb == 63) {
      s3.erase(s3.begin() + long(n));
      break;
    }
  std::string msg = errorText(verifyPlan(plan));
  EXPECT_NE(msg.find("3F63"), std::string::npos) << msg;
  EXPECT_NE(msg.find("...\n"), std::string::npos) << msg;
  EXPECT_LT(std::count(msg.begin(), msg.end(), '\n'), 30) << msg;
}

} // namespace
} // namespace pipec::test
