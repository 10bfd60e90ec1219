#include "ir/PlanText.h"

#include "ir/support/Error.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"

#include <algorithm>

namespace pipec {

static std::string sliceSuffix(const Plan &plan, const Instruction &i) {
  return plan.numSlices() > 1 ? fmt::format(".{}", i.slice) : std::string();
}

static std::string partSuffix(const Instruction &i) {
  return i.part >= 0 ? fmt::format(":{}/{}", i.part, i.parts) : std::string();
}

static char phaseLetter(OpKind phase) { return computeLetter(phase); }

std::string formatToken(const Plan &plan, const Instruction &i) {
  switch (i.op) {
  case OpKind::Forward:
  case OpKind::BackwardInput:
  case OpKind::BackwardWeight:
  case OpKind::Backward:
    return fmt::format("{}{}{}{}{}", i.stage, computeLetter(i.op), i.mb, sliceSuffix(plan, i),
                       partSuffix(i));
  case OpKind::Send:
  case OpKind::Recv: {
    bool act = i.tensor == TensorKind::Activation;
    bool send = i.op == OpKind::Send;
    // PyTorch names the stage that acts: the producer sends, the consumer receives.
    int stage = send ? i.stage : (act ? i.stage + 1 : i.stage - 1);
    std::string group = i.group != kNoGroup ? fmt::format("#{}", i.group) : std::string();
    return fmt::format("{}{}_{}{}{}{}", stage, send ? "SEND" : "RECV", act ? 'F' : 'B', i.mb,
                       sliceSuffix(plan, i), group);
  }
  case OpKind::AllReduce:
    switch (i.collective) {
    case CollectiveGroup::Dp:
      return fmt::format("{}ALLREDUCE_DP", i.stage);
    case CollectiveGroup::Embedding:
      return fmt::format("{}ALLREDUCE_EMB", i.stage);
    case CollectiveGroup::Tp:
      return fmt::format("{}ALLREDUCE_TP_{}{}{}{}", i.stage, phaseLetter(i.phase), i.mb,
                         sliceSuffix(plan, i), partSuffix(i));
    }
    break;
  case OpKind::OptimizerStep:
    return "OPTIMIZER_STEP";
  }
  return "?";
}

/// Consume a non-negative decimal integer.
static bool eatInt(llvm::StringRef &s, int32_t &out) {
  size_t n = 0;
  while (n < s.size() && llvm::isDigit(s[n]))
    ++n;
  if (n == 0 || n > 9)
    return false;
  out = 0;
  for (size_t i = 0; i < n; ++i)
    out = out * 10 + (s[i] - '0');
  s = s.drop_front(n);
  return true;
}

/// Parse "<mb>[.<slice>][:<part>/<parts>][#<group>]" into `i`; what may follow is controlled.
static bool eatMbTail(llvm::StringRef &s, Instruction &i, bool allowParts, bool allowGroup) {
  if (!eatInt(s, i.mb))
    return false;
  i.slice = 0;
  if (s.consume_front(".") && !eatInt(s, i.slice))
    return false;
  if (allowParts && s.consume_front(":")) {
    if (!eatInt(s, i.part) || !s.consume_front("/") || !eatInt(s, i.parts))
      return false;
  }
  if (allowGroup && s.consume_front("#") && !eatInt(s, i.group))
    return false;
  return s.empty();
}

static llvm::Error badToken(int rank, llvm::StringRef token, llvm::StringRef why) {
  return inputError("rank {}: token '{}': {}", rank, token.str(), why.str());
}

llvm::Expected<Instruction> parseToken(const Plan &plan, int rank, llvm::StringRef token) {
  Instruction i;
  llvm::StringRef s = token;
  if (s == "OPTIMIZER_STEP") {
    i.op = OpKind::OptimizerStep;
    return i;
  }
  int32_t stage = 0;
  if (!eatInt(s, stage))
    return badToken(rank, token, "expected a stage number first");
  int numStages = plan.numStages();
  auto checkRange = [&](const Instruction &ins) -> llvm::Error {
    if (ins.stage < 0 || ins.stage >= numStages)
      return badToken(rank, token, fmt::format("stage outside 0..{}", numStages - 1));
    if (ins.mb >= plan.parallel.microbatches && ins.mb >= 0)
      return badToken(rank, token,
                      fmt::format("microbatch outside 0..{}", plan.parallel.microbatches - 1));
    if (ins.slice >= plan.numSlices())
      return badToken(rank, token, fmt::format("slice outside 0..{}", plan.numSlices() - 1));
    if (ins.part >= 0 && ins.part >= ins.parts)
      return badToken(rank, token, "part must be below parts");
    return llvm::Error::success();
  };
  if (s.consume_front("ALLREDUCE_")) {
    i.op = OpKind::AllReduce;
    i.stage = stage;
    if (s == "DP" || s == "EMB") {
      i.collective = s == "DP" ? CollectiveGroup::Dp : CollectiveGroup::Embedding;
      if (auto err = checkRange(i))
        return err;
      i.bytes = i.collective == CollectiveGroup::Dp ? plan.stages[size_t(stage)].paramBytes
                                                    : plan.tiedEmbeddingBytes();
      return i;
    }
    if (!s.consume_front("TP_") || s.empty())
      return badToken(rank, token, "expected ALLREDUCE_DP, ALLREDUCE_EMB or ALLREDUCE_TP_<F|I|B>");
    i.collective = CollectiveGroup::Tp;
    char letter = s.front();
    s = s.drop_front();
    i.phase = letter == 'F'   ? OpKind::Forward
              : letter == 'I' ? OpKind::BackwardInput
                              : OpKind::Backward;
    if ((letter != 'F' && letter != 'I' && letter != 'B') || !eatMbTail(s, i, true, false) ||
        i.part < 0)
      return badToken(rank, token, "expected <s>ALLREDUCE_TP_<F|I|B><mb>[.<k>]:<part>/<parts>");
    if (auto err = checkRange(i))
      return err;
    i.bytes = plan.tpAllReduceBytes(stage, i.slice, i.phase, i.part);
    return i;
  }
  bool send = s.consume_front("SEND_"), recv = !send && s.consume_front("RECV_");
  if (send || recv) {
    i.op = send ? OpKind::Send : OpKind::Recv;
    bool act;
    if (s.consume_front("F"))
      act = true;
    else if (s.consume_front("B"))
      act = false;
    else
      return badToken(rank, token, "expected SEND_F, SEND_B, RECV_F or RECV_B");
    i.tensor = act ? TensorKind::Activation : TensorKind::Gradient;
    if (!eatMbTail(s, i, false, true))
      return badToken(rank, token, "expected <mb>[.<slice>][#<group>] after the comm kind");
    // Back to the producer's stage (see formatToken).
    i.stage = send ? stage : (act ? stage - 1 : stage + 1);
    if (auto err = checkRange(i))
      return err;
    int other = act ? i.stage + 1 : i.stage - 1;
    if (other < 0 || other >= numStages)
      return badToken(rank, token, "names a stage that has no peer in that direction");
    const StageInfo &producer = plan.stages[size_t(i.stage)];
    i.peer = send ? plan.rankOf(other) : plan.rankOf(i.stage);
    // The gradient of stage s is the gradient of stage s-1's output: same shape.
    i.bytes = act ? producer.outputBytes[size_t(i.slice)]
                  : plan.stages[size_t(other)].outputBytes[size_t(i.slice)];
    return i;
  }
  if (s.empty())
    return badToken(rank, token, "expected an op letter after the stage");
  char letter = s.front();
  s = s.drop_front();
  switch (letter) {
  case 'F':
    i.op = OpKind::Forward;
    break;
  case 'I':
    i.op = OpKind::BackwardInput;
    break;
  case 'W':
    i.op = OpKind::BackwardWeight;
    break;
  case 'B':
    i.op = OpKind::Backward;
    break;
  default:
    return badToken(rank, token, "expected F, I, W, B, SEND_, RECV_ or ALLREDUCE_ after the stage");
  }
  i.stage = stage;
  if (!eatMbTail(s, i, true, false))
    return badToken(rank, token, "expected <mb>[.<slice>][:<part>/<parts>] after the op letter");
  if (auto err = checkRange(i))
    return err;
  return i;
}

std::string formatStreams(const Plan &plan, bool computeOnly) {
  std::string out;
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    out += fmt::format("rank {}:", r);
    for (const Instruction &i : plan.ranks[r]) {
      if (computeOnly && !i.isCompute())
        continue;
      out += ' ';
      out += formatToken(plan, i);
    }
    out += '\n';
  }
  return out;
}

llvm::Error parseStreams(llvm::StringRef text, Plan &plan) {
  std::vector<std::vector<Instruction>> ranks(size_t(plan.parallel.pp));
  std::vector<bool> seen(ranks.size(), false);
  llvm::SmallVector<llvm::StringRef, 64> lines;
  text.split(lines, '\n', -1, false);
  for (llvm::StringRef line : lines) {
    line = line.trim();
    if (line.empty() || line.startswith("//"))
      continue;
    if (!line.consume_front("rank "))
      return inputError("stream text: expected a line 'rank N: tokens...', got '{}'", line.str());
    auto [num, rest] = line.split(':');
    int32_t rank = 0;
    llvm::StringRef digits = num.trim();
    if (!eatInt(digits, rank) || !digits.empty() || size_t(rank) >= ranks.size())
      return inputError("stream text: 'rank {}': expected a rank in 0..{}", num.trim().str(),
                        ranks.size() - 1);
    if (seen[size_t(rank)])
      return inputError("stream text: rank {} appears twice", rank);
    seen[size_t(rank)] = true;
    llvm::SmallVector<llvm::StringRef, 64> tokens;
    llvm::SplitString(rest, tokens);
    for (llvm::StringRef tok : tokens) {
      auto ins = parseToken(plan, rank, tok);
      if (!ins)
        return ins.takeError();
      ranks[size_t(rank)].push_back(*ins);
    }
  }
  plan.ranks = std::move(ranks);
  return llvm::Error::success();
}

std::string formatGrid(const Plan &plan, llvm::ArrayRef<GridMark> marks, bool computeOnly) {
  size_t numRanks = plan.ranks.size();
  // Columns hold the (optionally filtered) tokens; remember each full-stream step's row.
  std::vector<std::vector<std::string>> cols(numRanks);
  std::vector<std::vector<size_t>> rowOfStep(numRanks);
  size_t width = 6, rows = 0;
  for (size_t r = 0; r < numRanks; ++r) {
    for (const Instruction &i : plan.ranks[r]) {
      rowOfStep[r].push_back(cols[r].size());
      if (computeOnly && !i.isCompute())
        continue;
      cols[r].push_back(formatToken(plan, i));
      width = std::max(width, cols[r].back().size());
    }
    rowOfStep[r].push_back(cols[r].size()); // one past the end: a rank that finished
    rows = std::max(rows, cols[r].size());
  }
  std::vector<std::string> rowNotes(rows + 1);
  std::vector<std::vector<bool>> starred(numRanks, std::vector<bool>(rows + 1, false));
  for (const GridMark &m : marks) {
    if (m.rank < 0 || size_t(m.rank) >= numRanks)
      continue;
    const auto &steps = rowOfStep[size_t(m.rank)];
    size_t row = steps[std::min(m.step, steps.size() - 1)];
    starred[size_t(m.rank)][row] = true;
    rowNotes[row] += rowNotes[row].empty() ? "  <-- here (rank " : ", ";
    rowNotes[row] += std::to_string(m.rank);
  }
  size_t totalRows = rows + (rowNotes[rows].empty() ? 0 : 1);
  size_t stepDigits = std::to_string(totalRows).size();
  // A long grid with marks shows only the rows near them (a diagnostic must stay readable).
  constexpr size_t kContext = 6, kLongGrid = 48;
  std::vector<bool> shown(totalRows, true);
  if (!marks.empty() && totalRows > kLongGrid) {
    std::fill(shown.begin(), shown.end(), false);
    for (size_t row = 0; row < totalRows; ++row) {
      if (rowNotes[row].empty())
        continue;
      size_t lo = row > kContext ? row - kContext : 0;
      size_t hi = std::min(totalRows, row + kContext + 1);
      std::fill(shown.begin() + long(lo), shown.begin() + long(hi), true);
    }
  }
  std::string out = std::string(stepDigits + 7, ' ');
  for (size_t r = 0; r < numRanks; ++r)
    out += fmt::format(" {:<{}}", fmt::format("rank {}", r), width + 1);
  out = llvm::StringRef(out).rtrim().str() + "\n";
  for (size_t row = 0; row < totalRows; ++row) {
    if (!shown[row]) {
      if (row == 0 || shown[row - 1])
        out += "...\n";
      continue;
    }
    std::string line = fmt::format("step {:0{}}:", row, stepDigits);
    for (size_t r = 0; r < numRanks; ++r) {
      std::string cell = row < cols[r].size() ? cols[r][row] : "";
      if (starred[r][row])
        cell = "*" + (cell.empty() ? std::string("(end)") : cell);
      line += fmt::format(" {:<{}}", cell, width + 1);
    }
    line = llvm::StringRef(line).rtrim().str();
    if (!rowNotes[row].empty())
      line += rowNotes[row] + ")";
    out += line + "\n";
  }
  return out;
}

} // namespace pipec
