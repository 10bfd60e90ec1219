//===- FigureTest.cpp - The schedule figure against the simulator, parsed and rendered ---===//
//
// tools/Figure.h draws the papers' figure of a plan. Three kinds of checks, none of which reads
// the figure's code:
//  - structure: the SVG is read back with libxml2 (a real XML parser); every compute op of the
//    plan has exactly one box, on its rank's row, at the start and of the length the
//    simulator's timeline (simulateTimeline) gives it, coloured by its kind; every send has its
//    transfer line, every dp all-reduce its bar; axis, legend and idle rows are there;
//  - DualPipeV's overlapped F&B pairs: as many as its paper's phases 4 and 5 hold;
//  - rendering: librsvg's rsvg-convert (the renderer of Debian's librsvg2-bin, which
//    tools/setup.sh installs) turns the SVG into a PNG, which the test decodes (zlib) and
//    samples: each box's pixels have its fill colour and a gap in a row the idle grey, so a
//    drawing that renders wrong, or not at all, fails.
// And `pipec compile --svg` / `pipec show --svg` end to end: the file, its errors.
//
//===----------------------------------------------------------------------===//
#include "tests/Command.h"
#include "tests/TestUtil.h"

#include "ir/CostModel.h"
#include "ir/formats/PlanJson.h"
#include "ir/formats/SpecJson.h"
#include "tools/Figure.h"

#include <libxml/parser.h>
#include <libxml/tree.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <sys/stat.h>
#include <vector>

namespace pipec::test {
namespace {

using pipec::testing::runCommand;
using pipec::testing::slurp;
using pipec::testing::tmpDir;

//===----------------------------------------------------------------------===//
// Reading the SVG back
//===----------------------------------------------------------------------===//

/// One element of the document: its name and attributes (text content for <text>).
struct Element {
  std::string name;
  std::map<std::string, std::string> attrs;
  std::string text;
  bool has(const std::string &a) const { return attrs.count(a) > 0; }
  double num(const std::string &a) const { return std::stod(attrs.at(a)); }
  bool hasClass(const std::string &c) const {
    auto it = attrs.find("class");
    if (it == attrs.end())
      return false;
    std::string padded = " " + it->second + " ";
    return padded.find(" " + c + " ") != std::string::npos;
  }
};

struct Document {
  bool parsed = false;
  std::string rootName, rootNamespace;
  Element root;
  std::vector<Element> elements; // document order, the root excluded
};

void collect(xmlNode *node, Document &doc) {
  for (xmlNode *n = node; n; n = n->next) {
    if (n->type != XML_ELEMENT_NODE)
      continue;
    Element e;
    e.name = reinterpret_cast<const char *>(n->name);
    for (xmlAttr *a = n->properties; a; a = a->next) {
      xmlChar *v = xmlNodeListGetString(n->doc, a->children, 1);
      e.attrs[reinterpret_cast<const char *>(a->name)] = v ? reinterpret_cast<char *>(v) : "";
      xmlFree(v);
    }
    if (e.name == "text" || e.name == "title") {
      xmlChar *v = xmlNodeGetContent(n);
      e.text = v ? reinterpret_cast<char *>(v) : "";
      xmlFree(v);
    }
    doc.elements.push_back(std::move(e));
    collect(n->children, doc);
  }
}

Document parseSvg(const std::string &svg) {
  Document doc;
  xmlDocPtr d = xmlReadMemory(svg.data(), int(svg.size()), "figure.svg", nullptr,
                              XML_PARSE_NONET | XML_PARSE_NOERROR | XML_PARSE_NOWARNING);
  if (!d)
    return doc;
  xmlNode *root = xmlDocGetRootElement(d);
  if (root) {
    doc.parsed = true;
    doc.rootName = reinterpret_cast<const char *>(root->name);
    doc.rootNamespace = root->ns ? reinterpret_cast<const char *>(root->ns->href) : "";
    Document only;
    xmlNode *next = root->next;
    root->next = nullptr;
    collect(root, only);
    root->next = next;
    doc.root = only.elements.front();
    doc.elements.assign(only.elements.begin() + 1, only.elements.end());
  }
  xmlFreeDoc(d);
  return doc;
}

struct Drawn {
  Plan plan;
  Timeline timeline;
  std::string svg;
  Document doc;
};

Drawn draw(const ModelSpec &model, const CompileOptions &o) {
  Drawn d;
  d.plan = compileOrFail(model, o);
  llvm::Error err = simulateTimeline(d.plan, d.timeline);
  EXPECT_FALSE(bool(err)) << takeMessage(std::move(err));
  d.svg = scheduleSvg(d.plan, d.timeline);
  d.doc = parseSvg(d.svg);
  return d;
}

/// The zero-bubble paper's 1.5B model on 8 ranks (its profiled F, B, W and transfer times).
ModelSpec zb15b() {
  auto m = loadModelSpec("examples/zb-1.5b-p8.json");
  EXPECT_TRUE(bool(m)) << (m ? "" : takeMessage(m.takeError()));
  return m ? *m : ModelSpec{};
}

const char *kindClass(OpKind op) {
  switch (op) {
  case OpKind::Forward:
    return "F";
  case OpKind::BackwardInput:
    return "I";
  case OpKind::BackwardWeight:
    return "W";
  case OpKind::Backward:
    return "B";
  case OpKind::Send:
  case OpKind::Recv:
  case OpKind::AllReduce:
  case OpKind::OptimizerStep:
    break;
  }
  return "?";
}

/// Every compute op has one box where and as long as the simulator says; nothing else is a box.
void expectOneBoxPerComputeOpAtItsSimulatedTime(const Drawn &d) {
  ASSERT_TRUE(d.doc.parsed) << "not well-formed XML";
  EXPECT_EQ(d.doc.rootName, "svg");
  EXPECT_EQ(d.doc.rootNamespace, "http://www.w3.org/2000/svg");
  const double x0 = d.doc.root.num("data-time-x0");
  const double scale = d.doc.root.num("data-px-per-time");
  ASSERT_GT(scale, 0);
  std::map<std::pair<int, size_t>, int> seen;
  std::map<int, double> rowY;
  size_t boxes = 0;
  for (const Element &e : d.doc.elements) {
    if (e.name != "rect" || !e.hasClass("op"))
      continue;
    ++boxes;
    int r = int(e.num("data-rank"));
    size_t i = size_t(e.num("data-step"));
    ASSERT_LT(r, d.plan.numRanks());
    ASSERT_LT(i, d.plan.ranks[size_t(r)].size());
    const Instruction &ins = d.plan.ranks[size_t(r)][i];
    ASSERT_TRUE(ins.isCompute()) << "a box for a non-compute op at rank " << r << " step " << i;
    ++seen[{r, i}];
    const OpTime &t = d.timeline.ops[size_t(r)][i];
    // Two decimals of a pixel in the drawing.
    EXPECT_NEAR(e.num("x"), x0 + t.start * scale, 0.006) << "rank " << r << " step " << i;
    EXPECT_NEAR(e.num("width"), (t.end - t.start) * scale, 0.006) << "rank " << r << " step " << i;
    EXPECT_DOUBLE_EQ(e.num("data-start"), t.start);
    EXPECT_DOUBLE_EQ(e.num("data-end"), t.end);
    // Its kind (or, on a V-shape plan, the half of an overlapped pair).
    EXPECT_TRUE(e.hasClass(kindClass(ins.op)) || e.hasClass("pair-F") || e.hasClass("pair-B"))
        << e.attrs.at("class") << " for " << toString(ins.op).str();
    // One row per rank, top to bottom.
    if (!rowY.count(r))
      rowY[r] = e.num("y");
    EXPECT_EQ(e.num("y"), rowY[r]) << "rank " << r << " step " << i << " is off its row";
  }
  size_t compute = 0;
  for (int r = 0; r < d.plan.numRanks(); ++r)
    for (size_t i = 0; i < d.plan.ranks[size_t(r)].size(); ++i)
      if (d.plan.ranks[size_t(r)][i].isCompute()) {
        ++compute;
        EXPECT_EQ((seen[{r, i}]), 1) << "rank " << r << " step " << i;
      }
  EXPECT_EQ(boxes, compute);
  for (auto it = rowY.begin(); it != rowY.end() && std::next(it) != rowY.end(); ++it)
    EXPECT_LT(it->second, std::next(it)->second) << "rank " << it->first << " below the next";
}

size_t count(const Document &doc, const std::string &name, const std::string &cls) {
  size_t n = 0;
  for (const Element &e : doc.elements)
    n += e.name == name && e.hasClass(cls);
  return n;
}

bool hasText(const Document &doc, const std::string &needle) {
  for (const Element &e : doc.elements)
    if (e.name == "text" && e.text.find(needle) != std::string::npos)
      return true;
  return false;
}

TEST(FigureTest, OneFOneBHasABoxPerComputeOpAtItsSimulatedTime) {
  Drawn d = draw(uniformModel(8), options("1f1b", 4, 8));
  expectOneBoxPerComputeOpAtItsSimulatedTime(d);
  EXPECT_EQ(count(d.doc, "rect", "F"), 32u);
  EXPECT_EQ(count(d.doc, "rect", "B"), 32u);
  // The bubble: an idle track behind every row; an axis in the plan's unit; a legend.
  EXPECT_EQ(count(d.doc, "rect", "idle"), 4u);
  EXPECT_TRUE(hasText(d.doc, "simulated time (unit)"));
  EXPECT_TRUE(hasText(d.doc, "F: forward"));
  EXPECT_TRUE(hasText(d.doc, "B: backward"));
  EXPECT_TRUE(hasText(d.doc, "idle: the bubble"));
  EXPECT_FALSE(hasText(d.doc, "I: backward")) << "a legend entry for a kind not drawn";
  EXPECT_TRUE(hasText(d.doc, "bubble ratio 0.2727")) << "(p-1)/(m+p-1) = 3/11";
}

TEST(FigureTest, TheZeroBubblePapersSettingWithTransferTimes) {
  // The paper's Fig. 3 setting: 1.5B, p = 8, m = 24, profiled times with transfers.
  for (const char *schedule : {"1f1b", "zb-h1", "zb-h2"}) {
    SCOPED_TRACE(schedule);
    Drawn d = draw(zb15b(), options(schedule, 8, 24));
    expectOneBoxPerComputeOpAtItsSimulatedTime(d);
    // A transfer line per send, from its producer's end to its arrival.
    size_t sends = 0;
    for (const auto &stream : d.plan.ranks)
      for (const Instruction &i : stream)
        sends += i.op == OpKind::Send;
    EXPECT_EQ(count(d.doc, "line", "comm"), sends);
    // Readable: every op carries its microbatch at this size.
    EXPECT_EQ(count(d.doc, "text", "label"),
              d.plan.numRanks() * size_t(24) * (std::string(schedule) == "1f1b" ? 2 : 3));
  }
}

TEST(FigureTest, SplitOpsCollectivesSlicesAndChunksAreDrawn) {
  {
    // tp = 2: forwards and backwards in parts with tp all-reduces between; dp = 2: one dp
    // all-reduce per stage, on its own stream.
    ModelSpec m = uniformModel(8, 1, 1, 1, 1 << 20, 0, /*p2p=*/0.25);
    Drawn d = draw(m, options("1f1b", 4, 8, 1, 1, /*tp=*/2, /*dp=*/2));
    expectOneBoxPerComputeOpAtItsSimulatedTime(d);
    size_t tp = 0, dp = 0;
    for (const auto &stream : d.plan.ranks)
      for (const Instruction &i : stream)
        if (i.op == OpKind::AllReduce)
          (i.collective == CollectiveGroup::Tp ? tp : dp) += 1;
    EXPECT_EQ(count(d.doc, "rect", "tp"), tp);
    EXPECT_EQ(count(d.doc, "rect", "dp"), dp);
    EXPECT_TRUE(hasText(d.doc, "tp all-reduce"));
    EXPECT_TRUE(hasText(d.doc, "dp all-reduce"));
  }
  for (auto o :
       {options("seq1f1b", 4, 4, 1, /*seqSplits=*/2), options("interleaved-1f1b", 4, 8, /*vpp=*/2),
        options("zb-v", 4, 8, 2), options("seq1f1b-interleaved", 4, 4, 2, 2)}) {
    SCOPED_TRACE(o.schedule);
    Drawn d = draw(uniformModel(16), o);
    expectOneBoxPerComputeOpAtItsSimulatedTime(d);
    if (o.parallel.seqSplits > 1) {
      EXPECT_TRUE(hasText(d.doc, "3.1")) << "microbatch 3, slice 1";
    }
    if (o.parallel.vpp > 1) {
      EXPECT_TRUE(hasText(d.doc, "later chunk"));
    }
  }
}

TEST(FigureTest, DualPipeVDrawsItsOverlappedPairsAsThePaperCountsThem) {
  // DualPipeV's phase 4 runs M-2P+r+1 times (F0&B1, F1&B0) on rank r and phase 5 P-r-1 times
  // (B1, F1&B0): 2(M-2P+r+1) + (P-r-1) pairs on rank r. Other schedules have none.
  const int p = 4, m = 10;
  Drawn d = draw(uniformModel(8), options("dualpipe-v", p, m, /*vpp=*/2));
  expectOneBoxPerComputeOpAtItsSimulatedTime(d);
  size_t expected = 0;
  for (int r = 0; r < p; ++r) {
    size_t mine = 0;
    for (size_t i = 0; i < d.plan.ranks[size_t(r)].size(); ++i)
      mine += startsOverlappedPair(d.plan, r, i);
    EXPECT_EQ(mine, size_t(2 * (m - 2 * p + r + 1) + (p - r - 1))) << "rank " << r;
    expected += size_t(2 * (m - 2 * p + r + 1) + (p - r - 1));
  }
  EXPECT_EQ(count(d.doc, "rect", "pair"), expected);
  EXPECT_EQ(count(d.doc, "rect", "pair-F"), expected);
  EXPECT_EQ(count(d.doc, "rect", "pair-B"), expected);
  EXPECT_TRUE(hasText(d.doc, "overlapped forward and backward"));
  for (auto o :
       {options("zb-v", 4, 8, 2), options("interleaved-1f1b", 4, 8, 2), options("1f1b", 4, 8)}) {
    Drawn other = draw(uniformModel(8), o);
    EXPECT_EQ(count(other.doc, "rect", "pair"), 0u) << o.schedule;
  }
}

TEST(FigureTest, ThirtyTwoRanksAnd256MicrobatchesStayLegible) {
  // Every op labelled (no label wider than its box), at 10 px type.
  Drawn d =
      draw(uniformModel(32, 1, 1, 1, 1 << 20, 1 << 19, /*p2p=*/0.1), options("zb-h1", 32, 256));
  expectOneBoxPerComputeOpAtItsSimulatedTime(d);
  EXPECT_EQ(count(d.doc, "text", "label"), size_t(32 * 256 * 3));
  for (const Element &e : d.doc.elements)
    if (e.name == "g" && e.hasClass("ops")) {
      EXPECT_GE(e.num("font-size"), 10);
    }
}

//===----------------------------------------------------------------------===//
// Rendering
//===----------------------------------------------------------------------===//

struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgba;
  const uint8_t *at(int x, int y) const { return &rgba[(size_t(y) * size_t(width) + x) * 4]; }
};

uint32_t be32(const unsigned char *p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}

/// A PNG of 8-bit RGB or RGBA, not interlaced (what rsvg-convert writes); empty on anything
/// else.
Image readPng(const std::string &bytes) {
  Image img;
  const auto *b = reinterpret_cast<const unsigned char *>(bytes.data());
  static const unsigned char kSig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.size() < 8 || std::memcmp(b, kSig, 8) != 0)
    return img;
  int channels = 0;
  std::string idat;
  for (size_t at = 8; at + 12 <= bytes.size();) {
    uint32_t len = be32(b + at);
    std::string type(bytes.data() + at + 4, 4);
    const unsigned char *data = b + at + 8;
    if (at + 12 + len > bytes.size())
      return Image{};
    if (type == "IHDR") {
      img.width = int(be32(data));
      img.height = int(be32(data + 4));
      if (data[8] != 8 || (data[9] != 6 && data[9] != 2) || data[12] != 0)
        return Image{};
      channels = data[9] == 6 ? 4 : 3;
    } else if (type == "IDAT") {
      idat.append(reinterpret_cast<const char *>(data), len);
    }
    at += 12 + len;
  }
  if (!channels)
    return Image{};
  const size_t stride = size_t(img.width) * size_t(channels);
  std::vector<uint8_t> raw((stride + 1) * size_t(img.height));
  uLongf rawSize = uLongf(raw.size());
  if (uncompress(raw.data(), &rawSize, reinterpret_cast<const Bytef *>(idat.data()),
                 uLong(idat.size())) != Z_OK ||
      rawSize != raw.size())
    return Image{};
  // Undo the per-row filters (PNG spec §9).
  std::vector<uint8_t> pix(stride * size_t(img.height));
  for (int y = 0; y < img.height; ++y) {
    uint8_t filter = raw[size_t(y) * (stride + 1)];
    const uint8_t *in = &raw[size_t(y) * (stride + 1) + 1];
    uint8_t *out = &pix[size_t(y) * stride];
    const uint8_t *up = y > 0 ? out - stride : nullptr;
    for (size_t i = 0; i < stride; ++i) {
      int a = i >= size_t(channels) ? out[i - size_t(channels)] : 0;
      int u = up ? up[i] : 0;
      int c = up && i >= size_t(channels) ? up[i - size_t(channels)] : 0;
      int v = in[i];
      switch (filter) {
      case 0:
        break;
      case 1:
        v += a;
        break;
      case 2:
        v += u;
        break;
      case 3:
        v += (a + u) / 2;
        break;
      case 4: {
        int p = a + u - c, pa = std::abs(p - a), pb = std::abs(p - u), pc = std::abs(p - c);
        v += pa <= pb && pa <= pc ? a : pb <= pc ? u : c;
        break;
      }
      default:
        return Image{};
      }
      out[i] = uint8_t(v);
    }
  }
  img.rgba.resize(size_t(img.width) * size_t(img.height) * 4);
  for (size_t k = 0; k < size_t(img.width) * size_t(img.height); ++k)
    for (int ch = 0; ch < 4; ++ch)
      img.rgba[k * 4 + size_t(ch)] = ch < channels ? pix[k * size_t(channels) + size_t(ch)] : 255;
  return img;
}

/// #rrggbb to its bytes.
std::array<int, 3> rgb(const std::string &hex) {
  unsigned v = unsigned(std::stoul(hex.substr(1), nullptr, 16));
  return {int(v >> 16 & 255), int(v >> 8 & 255), int(v & 255)};
}

bool near(const uint8_t *px, std::array<int, 3> c, int tolerance = 3) {
  for (int k = 0; k < 3; ++k)
    if (std::abs(int(px[k]) - c[size_t(k)]) > tolerance)
      return false;
  return true;
}

/// Render with rsvg-convert; the decoded image (empty, and a failure, if anything went wrong).
Image render(const std::string &svg, const std::string &name, const std::string &flags = "") {
  std::string in = tmpDir() + "/" + name + ".svg", out = tmpDir() + "/" + name + ".png";
  std::ofstream(in) << svg;
  auto r = runCommand("rsvg-convert " + flags + " -o " + out + " " + in);
  EXPECT_EQ(r.code, 0) << "rsvg-convert (Debian's librsvg2-bin; tools/setup.sh installs it): "
                       << r.err;
  Image img = readPng(slurp(out));
  EXPECT_GT(img.width, 0) << "rsvg-convert wrote no PNG this test can read";
  return img;
}

TEST(FigureRenderTest, ARealRendererDrawsEveryBoxInItsColourAndTheBubbleGrey) {
  Drawn d = draw(zb15b(), options("zb-h1", 8, 24));
  ASSERT_TRUE(d.doc.parsed);
  Image img = render(d.svg, "zb-h1");
  ASSERT_GT(img.width, 0);
  EXPECT_EQ(img.width, int(d.doc.root.num("width")));
  EXPECT_EQ(img.height, int(d.doc.root.num("height")));
  // Each box: a pixel inside it, clear of its edges and of its label, has its fill.
  size_t checked = 0;
  for (const Element &e : d.doc.elements) {
    if (e.name != "rect" || !e.hasClass("op") || e.num("width") < 6)
      continue;
    int x = int(std::floor(e.num("x") + 2.5)), y = int(std::floor(e.num("y") + 2.5));
    EXPECT_TRUE(near(img.at(x, y), rgb(e.attrs.at("fill"))))
        << "rank " << e.attrs.at("data-rank") << " step " << e.attrs.at("data-step") << " at (" << x
        << ", " << y << ") is not " << e.attrs.at("fill");
    ++checked;
  }
  EXPECT_EQ(checked, size_t(8 * 24 * 3));
  // The bubble: rank 7 idles from 0 until microbatch 0 reaches it, rank 0 after its last op.
  std::string idle;
  for (const Element &e : d.doc.elements)
    if (e.name == "rect" && e.hasClass("idle"))
      idle = e.attrs.at("fill");
  ASSERT_FALSE(idle.empty());
  const double x0 = d.doc.root.num("data-time-x0"), scale = d.doc.root.num("data-px-per-time");
  double firstOnLast = 1e300;
  for (size_t i = 0; i < d.plan.ranks[7].size(); ++i)
    if (d.plan.ranks[7][i].isCompute())
      firstOnLast = std::min(firstOnLast, d.timeline.ops[7][i].start);
  ASSERT_GT(firstOnLast * scale, 10);
  double rowsTop = 1e9;
  for (const Element &e : d.doc.elements)
    if (e.name == "rect" && e.hasClass("idle") && e.attrs.at("data-rank") == "7")
      rowsTop = e.num("y");
  EXPECT_TRUE(near(img.at(int(x0 + firstOnLast * scale / 2), int(rowsTop + 9)), rgb(idle)))
      << "rank 7's warm-up bubble is not drawn idle";
}

TEST(FigureRenderTest, TheLargestFigureRendersAtAQuarter) {
  Drawn d = draw(uniformModel(32, 1, 1, 1, 1 << 20, 1 << 19, 0.1), options("zb-h1", 32, 256));
  Image img = render(d.svg, "zb-h1-p32", "--zoom 0.25");
  EXPECT_NEAR(img.width, d.doc.root.num("width") / 4, 1);
  EXPECT_NEAR(img.height, d.doc.root.num("height") / 4, 1);
}

TEST(FigureTest, TheReadmePictureIsWhatItsCommandDraws) {
  // docs/img/zb-v-p4-m8.svg comes from `pipec compile --model examples/zb-1.5b-p8.json
  // --schedule zb-v --pp 4 --vpp 2 --microbatches 8 -o plan.json` and `pipec show plan.json
  // --svg docs/img/zb-v-p4-m8.svg` (docs/commands.md); redraw it when the figure changes.
  Drawn d = draw(zb15b(), options("zb-v", 4, 8, /*vpp=*/2));
  EXPECT_TRUE(d.svg == slurp("docs/img/zb-v-p4-m8.svg"))
      << "docs/img/zb-v-p4-m8.svg is not what pipec draws today; run the commands above";
}

//===----------------------------------------------------------------------===//
// pipec compile --svg, pipec show --svg
//===----------------------------------------------------------------------===//

bool exists(const std::string &path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

size_t lines(const std::string &s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

TEST(FigureCliTest, CompileAndShowWriteTheSameFigure) {
  std::string plan = tmpDir() + "/fig-plan.json", a = tmpDir() + "/compile.svg",
              b = tmpDir() + "/show.svg";
  auto c = runCommand("tools/pipec compile --model examples/zb-1.5b-p8.json --schedule zb-h1 "
                      "--pp 8 --microbatches 24 -o " +
                      plan + " --svg " + a);
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_NE(c.out.find("wrote " + a), std::string::npos) << c.out;
  auto s = runCommand("tools/pipec show " + plan + " --svg " + b);
  ASSERT_EQ(s.code, 0) << s.err;
  EXPECT_NE(s.out.find("wrote " + b), std::string::npos) << s.out;
  EXPECT_EQ(s.out.find("step 0:"), std::string::npos) << "the grid is not printed with --svg";
  EXPECT_EQ(slurp(a), slurp(b));
  Document doc = parseSvg(slurp(b));
  EXPECT_TRUE(doc.parsed);
  EXPECT_EQ(count(doc, "rect", "op"), size_t(8 * 24 * 3));
}

TEST(FigureCliTest, AnUnwritableFigureIsOneLineNamingTheFlagAndWritesNothing) {
  std::string plan = tmpDir() + "/fig-plan2.json";
  auto c = runCommand("tools/pipec compile --model examples/uniform-8.json --schedule 1f1b "
                      "--pp 4 --microbatches 8 -o " +
                      plan + " --svg /no/such/dir/f.svg");
  EXPECT_EQ(c.code, 2);
  EXPECT_EQ(lines(c.err), 1u) << c.err;
  EXPECT_NE(c.err.find("--svg: /no/such/dir/f.svg"), std::string::npos) << c.err;
  EXPECT_FALSE(exists(plan)) << "the plan was written although the figure could not be";
  auto ok = runCommand("tools/pipec compile --model examples/uniform-8.json --schedule 1f1b "
                       "--pp 4 --microbatches 8 -o " +
                       plan);
  ASSERT_EQ(ok.code, 0) << ok.err;
  auto s = runCommand("tools/pipec show " + plan + " --svg " + tmpDir());
  EXPECT_EQ(s.code, 2);
  EXPECT_EQ(lines(s.err), 1u) << s.err;
  EXPECT_NE(s.err.find("--svg: "), std::string::npos) << s.err;
  EXPECT_NE(s.err.find("is a directory"), std::string::npos) << s.err;
}

TEST(FigureCliTest, AWrongPlanIsAFindingNotAFigure) {
  // A plan whose rank 1 receives before rank 0 ever sends (swapped FIFO order): exit 1 with the
  // verifier's diagnostic, and no figure.
  std::string plan = tmpDir() + "/fig-plan3.json", svg = tmpDir() + "/wrong.svg";
  auto ok = runCommand("tools/pipec compile --model examples/uniform-8.json --schedule 1f1b "
                       "--pp 2 --microbatches 2 -o " +
                       plan);
  ASSERT_EQ(ok.code, 0) << ok.err;
  auto parsed = loadPlan(plan);
  ASSERT_TRUE(bool(parsed)) << takeMessage(parsed.takeError());
  // Move rank 0's first backward before its first forward.
  auto &stream = parsed->ranks[0];
  size_t f = 0, b = 0;
  while (stream[f].op != OpKind::Forward)
    ++f;
  while (!stream[b].isCompute() || stream[b].op == OpKind::Forward)
    ++b;
  std::swap(stream[f], stream[b]);
  std::ofstream(plan) << writePlanJson(*parsed);
  auto s = runCommand("tools/pipec show " + plan + " --svg " + svg);
  EXPECT_EQ(s.code, 1) << s.err;
  EXPECT_NE(s.err.find("<-- here"), std::string::npos) << s.err;
  EXPECT_FALSE(exists(svg));
}

} // namespace
} // namespace pipec::test
