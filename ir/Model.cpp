#include "ir/Model.h"

#include "llvm/Support/ErrorHandling.h"

#include <fmt/format.h>

#include <algorithm>
#include <cassert>

namespace pipec {

//===----------------------------------------------------------------------===//
// Costs
//===----------------------------------------------------------------------===//

int64_t ModelSpec::sequenceLength(int seqSplits) const {
  if (transformer)
    return transformer->seqLength;
  return seqLength > 0 ? seqLength : seqSplits;
}

/// Sum over t in [begin, end) of (t + 1): the causal attention positions of a token range.
static double causalPositions(int64_t begin, int64_t end) {
  return (double(end) * double(end + 1) - double(begin) * double(begin + 1)) / 2.0;
}

/// `total` shared by `n` parts as equally as integers allow; earlier parts take the remainder.
static int64_t shareOf(int64_t total, int n, int index) {
  int64_t base = total / n;
  return base + (index < total % n ? 1 : 0);
}

/// Forward FLOPs of one token through a block's matrices (2 per multiply-add): q and the
/// output projection 2h² each, k and v 2h·(kv heads · head size) each, the MLP 2hf per matrix
/// (two for GELU, three for SwiGLU). GPT-2: 8h² + 4hf. Rotary embeddings, norms and
/// activations are a few FLOPs per element and are left out, as
/// docs/contracts.md#model-spec-pipemodel1 leaves them.
static double blockLinearFlopsPerToken(const TransformerConfig &t) {
  double h = double(t.hiddenSize), f = double(t.ffnHiddenSize);
  double kv = double(t.kvHeads()) * (h / double(t.numAttentionHeads));
  double mlpMatrices = t.mlp == Mlp::SwiGlu ? 3 : 2;
  return 4 * h * h + 4 * h * kv + 2 * mlpMatrices * h * f;
}

double ModelSpec::blockForwardFlopsPrefix(int64_t end) const {
  assert(transformer && "FLOP prefix needs a transformer model");
  const TransformerConfig &t = *transformer;
  return double(end) * blockLinearFlopsPerToken(t) +
         4 * double(t.hiddenSize) * causalPositions(0, end);
}

llvm::StringRef toString(Attention a) {
  switch (a) {
  case Attention::Flash:
    return "flash";
  case Attention::Materialized:
    return "materialized";
  }
  llvm_unreachable("unknown Attention");
}

llvm::StringRef toString(Recompute r) {
  switch (r) {
  case Recompute::None:
    return "none";
  case Recompute::Selective:
    return "selective";
  case Recompute::Full:
    return "full";
  }
  llvm_unreachable("unknown Recompute");
}

llvm::StringRef toString(Norm n) { return n == Norm::RmsNorm ? "rmsnorm" : "layernorm"; }
llvm::StringRef toString(Mlp m) { return m == Mlp::SwiGlu ? "swiglu" : "gelu"; }
llvm::StringRef toString(Position p) { return p == Position::Rope ? "rope" : "learned"; }

llvm::StringRef toString(P2p p) {
  switch (p) {
  case P2p::Overlapped:
    return "overlapped";
  case P2p::Megatron:
    return "megatron";
  case P2p::Blocking:
    return "blocking";
  }
  llvm_unreachable("unknown p2p mode");
}

bool p2pFromString(llvm::StringRef name, P2p &out) {
  for (P2p p : {P2p::Overlapped, P2p::Megatron, P2p::Blocking})
    if (toString(p) == name) {
      out = p;
      return true;
    }
  return false;
}

bool normFromString(llvm::StringRef name, Norm &out) {
  for (Norm n : {Norm::LayerNorm, Norm::RmsNorm})
    if (toString(n) == name) {
      out = n;
      return true;
    }
  return false;
}

bool mlpFromString(llvm::StringRef name, Mlp &out) {
  for (Mlp m : {Mlp::Gelu, Mlp::SwiGlu})
    if (toString(m) == name) {
      out = m;
      return true;
    }
  return false;
}

bool positionFromString(llvm::StringRef name, Position &out) {
  for (Position p : {Position::Learned, Position::Rope})
    if (toString(p) == name) {
      out = p;
      return true;
    }
  return false;
}

std::string TransformerConfig::variantText() const {
  std::vector<std::string> parts;
  if (norm != Norm::LayerNorm)
    parts.push_back(fmt::format("\"norm\": \"{}\"", toString(norm).str()));
  if (mlp != Mlp::Gelu)
    parts.push_back(fmt::format("\"mlp\": \"{}\"", toString(mlp).str()));
  if (position != Position::Learned)
    parts.push_back(fmt::format("\"position\": \"{}\"", toString(position).str()));
  if (kvHeads() != numAttentionHeads)
    parts.push_back(fmt::format("\"num_query_groups\": {}", numQueryGroups));
  if (!bias)
    parts.push_back("\"bias\": false");
  if (normEps != 1e-5)
    parts.push_back(fmt::format("\"norm_eps\": {}", normEps));
  return fmt::format("{}", fmt::join(parts, ", "));
}

bool attentionFromString(llvm::StringRef name, Attention &out) {
  for (Attention a : {Attention::Flash, Attention::Materialized})
    if (toString(a) == name) {
      out = a;
      return true;
    }
  return false;
}

bool recomputeFromString(llvm::StringRef name, Recompute &out) {
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full})
    if (toString(r) == name) {
      out = r;
      return true;
    }
  return false;
}

int64_t ModelSpec::residualBytes(int64_t begin, int64_t end, int shards) const {
  if (!transformer)
    return 0;
  const TransformerConfig &t = *transformer;
  return t.microbatchSize * (end - begin) * t.hiddenSize * t.dtypeBytes() / shards;
}

double ModelSpec::modelFlopsPerMicrobatch() const {
  if (!transformer)
    return 0;
  const TransformerConfig &t = *transformer;
  double b = double(t.microbatchSize), s = double(t.seqLength), h = double(t.hiddenSize);
  double v = double(t.vocabSize);
  // docs/contracts.md#model-spec-pipemodel1 per block: F + B + W = b·(3·s·(8h² + 4hf) + 12h·Σ(t+1))
  // for GPT-2 (the matrices' FLOPs per token: blockLinearFlopsPerToken); head: 3 GEMMs of
  // 2·b·s·h·v.
  double block =
      b * (3 * s * blockLinearFlopsPerToken(t) + 12 * h * causalPositions(0, t.seqLength));
  return double(t.numLayers) * block + 3 * 2 * b * s * h * v;
}

// Memory of a transformer layer (what piperun's stages keep, runtime/cuda/GpuStage.cpp and
// kernels/cpu/Gpt.cpp, at the model's dtype: d bytes per element; layernorm statistics, the
// attention's log-sum-exps and the dK/dV accumulators are fp32). Per (microbatch, slice) of
// x tokens [a, e), N = b·x tokens, on one of tp ranks (Cl = h/tp, Fl = f/tp, Hl = heads/tp):
//   block forward keeps   xIn, xMid (h each), q, attOut (Cl each), fcPre (Fl),
//                         two layernorms' mean and rstd (16 bytes per token),
//                         flash: a log-sum-exp per head and token (4·b·Hl·x bytes);
//                         materialized: the probabilities (b·Hl·x·e elements),
//                         K and V (flash: of the whole sequence, with slice 0; materialized:
//                         the slice's own x tokens);
//   after its backward    xIn, xMid, attOut, fcPre and the statistics stay; the output
//                         gradients of its linears and layernorms join them: dOut, dXmid,
//                         dLn1, dLn2 (h each), dQkv (3 Cl), dFcPre (Fl);
//   during its backward   also the fp32 dK/dV accumulators (2·N·Cl·4 bytes); with K > 1
//                         sub-sequences, those of the whole sequence (2·b·s·Cl·4), from the
//                         microbatch's first backward (slice K - 1) to the end of its last
//                         (slice 0), which is also when the K/V of every slice go;
//   workspace             the largest temporaries of one op: the MLP forward's layernorm
//                         output, GELU output and partial sum (N·(2h + Fl)), or the attention
//                         forward's layernorm output, QKV and partial sum (N·(2h + 3Cl)).
// So activation_bytes = N·(2h + 2Cl + Fl)·d + 16N + attention + K/V and weight_grad_bytes =
// N·(6h + 4Cl + 2Fl)·d + 16N. The stage's residual stream (N·h·d, residualBytes) is the
// stage's, not a layer's. Recomputation (Korthikanti et al. 2022): "full" keeps only the
// block's input (and K/V, which later slices read) and adds a forward to the input-gradient
// backward; "selective" drops the materialized probabilities and adds the attention core's
// forward to the backward (with flash attention there are none to drop: it is "none").
// Llama-style blocks change the widths, not the rule: K and V (and dK, dV, and their columns
// of dQkv) are Kl = kv heads · head size / tp wide instead of Cl; SwiGLU keeps its gate and up
// outputs, 2Fl, where GELU keeps Fl (and so do their gradients); RMSNorm keeps 8N of
// statistics where LayerNorm keeps 16N (the head's final norm 4N instead of 8N). These are
// the rules the Llama kernels are to follow; until they exist nothing checks them against an
// arena.
void ModelSpec::setTransformer(const TransformerConfig &c) {
  layers.clear();
  double dt = double(c.dtypeBytes());
  double h = double(c.hiddenSize), f = double(c.ffnHiddenSize), v = double(c.vocabSize);
  double kv = double(c.kvHeads()) * (h / double(c.numAttentionHeads)); // K (or V) width
  // A norm's scale, and LayerNorm's shift where the model has biases.
  double normParams = c.norm == Norm::LayerNorm && c.bias ? 2 * h : h;
  Layer emb;
  emb.name = "embedding";
  emb.kind = LayerKind::Embedding;
  // Word embeddings, and the position table where positions are learned.
  emb.paramBytes =
      int64_t(v * h * dt + (c.position == Position::Learned ? double(c.seqLength) * h * dt : 0));
  emb.tpAllReduces = 1; // vocab-parallel lookup ends in an all-reduce
  layers.push_back(emb);
  Layer block;
  block.name = "block";
  block.kind = LayerKind::Block;
  // QKV (h·(h + 2kv) + biases), proj (h² + bias), MLP (2hf + f + h for GELU, 3hf + 2f + h
  // for SwiGLU, less the biases without them), two norms. GPT-2: 4h² + 4h + 2hf + f + h + 4h.
  double mlpMatrices = c.mlp == Mlp::SwiGlu ? 3 : 2, mlpBiases = c.mlp == Mlp::SwiGlu ? 2 * f : f;
  double blockParams = h * (h + 2 * kv) + h * h + mlpMatrices * h * f + 2 * normParams;
  if (c.bias)
    blockParams += (h + 2 * kv) + h + mlpBiases + h;
  block.paramBytes = int64_t(blockParams * dt);
  block.tpAllReduces = 2;
  for (int64_t i = 0; i < c.numLayers; ++i)
    layers.push_back(block);
  Layer head;
  head.name = "lm_head";
  head.kind = LayerKind::Head;
  head.paramBytes = int64_t((v * h + normParams) * dt); // output embedding + final norm
  head.tpAllReduces = 1;
  layers.push_back(head);
  // Megatron mixed precision: 2 (param) + 4 (fp32 grad) + 12 (fp32 master, Adam m and v)
  // = 18 bytes per parameter, i.e. 9 per bf16 parameter byte; 16 / 4 = 4 in fp32.
  stateBytesPerParamByte = c.dtype == "fp32" ? 4 : 9;
  transformer = c;
}

/// Milliseconds of a GEMM of `flops` (on one rank) whose dimensions are m x k times k x n.
static double gemmMs(const ClusterSpec &c, double flops, double m, double k, double n,
                     bool fp8 = false) {
  return flops / c.gemmFlopsPerMs(m, k, n, fp8);
}

SliceCost ModelSpec::sliceCost(const ClusterSpec &cluster, size_t layerIndex, int64_t begin,
                               int64_t end, int index, int numSlices, int tp, bool sequenceParallel,
                               int cp) const {
  const Layer &layer = layers[layerIndex];
  SliceCost c;
  if (!transformer) {
    // Abstract layers have no attention term: every slice takes an equal share.
    c.forward = layer.forward / numSlices;
    c.backwardInput = layer.backwardInput / numSlices;
    c.backwardWeight = layer.backwardWeight / numSlices;
    c.activationBytes = shareOf(layer.activationBytes, numSlices, index);
    c.weightGradBytes = shareOf(layer.weightGradBytes, numSlices, index);
    c.outputBytes = shareOf(layer.outputBytes, numSlices, index);
    return c;
  }
  const TransformerConfig &t = *transformer;
  double b = double(t.microbatchSize), h = double(t.hiddenSize), f = double(t.ffnHiddenSize);
  // With context parallelism a rank holds x/cp of the slice's tokens and, its chunks
  // load-balanced (Megatron-LM pairs chunk r with chunk 2cp - 1 - r), 1/cp of its causal
  // attention's positions.
  double x = double(end - begin) / cp, v = double(t.vocabSize), heads = double(t.numAttentionHeads);
  double sigma = causalPositions(begin, end) / cp;
  bool flash = t.attention == Attention::Flash;
  double attentionPerMs = cluster.attentionFlopsPerMs(flash) * tp;
  double d = double(t.dtypeBytes());
  double n = b * x, cl = h / tp, fl = f / tp, hl = heads / tp;
  // What sequence parallelism shards over the tp ranks: the norms, dropouts and residual adds
  // (and the residual stream they keep); without it every tp rank repeats them whole.
  double sp = sequenceParallel ? double(tp) : 1.0;
  double overhead = cluster.opOverheadUs / 1000.0;
  double memPerMs = cluster.memoryBytesPerMs();
  switch (layer.kind) {
  case LayerKind::Embedding:
    // A lookup: no FLOPs to speak of; its output is the stage's residual stream. Megatron-LM
    // drops out of it with the hidden dropout and keeps the mask (a byte an element).
    c.outputBytes = int64_t(n * h * d);
    if (cluster.megatronActivations && t.hiddenDropout > 0)
      c.activationBytes = int64_t(n * h / sp);
    return c;
  case LayerKind::Block: {
    // K and V per rank: kv heads x head size / tp (grouped-query attention shares them).
    double kl = double(t.kvHeads()) * (h / heads) / tp;
    double mlpIn = t.mlp == Mlp::SwiGlu ? 2 : 1; // gate and up, or one up projection
    // The block's GEMMs on one rank, each 2·n·k·out FLOPs at the efficiency of its shape (the
    // input gradient's and weight gradient's GEMMs have the same three dimensions): QKV,
    // the attention's output projection, the MLP's up (and gate) and down projections.
    bool fp8 = t.fp8Gemms;
    double linear = gemmMs(cluster, 2 * n * h * (cl + 2 * kl), n, h, cl + 2 * kl, fp8) +
                    gemmMs(cluster, 2 * n * cl * h, n, cl, h, fp8) +
                    mlpIn * gemmMs(cluster, 2 * n * h * fl, n, h, fl, fp8) +
                    gemmMs(cluster, 2 * n * fl * h, n, fl, h, fp8);
    double attentionF = b * 4 * h * sigma, attentionB = b * 8 * h * sigma;
    // Memory-bound kernels, elements per token: two norms (read and write h each), two
    // dropout-and-residual adds (read 2h, write h each), all sharded only by sequence
    // parallelism; the MLP's activation (read its input width per rank, write its output).
    // Their backward reads what the forward saved and the output's gradient and writes the
    // input's gradient: the norms 3h each, the dropout-and-residual adds 3h each, the
    // activation its input width twice and its output once (GELU 3Fl, SwiGLU 5Fl). The weight
    // gradient is GEMMs only.
    double forwardBytes = 10 * h / sp + (mlpIn + 1) * fl;
    double backwardBytes = 12 * h / sp + (2 * mlpIn + 1) * fl;
    if (cluster.megatronLegacyKernels) {
      // Megatron-LM's own layers (its ColumnParallelLinear and attention modules). Forward: the
      // QKV projection's bias added by a kernel of its own (read and write its output, qkv
      // wide per rank; the other biases go into the fused bias-GELU and bias-dropout-add
      // kernels, SwiGLU's up projection's into an add of its own) and the attention's output
      // copied from [b·heads, s, d] into [s, b, h] order (read, write). Backward: every bias
      // gradient summed over the tokens by a kernel of its own (read the QKV, up-projection and
      // both residual-branch gradients), that copy's gradient (read, write) and the Q, K and V
      // gradients concatenated into the projection's (read, write). Its flash-attention path
      // also copies Q, K and V into [b, s, ...] order first, and their gradients back.
      double qkv = cl + 2 * kl, bias = t.bias ? 1 : 0, flashCopies = flash ? 2 * qkv : 0;
      double upBias = t.mlp == Mlp::SwiGlu ? 2 * mlpIn * fl : 0;
      forwardBytes += bias * (2 * qkv + upBias) + 2 * cl + flashCopies;
      backwardBytes += bias * (qkv + mlpIn * fl + 2 * h / sp) + 2 * cl + 2 * qkv + flashCopies;
    }
    double perByte = memPerMs > 0 ? n * d / memPerMs : 0.0;
    // A materialized attention core also passes over its score matrix (b·Hl·x·e elements
    // per rank: the slice's x queries against the e keys up to its end) in memory-bound
    // kernels, as Megatron-LM's unfused path runs them, d bytes an element unless noted:
    // forward, the QKᵀ GEMM writes the scores, the fused scale-mask-softmax reads them and
    // writes the probabilities, dropout reads those and writes its output and a 1-byte mask
    // (5d + 1); backward, the PV GEMM's gradient writes dP, dropout's backward reads it and
    // the mask and writes its gradient, softmax's backward reads that and the probabilities
    // and writes dS (6d + 1). Their FLOPs stay at attention_fraction (the score GEMMs); with
    // flash attention the scores never reach memory.
    double scoreF = 0, scoreB = 0;
    if (!flash && memPerMs > 0) {
      double scores = b * hl * x * double(end);
      scoreF = scores * (5 * d + 1) / memPerMs;
      scoreB = scores * (6 * d + 1) / memPerMs;
    }
    // Context parallelism's ring: cp - 1 times a rank passes on the K and V chunk it holds
    // (b·x·2Kl elements) while it computes attention against the one it has, and in the
    // backward passes on K, V and their gradients' partial sums (twice the bytes); what a
    // message takes beyond its step of attention is exposed. The ring's ranks are tp apart.
    double ringF = 0, ringB = 0;
    if (cp > 1) {
      const Link &link = cluster.groupLink(tp, cp);
      double chunk = 2 * n * kl * d, steps = cp - 1.0;
      double stepF = attentionF / attentionPerMs / cp, stepB = attentionB / attentionPerMs / cp;
      ringF = steps * std::max(0.0, cluster.transferMs(link, chunk) - stepF);
      ringB = steps * std::max(0.0, cluster.transferMs(link, 2 * chunk) - stepB);
      // The ring's memory-bound passes besides the attention, on the rank that sets its pace
      // (the last, which runs every step on all its queries against half a chunk), elements
      // per token, each read and written once (Transformer Engine's point-to-point context
      // parallelism): forward, K and V copied into the send buffer (4Kl), each later step's
      // half chunk made contiguous (2Kl), the output zeroed (Cl) and every step's partial
      // output merged into it by its log-sum-exp (read both, write: 3Cl); backward, the same
      // copies, and every step's dQ and half-chunk dK/dV added to their sums (3Cl + 3Kl).
      if (flash) {
        ringF += perByte * (4 * kl + steps * 2 * kl + cl + cp * 3 * cl);
        ringB += perByte * (4 * kl + steps * 2 * kl + cp * 3 * (cl + kl));
      }
    }
    c.forward =
        linear + attentionF / attentionPerMs + scoreF + perByte * forwardBytes + overhead + ringF;
    c.backwardInput =
        linear + attentionB / attentionPerMs + scoreB + perByte * backwardBytes + overhead + ringB;
    c.backwardWeight = linear + overhead;
    // The MLP keeps its pre-activation (GELU) or both gate and up outputs (SwiGLU).
    double fc = t.mlp == Mlp::SwiGlu ? 2 * fl : fl;
    // Each norm keeps per token its rstd (RMSNorm) or mean and rstd (LayerNorm), in fp32.
    double stats = t.norm == Norm::RmsNorm ? 8 : 16;
    double kv =
        flash ? (index == 0 ? 2 * double(t.seqLength) / cp * b * kl * d : 0) : 2 * n * kl * d;
    double probs = flash ? 4 * b * hl * x : b * hl * x * double(end) * d;
    // xIn, xMid (sharded with sequence parallelism), attOut, fcPre, statistics.
    double kept = n * (2 * h / sp + cl + fc) * d + stats * n / sp;
    double forwardOnly = n * cl * d + probs;               // q and the attention's state
    double gradients = n * (4 * h + cl + 2 * kl + fc) * d; // output gradients of the linears
    double dkv = 2 * n * kl * 4;
    // What Megatron-LM's and Transformer Engine's layers keep besides (Korthikanti et al. 2022,
    // section 4.1): the two norms' outputs (the QKV and up projections' inputs, sharded with
    // sequence parallelism as the projections keep them) and the MLP activation's output (the
    // down projection's input), all inputs of the weight gradient; with hidden dropout its two
    // masks (a byte an element); with attention dropout on a materialized core its output and
    // mask beside the probabilities (d + 1 bytes a score). piperun recomputes the first two
    // from what it keeps and runs no dropout.
    // Transformer Engine's FP8 linears keep their input's FP8 cast for the weight gradient, a
    // byte an element (its 1.x linear.py, layernorm_linear.py, layernorm_mlp.py): the norms' and
    // the activation's outputs are kept so, and the attention's output, which the attention
    // keeps at d bytes, is kept a second time so by the output projection.
    const double inputBytes = t.fp8Gemms ? 1.0 : d;
    double frameworkInputs = 0, frameworkOther = 0, frameworkScores = 0;
    if (cluster.megatronActivations) {
      frameworkInputs = n * (2 * h / sp + fl) * inputBytes + (t.fp8Gemms ? n * cl : 0.0);
      frameworkOther = t.hiddenDropout > 0 ? 2 * n * h / sp : 0;
      frameworkScores = !flash && t.attentionDropout > 0 ? b * hl * x * double(end) * (d + 1) : 0;
    }
    const double framework = frameworkInputs + frameworkOther + frameworkScores;
    double activation = kept + forwardOnly + kv + framework;
    switch (t.recompute) {
    case Recompute::None:
      break;
    case Recompute::Selective:
      if (!flash) {
        activation -= probs + frameworkScores;
        c.backwardInput += attentionF / attentionPerMs + scoreF;
      }
      break;
    case Recompute::Full:
      // (Megatron-LM keeps the block's input alone; piperun also K and V, which later
      // sub-sequences read.)
      activation = n * h * d / sp + (cluster.megatronActivations && numSlices == 1 ? 0 : kv);
      c.backwardInput += c.forward;
      break;
    }
    c.workspaceBytes = int64_t(n * (2 * h + std::max(cl + 2 * kl, fl)) * d);
    // The ring's receive buffers: the K/V chunk in flight and, in the backward, its gradient.
    if (cp > 1)
      c.workspaceBytes += int64_t(2 * (2 * n * kl * d));
    // Full recomputation rebuilds one block's forward state at a time inside the backward.
    if (t.recompute == Recompute::Full)
      c.workspaceBytes += int64_t(kept + forwardOnly + framework - n * h * d / sp);
    // What the weight gradient needs besides the output gradients: the linears' inputs. piperun
    // recomputes the norms' outputs and the activation's output from what it keeps; Megatron-LM
    // keeps those inputs themselves (the norms' outputs, the attention's output, the activation's
    // output) and nothing else of the block: the zero-bubble paper's M_W (its Table 1).
    // (Of the output gradients W reads the four linears': QKV's, the two h wide ones of the
    // projection and the down projection, the up projection's; not the norms' outputs'.)
    double weightGrad = cluster.megatronActivations ? n * (2 * h / sp + cl + fl) * inputBytes +
                                                          n * (2 * h + cl + 2 * kl + fc) * d
                                                    : kept + gradients;
    c.activationBytes = int64_t(activation);
    c.weightGradBytes = int64_t(weightGrad);
    // With sub-sequences a microbatch's K/V and dK/dV are its slices' together: the K/V stay
    // until slice 0's backward, and the first backward allocates the whole sequence's dK/dV,
    // which slice 0's frees (StageProgram's SequenceBlock). Without, dK/dV are the backward's.
    if (numSlices > 1) {
      c.sequenceKvBytes = int64_t(kv);
      c.sequenceGradBytes = index == 0 ? int64_t(2 * b * double(t.seqLength) * kl * 4) : 0;
      dkv = 0;
    }
    // At the end of the backward: the weight gradient's inputs, K/V (freed with slice 0) and
    // dK/dV, all on top of what the forward kept.
    c.backwardPeakBytes = std::max<int64_t>(0, int64_t(weightGrad + kv + dkv - activation));
    c.outputBytes = int64_t(n * h * d / sp);
    return c;
  }
  case LayerKind::Head: {
    double vl = v / tp;
    double gemm = gemmMs(cluster, 2 * n * h * vl, n, h, vl);
    // The loss over the rank's logits, unfused as Megatron-LM's vocab-parallel cross entropy
    // runs it, in bytes per logit: forward widens the logits to fp32 (read d, write 4; none in
    // fp32), takes the row maximum (read 4), subtracts it (8), exponentiates (8), sums (read
    // 4) and normalises (8); backward scales the kept softmax by the loss gradient (8) and
    // narrows it back to d (read 4, write d).
    double widen = d < 4 ? d + 4 : 0;
    double lossForwardBytes = widen + 32, lossBackwardBytes = 8 + (d < 4 ? 4 + d : 0);
    double perLogit = memPerMs > 0 ? n * vl / memPerMs : 0.0;
    c.forward = gemm + perLogit * lossForwardBytes + overhead;
    c.backwardInput = gemm + perLogit * lossBackwardBytes + overhead;
    c.backwardWeight = gemm + overhead;
    // Forward: final layernorm output and its statistics, the rank's logits (the loss
    // backward overwrites them with their gradient), the log-sum-exp and loss per token (its
    // input is the stage's residual stream). Backward: the layernorm's input stays for W,
    // the logits' gradient and dLnfOut join, the log-sum-exp goes.
    double stats = t.norm == Norm::RmsNorm ? 4 : 8; // the final norm's, per token
    // Megatron-LM's vocab-parallel cross entropy keeps its softmax in fp32 where piperun keeps
    // the logits at d bytes ("kept_activations": "megatron").
    double logitBytes = cluster.megatronActivations ? std::max(d, 4.0) : d;
    c.activationBytes = int64_t(n * h * d + n * vl * logitBytes + (stats + 8) * n);
    c.weightGradBytes = int64_t(n * 3 * h * d + n * vl * logitBytes + (stats + 4) * n);
    c.backwardPeakBytes = c.weightGradBytes - c.activationBytes;
    c.outputBytes = 0;
    return c;
  }
  case LayerKind::Abstract:
    break;
  }
  llvm_unreachable("abstract layer in a transformer model");
}

} // namespace pipec
