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

bool consumeNumber(llvm::StringRef &s, int32_t &out) {
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
  if (!consumeNumber(s, i.mb))
    return false;
  i.slice = 0;
  if (s.consume_front(".") && !consumeNumber(s, i.slice))
    return false;
  if (allowParts && s.consume_front(":")) {
    if (!consumeNumber(s, i.part) || !s.consume_front("/") || !consumeNumber(s, i.parts))
      return false;
  }
  if (allowGroup && s.consume_front("#") && !consumeNumber(s, i.group))
    return false;
  return s.empty();
}

/// The lexer's error: what was expected (parseToken adds the rank and the token).
static llvm::Error lexError(llvm::StringRef why) { return inputError("{}", why.str()); }

llvm::Expected<Instruction> lexToken(llvm::StringRef token) {
  Instruction i;
  llvm::StringRef s = token;
  if (s == "OPTIMIZER_STEP") {
    i.op = OpKind::OptimizerStep;
    return i;
  }
  int32_t stage = 0;
  if (!consumeNumber(s, stage))
    return lexError("expected a stage number first");
  i.stage = stage;
  if (s.consume_front("ALLREDUCE_")) {
    i.op = OpKind::AllReduce;
    if (s == "DP" || s == "EMB") {
      i.collective = s == "DP" ? CollectiveGroup::Dp : CollectiveGroup::Embedding;
      return i;
    }
    if (!s.consume_front("TP_") || s.empty())
      return lexError("expected ALLREDUCE_DP, ALLREDUCE_EMB or ALLREDUCE_TP_<F|I|B>");
    i.collective = CollectiveGroup::Tp;
    char letter = s.front();
    s = s.drop_front();
    i.phase = letter == 'F'   ? OpKind::Forward
              : letter == 'I' ? OpKind::BackwardInput
                              : OpKind::Backward;
    if ((letter != 'F' && letter != 'I' && letter != 'B') || !eatMbTail(s, i, true, false) ||
        i.part < 0)
      return lexError("expected <s>ALLREDUCE_TP_<F|I|B><mb>[.<k>]:<part>/<parts>");
  } else if (bool send = s.consume_front("SEND_"); send || s.consume_front("RECV_")) {
    i.op = send ? OpKind::Send : OpKind::Recv;
    bool act;
    if (s.consume_front("F"))
      act = true;
    else if (s.consume_front("B"))
      act = false;
    else
      return lexError("expected SEND_F, SEND_B, RECV_F or RECV_B");
    i.tensor = act ? TensorKind::Activation : TensorKind::Gradient;
    if (!eatMbTail(s, i, false, true))
      return lexError("expected <mb>[.<slice>][#<group>] after the comm kind");
    // Back to the producer's stage (see formatToken).
    i.stage = send ? stage : (act ? stage - 1 : stage + 1);
  } else {
    if (s.empty())
      return lexError("expected an op letter after the stage");
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
      return lexError("expected F, I, W, B, SEND_, RECV_ or ALLREDUCE_ after the stage");
    }
    if (!eatMbTail(s, i, true, false))
      return lexError("expected <mb>[.<slice>][:<part>/<parts>] after the op letter");
  }
  if (i.part >= 0 && i.part >= i.parts)
    return lexError("part must be below parts");
  return i;
}

llvm::Expected<Instruction> parseToken(const Plan &plan, int rank, llvm::StringRef token) {
  auto bad = [&](const std::string &why) {
    return inputError("rank {}: token '{}': {}", rank, token.str(), why);
  };
  auto lexed = lexToken(token);
  if (!lexed)
    return bad(takeMessage(lexed.takeError()));
  Instruction i = *lexed;
  int numStages = plan.numStages();
  if (i.op == OpKind::OptimizerStep)
    return i;
  // Sends and recvs are checked at the producer's stage, as the plan holds them.
  if (i.stage < 0 || i.stage >= numStages)
    return bad(fmt::format("stage outside 0..{}", numStages - 1));
  if (i.mb >= plan.parallel.microbatches && i.mb >= 0)
    return bad(fmt::format("microbatch outside 0..{}", plan.parallel.microbatches - 1));
  if (i.slice >= plan.numSlices())
    return bad(fmt::format("slice outside 0..{}", plan.numSlices() - 1));
  switch (i.op) {
  case OpKind::AllReduce:
    switch (i.collective) {
    case CollectiveGroup::Dp:
      i.bytes = plan.stages[size_t(i.stage)].paramBytes;
      break;
    case CollectiveGroup::Embedding:
      i.bytes = plan.tiedEmbeddingBytes();
      break;
    case CollectiveGroup::Tp:
      i.bytes = plan.tpAllReduceBytes(i.stage, i.slice, i.phase, i.part);
      break;
    }
    return i;
  case OpKind::Send:
  case OpKind::Recv: {
    bool act = i.tensor == TensorKind::Activation;
    int other = act ? i.stage + 1 : i.stage - 1;
    if (other < 0 || other >= numStages)
      return bad("names a stage that has no peer in that direction");
    bool send = i.op == OpKind::Send;
    i.peer = send ? plan.rankOf(other) : plan.rankOf(i.stage);
    // The gradient of stage s is the gradient of stage s-1's output: same shape.
    i.bytes = act ? plan.stages[size_t(i.stage)].outputBytes[size_t(i.slice)]
                  : plan.stages[size_t(other)].outputBytes[size_t(i.slice)];
    return i;
  }
  default:
    return i;
  }
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
    if (!consumeNumber(digits, rank) || !digits.empty() || size_t(rank) >= ranks.size())
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
