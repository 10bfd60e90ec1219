//===- TorchCsv.cpp - PyTorch pipelining schedule CSV, both ways ----------===//
#include "compiler/torch/TorchCsv.h"

#include "compiler/LowerCollectives.h"
#include "ir/PlanText.h"
#include "ir/support/Error.h"
#include "ir/support/Limits.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/Sequence.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/ErrorHandling.h"

#include <algorithm>
#include <cassert>
#include <map>
#include <tuple>

namespace pipec {

llvm::StringRef toString(TorchCsvForm form) {
  switch (form) {
  case TorchCsvForm::ComputeOnly:
    return "torch-csv";
  case TorchCsvForm::ComputeComms:
    return "torch-csv-comms";
  }
  llvm_unreachable("unknown TorchCsvForm");
}

bool torchCsvFormFromString(llvm::StringRef name, TorchCsvForm &out) {
  for (TorchCsvForm f : {TorchCsvForm::ComputeOnly, TorchCsvForm::ComputeComms}) {
    if (toString(f) == name) {
      out = f;
      return true;
    }
  }
  return false;
}

//===----------------------------------------------------------------------===//
// Writing
//===----------------------------------------------------------------------===//

llvm::Error checkTorchExpressible(const Plan &plan, bool tiedByCaller) {
  const ParallelConfig &pc = plan.parallel;
  if (pc.seqSplits > 1)
    return inputError("PyTorch's schedule CSV cannot express sub-sequences (this plan has "
                      "--seq-splits {}); compile with --seq-splits 1",
                      pc.seqSplits);
  if (pc.tp > 1)
    return inputError("PyTorch's schedule CSV cannot express tensor-parallel parts and their "
                      "all-reduces (this plan has --tp {}); compile with --tp 1",
                      pc.tp);
  if (plan.tiedEmbeddings() && !tiedByCaller)
    return inputError("PyTorch's schedule CSV cannot express the all-reduce of tied embeddings "
                      "between the first and the last stage; set \"tie_embeddings\": false in "
                      "the model, or compile with --pp 1 --vpp 1");
  // Loop and V are the only placements a plan has (Placement); PyTorch infers both from the
  // rows, so there is nothing else to refuse.
  return llvm::Error::success();
}

std::vector<bool> overlappedPairStarts(const Plan &plan, int rank,
                                       const std::vector<Instruction> &compute) {
  std::vector<bool> starts(compute.size(), false);
  if (plan.schedule != "dualpipe-v")
    return starts;
  // DualPipeV's steady state runs a forward of one chunk with a fused backward of the other.
  // PyTorch's ScheduleDualPipeV leaves the very first such pair of the last rank unpaired (to
  // shorten its bubble), so the export does too.
  bool skipFirst = rank == plan.parallel.pp - 1;
  for (size_t i = 0; i + 1 < compute.size(); ++i) {
    const Instruction &f = compute[i], &b = compute[i + 1];
    if (f.op != OpKind::Forward || b.op != OpKind::Backward || f.stage == b.stage)
      continue;
    if (skipFirst) {
      skipFirst = false;
      continue;
    }
    starts[i] = true;
    ++i; // the backward cannot start another pair
  }
  return starts;
}

namespace {

std::string computeCell(const Instruction &i) {
  return fmt::format("{}{}{}", i.stage, computeLetter(i.op), i.mb);
}

std::string pairCell(const Instruction &f, const Instruction &b) {
  return fmt::format("({};{})OVERLAP_F_B", computeCell(f), computeCell(b));
}

/// PyTorch's names for a send or recv: the stage that acts (the producer sends, the consumer
/// receives) and F for activations, B for gradients.
std::string p2pCell(const Instruction &i) {
  bool act = i.tensor == TensorKind::Activation;
  bool send = i.op == OpKind::Send;
  int stage = send ? i.stage : (act ? i.stage + 1 : i.stage - 1);
  return fmt::format("{}{}_{}{}", stage, send ? "SEND" : "RECV", act ? 'F' : 'B', i.mb);
}

std::string joinRow(llvm::ArrayRef<std::string> cells) {
  std::string row = llvm::join(cells.begin(), cells.end(), ",");
  return row + "\r\n";
}

/// Stages that FSDP keeps unsharded before each compute action of a rank, as PyTorch's
/// _add_unshard_reshard decides them: scanning forward from the action, the first `window`
/// distinct stages in order of appearance (an action's stages all together).
std::vector<llvm::SmallVector<int, 4>>
residentStages(const std::vector<llvm::SmallVector<int, 2>> &actions, size_t window) {
  std::vector<llvm::SmallVector<int, 4>> resident(actions.size());
  // Next action index holding each stage, and its position inside that action.
  std::map<int, std::pair<size_t, size_t>> next;
  for (size_t a = actions.size(); a-- > 0;) {
    for (size_t k = 0; k < actions[a].size(); ++k) {
      int s = actions[a][k];
      auto it = next.find(s);
      // Within one action the first sub-action naming a stage is where it appears.
      if (it == next.end() || it->second.first != a || it->second.second > k)
        next[s] = {a, k};
    }
    llvm::SmallVector<std::tuple<size_t, size_t, int>, 8> order;
    for (auto &[s, pos] : next)
      order.emplace_back(pos.first, pos.second, s);
    std::sort(order.begin(), order.end());
    auto &out = resident[a];
    for (size_t i = 0; i < order.size();) {
      size_t action = std::get<0>(order[i]);
      for (; i < order.size() && std::get<0>(order[i]) == action; ++i)
        out.push_back(std::get<2>(order[i]));
      if (out.size() >= window)
        break;
    }
  }
  return resident;
}

/// One rank's row of the compute+comms form, cell by cell.
class CommsRow {
public:
  CommsRow(const Plan &plan, int rank, bool tiedByCaller)
      : stream(plan.ranks[size_t(rank)]), tiedByCaller(tiedByCaller) {
    for (size_t n = 0; n < stream.size(); ++n)
      if (stream[n].isCompute()) {
        computeAt.push_back(n);
        compute.push_back(stream[n]);
      }
    pairStart = overlappedPairStarts(plan, rank, compute);
    // The compute actions (a pair is one) and where FSDP keeps stages resident before each.
    std::vector<llvm::SmallVector<int, 2>> actionStages;
    for (size_t c = 0; c < compute.size(); ++c) {
      if (pairStart[c]) {
        actionStages.push_back({compute[c].stage, compute[c + 1].stage});
        ++c;
      } else {
        actionStages.push_back({compute[c].stage});
      }
    }
    constexpr size_t kMaxActiveStages = 3; // PyTorch's default max_active_stages
    resident = residentStages(actionStages, kMaxActiveStages);
    // With dp > 1 the plan has its dp all-reduces; with dp = 1 REDUCE_GRAD goes where
    // lower-collectives would put them.
    if (plan.parallel.gradReduceRanks() == 1)
      reduceAt = dpAllReducePoints(stream);
  }

  std::vector<std::string> cellsOf() && {
    size_t action = 0;
    for (size_t c = 0; c < compute.size(); ++c, ++action) {
      size_t n = computeAt[c];
      size_t prev = c == 0 ? 0 : computeAt[c - 1] + 1;
      // Comm ops before this compute op (those after the previous one, in stream order).
      for (size_t k = prev; k < n; ++k) {
        reduceBefore(k);
        nonCompute(stream[k]);
      }
      reduceBefore(n);
      if (pairStart[c]) {
        writePair(c, action);
        ++c;
        continue;
      }
      keepResident(action);
      cells.push_back(computeCell(compute[c]));
      afterCompute(compute[c]);
    }
    size_t tail = computeAt.empty() ? 0 : computeAt.back() + 1;
    for (size_t k = tail; k < stream.size(); ++k) {
      reduceBefore(k);
      nonCompute(stream[k]);
    }
    reduceBefore(stream.size());
    for (int s : active)
      cells.push_back(fmt::format("{}RESHARD", s));
    for (size_t k = 0; k < pendingSends.size(); ++k)
      if (!waited[k])
        cells.push_back(pendingSends[k]);
    return std::move(cells);
  }

private:
  const std::vector<Instruction> &stream;
  const bool tiedByCaller;
  std::vector<size_t> computeAt;
  std::vector<Instruction> compute;
  std::vector<bool> pairStart;
  std::vector<llvm::SmallVector<int, 4>> resident;
  std::vector<llvm::SmallVector<int, 2>> reduceAt;

  std::vector<std::string> cells;
  llvm::SmallVector<int, 4> active;      // unsharded stages, in the order they were fetched
  std::vector<std::string> pendingSends; // waits owed, in the order the sends were issued
  std::map<std::tuple<int, int>, size_t> pendingForward; // (stage, mb) of SEND_F -> index
  std::vector<bool> waited;

  void reduce(int stage) {
    cells.push_back(fmt::format("{}REDUCE_GRAD", stage));
    cells.push_back(fmt::format("{}WAIT_REDUCE_GRAD", stage));
  }

  /// The REDUCE_GRADs that go right before stream[n] (n = stream.size(): after the last op).
  void reduceBefore(size_t n) {
    if (!reduceAt.empty())
      for (int s : reduceAt[n])
        reduce(s);
  }

  void nonCompute(const Instruction &i) {
    switch (i.op) {
    case OpKind::Send: {
      cells.push_back(p2pCell(i));
      bool act = i.tensor == TensorKind::Activation;
      pendingSends.push_back(fmt::format("{}WAIT_SEND_{}{}", i.stage, act ? 'F' : 'B', i.mb));
      waited.push_back(false);
      if (act)
        pendingForward[{i.stage, i.mb}] = pendingSends.size() - 1;
      return;
    }
    case OpKind::Recv:
      cells.push_back(p2pCell(i));
      return;
    case OpKind::AllReduce:
      if (i.collective == CollectiveGroup::Embedding && tiedByCaller)
        return; // the caller sums the tied copies' gradients after the step
      assert(i.collective == CollectiveGroup::Dp && "checkTorchExpressible lets only dp through");
      reduce(i.stage);
      return;
    case OpKind::OptimizerStep:
      return;
    case OpKind::Forward:
    case OpKind::BackwardInput:
    case OpKind::BackwardWeight:
    case OpKind::Backward:
      break;
    }
    llvm_unreachable("compute op in nonCompute");
  }

  void afterCompute(const Instruction &i) {
    if (i.op == OpKind::Backward || i.op == OpKind::BackwardInput) {
      // The local backward of (s, m) consumed the gradient the peer made from our activation,
      // so the send of that activation has completed: retire it here, as PyTorch does.
      auto it = pendingForward.find({i.stage, i.mb});
      if (it != pendingForward.end()) {
        cells.push_back(pendingSends[it->second]);
        waited[it->second] = true;
        pendingForward.erase(it);
      }
    }
  }

  /// FSDP residency before the action, as PyTorch's lowering decides it.
  void keepResident(size_t action) {
    const auto &keep = resident[action];
    llvm::SmallVector<int, 4> stillActive;
    for (int s : active) {
      if (llvm::is_contained(keep, s))
        stillActive.push_back(s);
      else
        cells.push_back(fmt::format("{}RESHARD", s));
    }
    active = stillActive;
    for (int s : keep)
      if (!llvm::is_contained(active, s)) {
        cells.push_back(fmt::format("{}UNSHARD", s));
        active.push_back(s);
      }
  }

  /// The overlapped pair that starts at compute op c (its F, then its B at c + 1).
  void writePair(size_t c, size_t action) {
    // Ops between the pair's F and B: the recv of the B's input goes before the pair (the pair
    // is one action), everything else (the F's sends first) after it, in pipec's order.
    // pipec's streams list every rank's messages in one global order (LowerComms' rounds),
    // which is what keeps them deadlock-free op by op; only the B's input moves ahead of the
    // F's sends, as PyTorch's own ScheduleDualPipeV has it (a pair's B never waits for its F's
    // output).
    const Instruction &b = compute[c + 1];
    size_t n = computeAt[c], m = computeAt[c + 1];
    // Between two compute ops only sends and recvs: nothing to reduce before them or the B.
    assert(llvm::all_of(llvm::seq(n + 1, m + 1),
                        [&](size_t k) { return reduceAt.empty() || reduceAt[k].empty(); }));
    llvm::SmallVector<const Instruction *, 8> after;
    for (size_t k = n + 1; k < m; ++k) {
      const Instruction &op = stream[k];
      bool feedsB = op.op == OpKind::Recv && op.tensor == TensorKind::Gradient &&
                    op.stage == b.stage + 1 && op.mb == b.mb && op.slice == b.slice;
      if (feedsB)
        nonCompute(op);
      else
        after.push_back(&op);
    }
    keepResident(action);
    cells.push_back(pairCell(compute[c], b));
    afterCompute(compute[c]);
    afterCompute(b);
    for (const Instruction *i : after)
      nonCompute(*i);
  }
};

std::vector<std::string> commsRow(const Plan &plan, int rank, bool tiedByCaller) {
  return CommsRow(plan, rank, tiedByCaller).cellsOf();
}

} // namespace

llvm::Expected<std::string> writeTorchCsv(const Plan &plan, TorchCsvForm form, bool tiedByCaller) {
  if (auto err = checkTorchExpressible(plan, tiedByCaller))
    return err;
  std::string out;
  for (int r = 0; r < plan.numRanks(); ++r) {
    if (form == TorchCsvForm::ComputeComms) {
      out += joinRow(commsRow(plan, r, tiedByCaller));
      continue;
    }
    std::vector<Instruction> compute;
    for (const Instruction &i : plan.ranks[size_t(r)])
      if (i.isCompute())
        compute.push_back(i);
    std::vector<bool> pairStart = overlappedPairStarts(plan, r, compute);
    std::vector<std::string> cells;
    for (size_t c = 0; c < compute.size(); ++c) {
      if (pairStart[c]) {
        cells.push_back(pairCell(compute[c], compute[c + 1]));
        ++c;
        continue;
      }
      cells.push_back(computeCell(compute[c]));
    }
    out += joinRow(cells);
  }
  return out;
}

//===----------------------------------------------------------------------===//
// Reading
//===----------------------------------------------------------------------===//

namespace {

/// One PyTorch action: a compute op, or something pipec re-derives (comms, waits, reductions,
/// FSDP residency), which parses to `compute = false`.
struct TorchAction {
  bool compute = false;
  Instruction ins;
};

bool parseTorchAction(llvm::StringRef cell, TorchAction &out) {
  llvm::StringRef s = cell.trim();
  int32_t stage = 0;
  if (!consumeNumber(s, stage))
    return false;
  // PyTorch's own alternation order (_action_regex), longest names first.
  struct Kind {
    const char *name;
    bool needsMb; // false: the action names no microbatch
  } kinds[] = {{"WAIT_REDUCE_GRAD", false},
               {"WAIT_SEND_F", true},
               {"WAIT_SEND_B", true},
               {"REDUCE_GRAD", false},
               {"UNSHARD", false},
               {"RESHARD", false},
               {"SEND_F", true},
               {"RECV_F", true},
               {"SEND_B", true},
               {"RECV_B", true}};
  for (const Kind &k : kinds) {
    if (!s.consume_front(k.name))
      continue;
    int32_t mb = 0;
    if (k.needsMb ? !(consumeNumber(s, mb) && s.empty()) : !s.empty())
      return false;
    out.compute = false;
    return true;
  }
  // A compute action is a compute token of pipec's text form without slice or parts.
  llvm::StringRef token = cell.trim();
  auto ins = lexToken(token);
  if (!ins) {
    llvm::consumeError(ins.takeError());
    return false;
  }
  if (!ins->isCompute() || token.find_first_of(".:") != llvm::StringRef::npos)
    return false;
  out.compute = true;
  out.ins = Instruction::compute(ins->op, ins->stage, ins->mb, 0);
  return true;
}

/// Split one CSV line into cells (RFC 4180 quoting; a quoted cell may not span lines).
bool splitCsvRow(llvm::StringRef line, std::vector<std::string> &cells) {
  cells.clear();
  std::string cell;
  bool quoted = false, wasQuoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < line.size() && line[i + 1] == '"') {
          cell += '"';
          ++i;
        } else {
          quoted = false;
        }
      } else {
        cell += c;
      }
      continue;
    }
    if (c == ',') {
      cells.push_back(cell);
      cell.clear();
      wasQuoted = false;
    } else if (c == '"' && llvm::StringRef(cell).trim().empty() && !wasQuoted) {
      quoted = wasQuoted = true;
      cell.clear();
    } else {
      cell += c;
    }
  }
  if (quoted)
    return false;
  cells.push_back(cell);
  return true;
}

void account(ImportedOrder &out, const Instruction &i) {
  out.numStages = std::max(out.numStages, i.stage + 1);
  out.microbatches = std::max(out.microbatches, i.mb + 1);
  out.seqSplits = std::max(out.seqSplits, i.slice + 1);
}

llvm::Expected<ImportedOrder> parseTorchCsv(llvm::StringRef text, llvm::StringRef source) {
  ImportedOrder out;
  llvm::SmallVector<llvm::StringRef, 16> lines;
  text.split(lines, '\n');
  if (!lines.empty() && lines.back().empty())
    lines.pop_back(); // the line break after the last row ends it; it starts no row
  bool comms = false;
  std::vector<std::string> cells;
  for (size_t r = 0; r < lines.size(); ++r) {
    llvm::StringRef line = lines[r];
    line.consume_back("\r");
    if (!splitCsvRow(line, cells))
      return inputError("{}: row {} (rank {}): a quoted cell is not closed on its line",
                        source.str(), r + 1, r);
    std::vector<Instruction> row;
    // An empty line is a rank with no actions, as Python's csv module reads it.
    if (line.empty())
      cells.clear();
    for (size_t c = 0; c < cells.size(); ++c) {
      llvm::StringRef cell = llvm::StringRef(cells[c]).trim();
      auto bad = [&]() {
        return inputError("{}: row {} (rank {}), column {}: '{}' is not a PyTorch action; "
                          "expected <stage><F|I|W|B><microbatch> such as 0F1, a comm action "
                          "such as 1SEND_F0 or 0REDUCE_GRAD, or (0F3;1B1)OVERLAP_F_B",
                          source.str(), r + 1, r, c + 1, cells[c]);
      };
      if (cell.empty()) {
        ++out.idleCells;
        continue;
      }
      if (cell.consume_front("(")) {
        auto [inner, kind] = cell.split(')');
        if (kind != "OVERLAP_F_B" || inner.trim().empty())
          return bad();
        llvm::SmallVector<llvm::StringRef, 2> parts;
        inner.split(parts, ';');
        for (llvm::StringRef part : parts) {
          TorchAction a;
          if (!parseTorchAction(part, a) || !a.compute)
            return bad();
          account(out, a.ins);
          row.push_back(a.ins);
        }
        ++out.overlappedPairs;
        continue;
      }
      TorchAction a;
      if (!parseTorchAction(cell, a))
        return bad();
      if (!a.compute) {
        comms = true;
        ++out.droppedComms;
        continue;
      }
      account(out, a.ins);
      row.push_back(a.ins);
    }
    out.ranks.push_back(std::move(row));
  }
  out.source = comms ? ImportedOrder::Source::TorchCsvComms : ImportedOrder::Source::TorchCsv;
  return out;
}

llvm::Expected<ImportedOrder> parsePipecText(llvm::StringRef text, llvm::StringRef source) {
  ImportedOrder out;
  out.source = ImportedOrder::Source::PipecText;
  llvm::SmallVector<llvm::StringRef, 16> lines;
  text.split(lines, '\n');
  std::map<int, std::vector<Instruction>> byRank;
  bool sawRank = false;
  for (size_t l = 0; l < lines.size(); ++l) {
    llvm::StringRef line = lines[l].trim();
    if (line.empty() || line.startswith("//"))
      continue;
    if (!line.consume_front("rank ")) {
      // `pipec show --text` starts with a header such as "1f1b on uniform-8: pp=4 ...".
      if (!sawRank && line.contains(": pp="))
        continue;
      return inputError("{}: line {}: expected 'rank N: tokens...' (pipec's text form), got "
                        "'{}'",
                        source.str(), l + 1, lines[l].trim().str());
    }
    sawRank = true;
    auto [num, rest] = line.split(':');
    llvm::StringRef digits = num.trim();
    int32_t rank = 0;
    if (!consumeNumber(digits, rank) || !digits.empty() || !line.contains(':'))
      return inputError("{}: line {}: expected 'rank N:' with a rank number, got '{}'",
                        source.str(), l + 1, lines[l].trim().str());
    if (rank >= kMaxStages)
      return inputError("{}: line {}: rank {} is beyond what pipec plans ({} ranks)", source.str(),
                        l + 1, rank, kMaxStages);
    if (byRank.count(rank))
      return inputError("{}: line {}: rank {} appears twice", source.str(), l + 1, rank);
    std::vector<Instruction> &row = byRank[rank];
    llvm::SmallVector<llvm::StringRef, 64> tokens;
    llvm::SplitString(rest, tokens);
    for (size_t t = 0; t < tokens.size(); ++t) {
      auto ins = lexToken(tokens[t]);
      if (!ins) {
        llvm::consumeError(ins.takeError());
        return inputError("{}: line {} (rank {}), token {}: '{}' is not a pipec token; expected "
                          "<stage><F|I|W|B><microbatch>[.<slice>] such as 0F1, or a comm token "
                          "such as 1SEND_F0 (`pipec show --text` writes them)",
                          source.str(), l + 1, rank, t + 1, tokens[t].str());
      }
      // Comms and collectives are dropped (pipec derives its own); of an op split at tp
      // all-reduces, the first part stands for the whole op.
      if (!ins->isCompute()) {
        ++out.droppedComms;
        continue;
      }
      if (!ins->isFirstPart())
        continue;
      Instruction op = Instruction::compute(ins->op, ins->stage, ins->mb, ins->slice);
      account(out, op);
      row.push_back(op);
    }
  }
  int expect = 0;
  for (auto &[rank, row] : byRank) {
    if (rank != expect)
      return inputError("{}: rank {} is missing (ranks must be numbered 0, 1, ... without gaps)",
                        source.str(), expect);
    out.ranks.push_back(std::move(row));
    ++expect;
  }
  return out;
}

/// pipec's text form has "rank N:" lines; anything else is taken as CSV.
bool looksLikePipecText(llvm::StringRef text) {
  llvm::SmallVector<llvm::StringRef, 16> lines;
  text.split(lines, '\n');
  for (llvm::StringRef line : lines) {
    llvm::StringRef s = line.trim();
    if (!s.consume_front("rank "))
      continue;
    int32_t n = 0;
    if (consumeNumber(s, n) && s.trim().startswith(":"))
      return true;
  }
  return false;
}

} // namespace

llvm::Expected<ImportedOrder> parseSchedule(llvm::StringRef text, llvm::StringRef source) {
  if (looksLikePipecText(text))
    return parsePipecText(text, source);
  return parseTorchCsv(text, source);
}

} // namespace pipec
