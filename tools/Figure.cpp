//===- Figure.cpp - The papers' schedule figure, as SVG -------------------===//
#include "tools/Figure.h"

#include "ir/PlanText.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace pipec {
namespace {

// Geometry, in pixels.
constexpr double kLeft = 70;       // rank labels
constexpr double kRight = 24;      // room for the last tick label
constexpr double kTop = 52;        // title and subtitle
constexpr double kRowHeight = 26;  // one rank: its box, its collective lane, a gap
constexpr double kBoxHeight = 18;  // compute boxes
constexpr double kLaneHeight = 3;  // dp/embedding all-reduces, under the boxes
constexpr double kAxisHeight = 34; // ticks and their labels
constexpr double kLegendRow = 20;
constexpr double kMinPlotWidth = 960;
constexpr double kMaxPlotWidth = 24000;
constexpr double kCharWidth = 6.2; // a digit of the 10 px sans-serif labels, about
constexpr double kLabelPad = 4;

// Colours (Tableau 10, which stays apart for most colour-blind readers).
struct Kind {
  const char *cls, *fill, *text, *legend;
};
const Kind kForward{"F", "#4e79a7", "#ffffff", "F: forward"};
const Kind kFused{"B", "#f28e2b", "#000000", "B: backward (input and weight gradient)"};
const Kind kInput{"I", "#59a14f", "#ffffff", "I: backward, input gradient"};
const Kind kWeight{"W", "#b07aa1", "#ffffff", "W: backward, weight gradient"};
const Kind kPairF{"pair-F", "#ff9d9a", "#000000", "F&B: overlapped forward and backward"};
const Kind kPairB{"pair-B", "#e15759", "#ffffff", ""};
constexpr const char *kIdle = "#e6e6e6";
constexpr const char *kTp = "#9c9c9c";
constexpr const char *kDp = "#76b7b2";
constexpr const char *kEmbedding = "#edc948";
constexpr const char *kComm = "#333333";

const Kind &kindOf(OpKind op) {
  switch (op) {
  case OpKind::Forward:
    return kForward;
  case OpKind::BackwardInput:
    return kInput;
  case OpKind::BackwardWeight:
    return kWeight;
  case OpKind::Backward:
    return kFused;
  case OpKind::Send:
  case OpKind::Recv:
  case OpKind::AllReduce:
  case OpKind::OptimizerStep:
    break;
  }
  return kForward;
}

/// Mix `hex` (#rrggbb) with white: 0 keeps it, 1 is white.
std::string lighten(const char *hex, double amount) {
  unsigned v = unsigned(std::stoul(std::string(hex + 1), nullptr, 16));
  auto mix = [&](unsigned c) { return unsigned(std::lround(c + (255.0 - c) * amount)); };
  return fmt::format("#{:02x}{:02x}{:02x}", mix((v >> 16) & 255), mix((v >> 8) & 255),
                     mix(v & 255));
}

/// Which of its rank's chunks a stage is (0 for the first), under the plan's placement.
int chunkOf(const Plan &plan, int stage) {
  int p = plan.parallel.pp;
  return plan.placement == Placement::VShape ? (stage < p ? 0 : 1) : stage / p;
}

std::string escapeXml(llvm::StringRef s) {
  std::string out;
  for (char c : s) {
    switch (c) {
    case '&':
      out += "&amp;";
      break;
    case '<':
      out += "&lt;";
      break;
    case '>':
      out += "&gt;";
      break;
    case '"':
      out += "&quot;";
      break;
    default:
      out += c;
    }
  }
  return out;
}

/// A tick step of 1, 2 or 5 times a power of ten, at least `raw`.
double niceStep(double raw) {
  if (!(raw > 0))
    return 1;
  double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw * (1 - 1e-9))
      return m * p;
  return 10 * p;
}

/// A number for a label: no trailing zeros, at most 4 decimals.
std::string number(double v) {
  std::string s = fmt::format("{:.4f}", v);
  while (s.back() == '0')
    s.pop_back();
  if (s.back() == '.')
    s.pop_back();
  return s == "-0" ? "0" : s;
}

/// The compute ops of a rank with their parts merged: [first, last] instruction indices.
struct Op {
  size_t first, last;
};

std::vector<Op> computeOps(const std::vector<Instruction> &stream) {
  std::vector<Op> ops;
  for (size_t i = 0; i < stream.size(); ++i) {
    const Instruction &ins = stream[i];
    if (!ins.isCompute())
      continue;
    if (!ins.isFirstPart() && !ops.empty()) {
      const Instruction &prev = stream[ops.back().first];
      if (prev.op == ins.op && prev.stage == ins.stage && prev.mb == ins.mb &&
          prev.slice == ins.slice) {
        ops.back().last = i;
        continue;
      }
    }
    ops.push_back(Op{i, i});
  }
  return ops;
}

/// A rank's overlapped pairs: role[i] is 1 / 2 for every part of a pair's forward / backward
/// (0 elsewhere); spans[j] the first and last instruction of pair j.
struct Pairs {
  std::vector<int> role;
  std::vector<Op> spans;
};

Pairs overlappedPairs(const Plan &plan, int rank) {
  const auto &stream = plan.ranks[size_t(rank)];
  Pairs out;
  out.role.assign(stream.size(), 0);
  if (plan.placement != Placement::VShape)
    return out;
  std::vector<Op> ops = computeOps(stream);
  for (size_t k = 0; k + 1 < ops.size(); ++k) {
    const Instruction &f = stream[ops[k].first], &b = stream[ops[k + 1].first];
    if (f.op != OpKind::Forward || b.op != OpKind::Backward || f.stage == b.stage)
      continue;
    for (int half = 0; half < 2; ++half)
      for (size_t i = ops[k + size_t(half)].first; i <= ops[k + size_t(half)].last; ++i)
        if (stream[i].isCompute())
          out.role[i] = half + 1;
    out.spans.push_back(Op{ops[k].first, ops[k + 1].last});
    ++k; // a backward belongs to one pair
  }
  return out;
}

/// A compute op's label: its microbatch (.slice with sub-sequences), F or B in front for a part
/// of an overlapped pair (role 1 or 2).
std::string opLabel(const Plan &plan, const Instruction &ins, int role) {
  std::string label = fmt::format("{}", ins.mb);
  if (plan.numSlices() > 1)
    label += fmt::format(".{}", ins.slice);
  if (role != 0)
    label = std::string(1, ins.op == OpKind::Forward ? 'F' : 'B') + label;
  return label;
}

/// One figure, written section by section into `svg`.
class Figure {
public:
  Figure(const Plan &plan, const Timeline &timeline) : plan(plan), timeline(timeline) {
    summarizeTimeline(plan, timeline, stats);
  }

  std::string write() {
    measure();
    layOut();
    svg.reserve(size_t(plan.numInstructions()) * 160 + 4096);
    writeHeader();
    writeAxis();
    writeRows();
    svg += "<g class=\"ops\" font-size=\"10\">\n";
    for (int r = 0; r < plan.numRanks(); ++r)
      writeOps(r);
    svg += "</g>\n";
    if (hasComm)
      writeTransfers();
    writeLegend();
    return std::move(svg);
  }

private:
  // What the figure holds; has[]: F, B, I, W, pair, tp, dp, embedding.
  enum Present { kHasF, kHasB, kHasI, kHasW, kHasPair, kHasTp, kHasDp, kHasEmbedding, kNumHas };

  const Plan &plan;
  const Timeline &timeline;
  PlanStats stats;
  double end = 0, shortest = 0;
  int longestLabel = 1;
  bool has[kNumHas] = {};
  bool hasComm = false;
  std::vector<std::vector<OpTime>> collectives;
  std::vector<Pairs> pairs;
  // Geometry.
  double pxPerTime = 1, plotWidth = 0, width = 0, height = 0, rowsBottom = 0, legendTop = 0;
  int perRow = 1;
  static constexpr double kLegendEntryWidth = 290;
  std::string svg;

  double x(double t) const { return kLeft + t * pxPerTime; }
  static double rowTop(int r) { return kTop + r * kRowHeight; }

  /// What is present, how far time runs and the shortest op (the scale follows from it).
  void measure() {
    collectives.resize(plan.ranks.size());
    pairs.resize(plan.ranks.size());
    for (int r = 0; r < plan.numRanks(); ++r) {
      collectives[size_t(r)] = collectiveTimes(plan, timeline, size_t(r));
      pairs[size_t(r)] = overlappedPairs(plan, r);
      const std::vector<int> &role = pairs[size_t(r)].role;
      const auto &stream = plan.ranks[size_t(r)];
      for (size_t i = 0; i < stream.size(); ++i) {
        const Instruction &ins = stream[i];
        const OpTime &t = timeline.ops[size_t(r)][i];
        end = std::max({end, t.end, collectives[size_t(r)][i].end});
        if (ins.isCompute()) {
          double d = t.end - t.start;
          if (d > 0 && (shortest == 0 || d < shortest))
            shortest = d;
          longestLabel = std::max(longestLabel, int(opLabel(plan, ins, role[i]).size()));
          if (role[i] != 0)
            has[kHasPair] = true;
          else
            has[ins.op == OpKind::Forward         ? kHasF
                : ins.op == OpKind::Backward      ? kHasB
                : ins.op == OpKind::BackwardInput ? kHasI
                                                  : kHasW] = true;
        } else if (ins.op == OpKind::AllReduce) {
          has[ins.collective == CollectiveGroup::Tp   ? kHasTp
              : ins.collective == CollectiveGroup::Dp ? kHasDp
                                                      : kHasEmbedding] = true;
        } else if (ins.op == OpKind::Send) {
          hasComm = true;
        }
      }
    }
    if (!(end > 0))
      end = 1;
  }

  /// Scale: the shortest op wide enough for its label, within the plot's limits; the legend
  /// runs in rows as wide as the figure (at least the minimum width).
  void layOut() {
    double labelWidth = longestLabel * kCharWidth + kLabelPad;
    pxPerTime = shortest > 0 ? labelWidth / shortest : kMinPlotWidth / end;
    pxPerTime = std::clamp(pxPerTime, kMinPlotWidth / end, kMaxPlotWidth / end);
    plotWidth = end * pxPerTime;
    width = kLeft + plotWidth + kRight;
    rowsBottom = kTop + plan.numRanks() * kRowHeight;
    legendTop = rowsBottom + kAxisHeight;
    perRow = std::max(1, int((std::max(width, kLeft + kMinPlotWidth) - kLeft) / kLegendEntryWidth));
    int legendRows = (int(legendEntries().size()) + perRow - 1) / perRow;
    height = legendTop + legendRows * kLegendRow + 10;
  }

  /// The root element, the background and the title: the configuration and what the simulator
  /// says of it.
  void writeHeader() {
    svg += fmt::format(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
        "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"{:.0f}\" "
        "height=\"{:.0f}\" viewBox=\"0 0 {:.0f} {:.0f}\" data-time-x0=\"{}\" "
        "data-px-per-time=\"{}\" data-time-unit=\"{}\" font-family=\"DejaVu Sans, Helvetica, "
        "Arial, sans-serif\">\n",
        std::ceil(width), std::ceil(height), std::ceil(width), std::ceil(height), kLeft,
        fmt::format("{:.17g}", pxPerTime), escapeXml(plan.timeUnit));
    svg += fmt::format("<rect class=\"background\" x=\"0\" y=\"0\" width=\"{:.0f}\" "
                       "height=\"{:.0f}\" fill=\"#ffffff\"/>\n",
                       std::ceil(width), std::ceil(height));
    const ParallelConfig &pc = plan.parallel;
    std::string config =
        fmt::format("pp={} vpp={} microbatches={}", pc.pp, pc.vpp, pc.microbatches);
    if (pc.seqSplits > 1)
      config += fmt::format(" seq-splits={}", pc.seqSplits);
    if (pc.tp > 1)
      config += fmt::format(" tp={}", pc.tp);
    if (pc.cp > 1)
      config += fmt::format(" cp={}", pc.cp);
    if (pc.dp > 1)
      config += fmt::format(" dp={}", pc.dp);
    svg += fmt::format("<text class=\"title\" x=\"{}\" y=\"20\" font-size=\"15\" "
                       "font-weight=\"bold\">{} on {} ({})</text>\n",
                       kLeft, escapeXml(plan.schedule), escapeXml(plan.model), escapeXml(config));
    svg += fmt::format("<text class=\"subtitle\" x=\"{}\" y=\"38\" font-size=\"12\">simulated: "
                       "makespan {} {}, bubble ratio {:.4f}, step time {} {}</text>\n",
                       kLeft, number(stats.makespan), escapeXml(plan.timeUnit), stats.bubbleRatio,
                       number(stats.stepTime), escapeXml(plan.timeUnit));
  }

  /// Time axis: ticks every 1, 2 or 5 x 10^k units, about every 90 px, with faint grid lines
  /// behind the rows (so idle time stays one even grey).
  void writeAxis() {
    const double step = niceStep(90 / pxPerTime);
    svg += "<g class=\"axis\" font-size=\"10\">\n";
    svg += fmt::format("<line x1=\"{}\" y1=\"{:.2f}\" x2=\"{:.2f}\" y2=\"{:.2f}\" "
                       "stroke=\"#000000\" stroke-width=\"1\"/>\n",
                       kLeft, rowsBottom, x(end), rowsBottom);
    for (int k = 0; k * step <= end * (1 + 1e-12); ++k) {
      double t = k * step;
      svg += fmt::format("<line x1=\"{0:.2f}\" y1=\"{1:.2f}\" x2=\"{0:.2f}\" y2=\"{2:.2f}\" "
                         "stroke=\"#d0d0d0\" stroke-width=\"0.5\"/>\n",
                         x(t), kTop - 4, rowsBottom);
      svg += fmt::format("<line x1=\"{0:.2f}\" y1=\"{1:.2f}\" x2=\"{0:.2f}\" y2=\"{2:.2f}\" "
                         "stroke=\"#000000\" stroke-width=\"1\"/>\n",
                         x(t), rowsBottom, rowsBottom + 5);
      svg += fmt::format("<text x=\"{:.2f}\" y=\"{:.2f}\" text-anchor=\"middle\">{}</text>\n", x(t),
                         rowsBottom + 16, number(t));
    }
    svg += fmt::format("<text class=\"axis-label\" x=\"{:.2f}\" y=\"{:.2f}\" font-size=\"11\" "
                       "text-anchor=\"end\">simulated time ({})</text>\n",
                       x(end), rowsBottom + 30, escapeXml(plan.timeUnit));
    svg += "</g>\n";
  }

  /// Rows: the label and the idle track (what stays grey is the bubble).
  void writeRows() {
    svg += "<g class=\"rows\">\n";
    for (int r = 0; r < plan.numRanks(); ++r) {
      svg += fmt::format("<text class=\"rank-label\" x=\"{}\" y=\"{:.2f}\" font-size=\"11\" "
                         "text-anchor=\"end\">rank {}</text>\n",
                         kLeft - 8, rowTop(r) + kBoxHeight / 2 + 4, r);
      svg += fmt::format("<rect class=\"idle\" data-rank=\"{}\" x=\"{}\" y=\"{:.2f}\" "
                         "width=\"{:.2f}\" height=\"{}\" fill=\"{}\"/>\n",
                         r, kLeft, rowTop(r), plotWidth, kBoxHeight, kIdle);
    }
    svg += "</g>\n";
  }

  /// Rank r's compute boxes, tp all-reduces, its dp/embedding lane and its pairs' outlines.
  void writeOps(int r) {
    const auto &stream = plan.ranks[size_t(r)];
    const double y = rowTop(r);
    // lastPart[i]: for the first part of a compute op, its last part (itself when unsplit).
    std::vector<size_t> lastPart(stream.size(), SIZE_MAX);
    for (const Op &op : computeOps(stream))
      lastPart[op.first] = op.last;
    for (size_t i = 0; i < stream.size(); ++i) {
      const Instruction &ins = stream[i];
      if (ins.isCompute())
        writeComputeBox(r, i, lastPart[i]);
      else if (ins.op == OpKind::AllReduce)
        writeAllReduce(r, i);
    }
    // Overlapped pairs: one outline around each pair's forward and backward.
    for (const Op &span : pairs[size_t(r)].spans) {
      double s = timeline.ops[size_t(r)][span.first].start;
      double e = timeline.ops[size_t(r)][span.last].end;
      svg += fmt::format("<rect class=\"pair\" x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" "
                         "height=\"{}\" fill=\"none\" stroke=\"#000000\" "
                         "stroke-width=\"1.2\"/>\n",
                         x(s), y, (e - s) * pxPerTime, kBoxHeight);
    }
  }

  /// Compute instruction i of rank r: its box, and the op's label over all its parts where it
  /// fits (`lastPart`: the op's last part for its first part, SIZE_MAX for the others).
  void writeComputeBox(int r, size_t i, size_t lastPart) {
    const Instruction &ins = plan.ranks[size_t(r)][i];
    const OpTime &t = timeline.ops[size_t(r)][i];
    const double y = rowTop(r);
    int role = pairs[size_t(r)].role[i];
    const Kind &kind = role == 1 ? kPairF : role == 2 ? kPairB : kindOf(ins.op);
    const int numChunks = plan.parallel.vpp;
    int chunk = chunkOf(plan, ins.stage);
    // A rank's later chunks in a lighter shade of the same colour.
    double light = numChunks > 1 ? 0.45 * chunk / (numChunks - 1) : 0;
    std::string fill = light > 0 ? lighten(kind.fill, light) : std::string(kind.fill);
    const char *text = light > 0.3 ? "#000000" : kind.text;
    double w = (t.end - t.start) * pxPerTime;
    svg += fmt::format(
        "<rect class=\"op {}\" data-rank=\"{}\" data-step=\"{}\" data-start=\"{:.17g}\" "
        "data-end=\"{:.17g}\" x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{}\" "
        "fill=\"{}\" stroke=\"#ffffff\" stroke-width=\"0.5\"><title>{} (rank {}, step {}: "
        "{} to {} {})</title></rect>\n",
        kind.cls, r, i, t.start, t.end, x(t.start), y, w, kBoxHeight, fill,
        escapeXml(formatToken(plan, ins)), r, i, number(t.start), number(t.end),
        escapeXml(plan.timeUnit));
    if (lastPart == SIZE_MAX)
      return;
    std::string label = opLabel(plan, ins, role);
    double opWidth = (timeline.ops[size_t(r)][lastPart].end - t.start) * pxPerTime;
    if (opWidth >= label.size() * kCharWidth + kLabelPad - 0.01)
      svg += fmt::format("<text class=\"label\" x=\"{:.2f}\" y=\"{:.2f}\" "
                         "text-anchor=\"middle\" fill=\"{}\">{}</text>\n",
                         x(t.start) + opWidth / 2, y + kBoxHeight / 2 + 3.5, text, label);
  }

  /// All-reduce i of rank r: a tp one occupies the rank's row; a dp or embedding one is a bar
  /// on the lane under it, over its own stream's times.
  void writeAllReduce(int r, size_t i) {
    const Instruction &ins = plan.ranks[size_t(r)][i];
    const OpTime &t = timeline.ops[size_t(r)][i];
    const double y = rowTop(r);
    std::string token = escapeXml(formatToken(plan, ins));
    if (ins.collective == CollectiveGroup::Tp) {
      svg += fmt::format("<rect class=\"allreduce tp\" data-rank=\"{}\" data-step=\"{}\" "
                         "x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{}\" "
                         "fill=\"{}\"><title>{} (rank {}, step {})</title></rect>\n",
                         r, i, x(t.start), y, (t.end - t.start) * pxPerTime, kBoxHeight, kTp, token,
                         r, i);
      return;
    }
    const OpTime &c = collectives[size_t(r)][i];
    bool dp = ins.collective == CollectiveGroup::Dp;
    svg += fmt::format("<rect class=\"allreduce {}\" data-rank=\"{}\" data-step=\"{}\" "
                       "x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{}\" "
                       "fill=\"{}\"><title>{} (rank {}, step {}: {} to {} {})</title></rect>\n",
                       dp ? "dp" : "embedding", r, i, x(c.start), y + kBoxHeight + 1,
                       std::max(2.0, (c.end - c.start) * pxPerTime), kLaneHeight,
                       dp ? kDp : kEmbedding, token, r, i, number(c.start), number(c.end),
                       escapeXml(plan.timeUnit));
  }

  /// Transfers: from the producer's end on its rank to the arrival on the consumer's rank.
  void writeTransfers() {
    svg += fmt::format("<g class=\"comms\" stroke=\"{}\" stroke-width=\"0.8\" "
                       "stroke-opacity=\"0.55\">\n",
                       kComm);
    for (int r = 0; r < plan.numRanks(); ++r) {
      const auto &stream = plan.ranks[size_t(r)];
      for (size_t i = 0; i < stream.size(); ++i) {
        const Instruction &ins = stream[i];
        if (ins.op != OpKind::Send)
          continue;
        double produced = producedAt(r, i);
        double arrival =
            produced + transferTime(plan.stages[size_t(ins.stage)], ins.tensor, ins.slice);
        int to = ins.peer;
        bool down = to > r;
        double y1 = down ? rowTop(r) + kBoxHeight : rowTop(r);
        double y2 = down ? rowTop(to) : rowTop(to) + kBoxHeight;
        svg += fmt::format("<line class=\"comm\" x1=\"{:.2f}\" y1=\"{:.2f}\" x2=\"{:.2f}\" "
                           "y2=\"{:.2f}\"/>\n",
                           x(produced), y1, x(arrival), y2);
      }
    }
    svg += "</g>\n";
  }

  /// When send i of rank r's tensor was made: the end of the last compute op before it that
  /// produced it (the send's own start where none is found).
  double producedAt(int r, size_t i) const {
    const auto &stream = plan.ranks[size_t(r)];
    const Instruction &ins = stream[i];
    for (size_t j = i; j-- > 0;) {
      const Instruction &p = stream[j];
      if (p.isCompute() && p.stage == ins.stage && p.mb == ins.mb && p.slice == ins.slice &&
          p.isLastPart() &&
          (ins.tensor == TensorKind::Activation
               ? p.op == OpKind::Forward
               : (p.op == OpKind::BackwardInput || p.op == OpKind::Backward)))
        return timeline.ops[size_t(r)][j].end;
    }
    return timeline.ops[size_t(r)][i].start;
  }

  struct Entry {
    std::string swatch; // SVG for a 14 x 12 swatch at (0, 0)
    std::string text;
  };

  /// The legend: the kinds present, in a fixed order, the bubble last.
  std::vector<Entry> legendEntries() const {
    std::vector<Entry> entries;
    auto box = [](const std::string &fill) {
      return fmt::format("<rect x=\"0\" y=\"0\" width=\"14\" height=\"12\" fill=\"{}\"/>", fill);
    };
    auto lane = [](const char *fill) {
      return fmt::format("<rect x=\"0\" y=\"5\" width=\"14\" height=\"{}\" fill=\"{}\"/>",
                         kLaneHeight, fill);
    };
    const Kind *kinds[] = {&kForward, &kFused, &kInput, &kWeight};
    for (int k = kHasF; k <= kHasW; ++k)
      if (has[k])
        entries.push_back({box(kinds[k]->fill), kinds[k]->legend});
    if (has[kHasPair])
      entries.push_back(
          {fmt::format("<rect x=\"0\" y=\"0\" width=\"7\" height=\"12\" "
                       "fill=\"{}\"/><rect x=\"7\" y=\"0\" width=\"7\" height=\"12\" "
                       "fill=\"{}\"/><rect x=\"0\" y=\"0\" width=\"14\" height=\"12\" "
                       "fill=\"none\" stroke=\"#000000\" stroke-width=\"1.2\"/>",
                       kPairF.fill, kPairB.fill),
           kPairF.legend});
    if (plan.parallel.vpp > 1)
      entries.push_back(
          {fmt::format("<rect x=\"0\" y=\"0\" width=\"7\" height=\"12\" fill=\"{}\"/>"
                       "<rect x=\"7\" y=\"0\" width=\"7\" height=\"12\" fill=\"{}\"/>",
                       kForward.fill, lighten(kForward.fill, 0.45)),
           "lighter: a later chunk of the rank"});
    if (has[kHasTp])
      entries.push_back({box(kTp), "tp all-reduce (occupies the rank)"});
    if (has[kHasDp])
      entries.push_back({lane(kDp), "dp all-reduce (own stream)"});
    if (has[kHasEmbedding])
      entries.push_back({lane(kEmbedding), "embedding all-reduce (own stream)"});
    if (hasComm)
      entries.push_back({fmt::format("<line x1=\"0\" y1=\"1\" x2=\"14\" y2=\"11\" "
                                     "stroke=\"{}\" stroke-width=\"1\"/>",
                                     kComm),
                         "transfer: producer's end to arrival"});
    entries.push_back({box(kIdle), "idle: the bubble"});
    return entries;
  }

  void writeLegend() {
    std::vector<Entry> entries = legendEntries();
    svg += "<g class=\"legend\" font-size=\"11\">\n";
    for (size_t e = 0; e < entries.size(); ++e) {
      double ex = kLeft + double(int(e) % perRow) * kLegendEntryWidth;
      double ey = legendTop + double(int(e) / perRow) * kLegendRow;
      svg += fmt::format("<g transform=\"translate({:.2f},{:.2f})\">{}<text x=\"20\" "
                         "y=\"10.5\">{}</text></g>\n",
                         ex, ey, entries[e].swatch, escapeXml(entries[e].text));
    }
    svg += "</g>\n</svg>\n";
  }
};

} // namespace

bool startsOverlappedPair(const Plan &plan, int rank, size_t step) {
  Pairs pairs = overlappedPairs(plan, rank);
  for (const Op &span : pairs.spans)
    if (span.first == step)
      return true;
  return false;
}

std::string scheduleSvg(const Plan &plan, const Timeline &timeline) {
  return Figure(plan, timeline).write();
}

} // namespace pipec
