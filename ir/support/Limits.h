//===- Limits.h - The bounds of what pipec plans and runs -------*- C++ -*-===//
//
// Every size bound the compiler, the formats and the tools check, in one place: the flags'
// bounds (tools/Options.cpp), the plan reader's (ir/formats/PlanJson.cpp), the pipeline's
// (compiler/Pipeline.cpp) and the importer's (compiler/Import.cpp,
// compiler/torch/TorchCsv.cpp) are these.
// A bound is a sanity limit on input, far above any real run, that keeps the per-op tables
// (stages x microbatches x slices) and the loops over them small enough to allocate.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_IR_SUPPORT_LIMITS_H
#define PIPEC_IR_SUPPORT_LIMITS_H

#include <cstdint>

namespace pipec {

/// Any one parallel size or count given as a flag: --pp, --vpp, --microbatches, --seq-splits,
/// --tp, --dp, --microbatch-group-size, and each entry of `pipec plan`'s lists.
inline constexpr int64_t kMaxFlagCount = int64_t(1) << 24;
/// Pipeline stages (pp x vpp), and so pipeline ranks.
inline constexpr int64_t kMaxStages = 4096;
/// Microbatch units (microbatches x seq-splits), and units x stages: the per-op tables' size.
inline constexpr int64_t kMaxUnits = int64_t(1) << 24;
/// Ranks of one pipeline stage's replicas and shards (tp x dp).
inline constexpr int64_t kMaxTpDp = 65536;
/// GPUs `pipec plan` plans for.
inline constexpr int64_t kMaxGpus = int64_t(1) << 20;
/// Sequences (or microbatches) per step `pipec plan` plans for.
inline constexpr int64_t kMaxGlobalBatch = int64_t(1) << 40;
/// Layouts `pipec plan --top` lists.
inline constexpr int64_t kMaxTop = 1000;
/// Virtual stages per rank `pipec plan --max-vpp` tries.
inline constexpr int64_t kMaxSearchVpp = 64;
/// Worker threads `pipec plan --threads` starts.
inline constexpr int64_t kMaxThreads = 256;
/// Training steps (piperun --steps, --save-every).
inline constexpr int64_t kMaxSteps = 1000000;
/// Sequences per microbatch (`pipec spec --microbatch-size`).
inline constexpr int64_t kMaxSpecMicrobatchSize = int64_t(1) << 16;
/// Tokens per sequence (`pipec spec --seq-length`).
inline constexpr int64_t kMaxSpecSeqLength = int64_t(1) << 24;
/// The fields of a "transformer" model spec.
inline constexpr int64_t kMaxTransformerLayers = 100000;
inline constexpr int64_t kMaxHiddenSize = int64_t(1) << 20;
inline constexpr int64_t kMaxAttentionHeads = int64_t(1) << 16;
inline constexpr int64_t kMaxFfnHiddenSize = int64_t(1) << 22;
inline constexpr int64_t kMaxVocabSize = int64_t(1) << 27;
inline constexpr int64_t kMaxSeqLength = int64_t(1) << 27;
inline constexpr int64_t kMaxMicrobatchSize = int64_t(1) << 20;
/// What the cpu backend (the fp32 reference, runtime/Reference.cpp) runs: small models only.
inline constexpr int64_t kCpuMaxHiddenSize = 4096;
inline constexpr int64_t kCpuMaxSeqLength = 8192;
inline constexpr int64_t kCpuMaxVocabSize = int64_t(1) << 20;
inline constexpr int64_t kCpuMaxLayers = 256;
inline constexpr int64_t kCpuMaxMicrobatchSize = 64;
inline constexpr int64_t kCpuMaxThreads = 256; // pp x dp x tp, a thread each
inline constexpr int64_t kCpuMaxMicrobatches = int64_t(1) << 20;
inline constexpr int64_t kCpuMaxSeqSplits = 4096;
/// The largest input files read (larger ones are refused before reading): a model spec lists
/// at most kMaxLayers layers (a few hundred bytes each), a cluster spec is a dozen fields, a
/// plan holds at most a few million instructions.
inline constexpr uint64_t kMaxModelSpecBytes = uint64_t(256) << 20;
inline constexpr uint64_t kMaxClusterSpecBytes = uint64_t(1) << 20;
inline constexpr uint64_t kMaxHfConfigBytes = uint64_t(1) << 20;
inline constexpr uint64_t kMaxCostsBytes = uint64_t(64) << 20; // a pipecost/1 file
inline constexpr uint64_t kMaxPlanBytes = uint64_t(4) << 30;
inline constexpr uint64_t kMaxTextBytes = uint64_t(1) << 30; // a schedule text, any other input
inline constexpr uint64_t kMaxSafetensorsBytes = uint64_t(1) << 40;
inline constexpr uint64_t kMaxSafetensorsIndexBytes = uint64_t(64) << 20;
/// Elements of a safetensors tensor (and so each of its sizes).
inline constexpr uint64_t kMaxTensorElements = uint64_t(1) << 40;
/// A node of more GPUs than this is no node (NVLink domains hold hundreds).
inline constexpr int64_t kMaxGpusPerNode = int64_t(1) << 16;
/// A model of more layers than this is not one the compiler is meant for.
inline constexpr int64_t kMaxLayers = 1000000;

} // namespace pipec

#endif // PIPEC_IR_SUPPORT_LIMITS_H
