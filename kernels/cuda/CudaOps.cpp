//===- CudaOps.cpp - host side of the CUDA ops: contexts, cuBLASLt matmuls ----===//
//
// The matmuls and their part of a context (ContextImpl.h; the rest of the context is
// CudaContext.cpp's); the hand-written kernels' entry points are in KernelOps.cpp. Every
// entry point validates its shape (an llvm::Error naming the argument), runs one cuBLASLt
// matmul and passes the status through the checked funnel of CudaCheck.h. Matmuls: our tensors are
// row-major, cuBLAS is column-major, and a row-major (r, c) matrix is the column-major (c, r) one;
// so each row-major product Y = A B is issued as Y^T = B^T A^T with the roles of the operands
// swapped. The six products are one table (kMatmuls), each row with its derivation.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/CudaOps.h"

#include "kernels/Try.h"
#include "kernels/cuda/ContextImpl.h"
#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/DeviceMemory.h"
#include "kernels/cuda/Launch.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <map>
#include <utility>

namespace pipec::kernels::cuda {

static llvm::Error shapeError(const std::string &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(), message);
}

//===--- The matmuls' part of a context ------------------------------------===//

static constexpr size_t kWorkspaceBytes = CudaContext::kWorkspaceBytes;

/// cuBLASLt's handle, its workspace, and the heuristic's results by the matmul's shape, types
/// and operand alignments (the query costs more than a small matmul).
struct MatmulState {
  cublasLtHandle_t lt = nullptr;
  void *workspace = nullptr;
  std::map<std::array<int, 14>, cublasLtMatmulAlgo_t> algos;
  ~MatmulState() {
    if (workspace)
      (void)cudaFree(workspace);
    if (lt)
      (void)cublasLtDestroy(lt);
  }
};

void MatmulStateDeleter::operator()(MatmulState *state) const { delete state; }

llvm::Expected<MatmulStatePtr> createMatmulState(cudaStream_t) {
  MatmulStatePtr state(new MatmulState);
  PIPEC_CUBLAS_TRY(cublasLtCreate(&state->lt));
  PIPEC_CUDA_TRY(cudaMalloc(&state->workspace, kWorkspaceBytes));
  return state;
}

//===--- Matmuls ----------------------------------------------------------===//

namespace {

/// One column-major D (m, n) = alpha op(A) op(B) + beta C [+ bias (m) per column], C = D.
struct Gemm {
  bool transA = false, transB = false;
  int m = 0, n = 0, k = 0;
  const void *a = nullptr;
  int lda = 0;
  const void *b = nullptr;
  int ldb = 0;
  void *c = nullptr;
  int ldc = 0;
  DType abType = DType::F32; // A and B
  bool cIsF32 = false;       // C/D fp32 whatever abType (weight gradients)
  float beta = 0.0f;
  const void *bias = nullptr; // (m), abType
};

template <typename T, cublasStatus_t (*Destroy)(T)> struct LtHandle {
  T handle = nullptr;
  ~LtHandle() {
    if (handle)
      (void)Destroy(handle);
  }
};
using MatmulDesc = LtHandle<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using Layout = LtHandle<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using Preference = LtHandle<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

cudaDataType_t cudaType(DType dtype) {
  switch (dtype) {
  case DType::F32:
    return CUDA_R_32F;
  case DType::BF16:
    return CUDA_R_16BF;
  }
  llvm_unreachable("unknown dtype");
}

/// The largest power of two (up to 256) dividing the address.
uint32_t alignmentOf(const void *ptr) {
  uint32_t align = 256;
  while (align > 1 && reinterpret_cast<uintptr_t>(ptr) % align != 0)
    align /= 2;
  return align;
}

} // namespace

static llvm::Error runGemm(CudaContext &ctx, const Gemm &g) {
  if (g.m == 0 || g.n == 0 || ctx.sizing())
    return llvm::Error::success();
  MatmulState &impl = *ctx.impl().matmul;
  const cudaStream_t stream = static_cast<cudaStream_t>(ctx.stream());
  const cudaDataType_t abType = cudaType(g.abType);
  const cudaDataType_t cType = g.cIsF32 ? CUDA_R_32F : abType;

  MatmulDesc desc;
  PIPEC_CUBLAS_TRY(cublasLtMatmulDescCreate(&desc.handle, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opA = g.transA ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opB = g.transB ? CUBLAS_OP_T : CUBLAS_OP_N;
  PIPEC_CUBLAS_TRY(
      cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_TRANSA, &opA, sizeof(opA)));
  PIPEC_CUBLAS_TRY(
      cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_TRANSB, &opB, sizeof(opB)));
  // cuBLASLt takes no alignment preference for the bias, and a kernel it picks may assume 16
  // bytes: a less aligned bias (a slice of a packed parameter buffer) is added after the GEMM by
  // a kernel of ours instead (one more rounding of the output in bf16).
  const bool biasEpilogue = g.bias && alignmentOf(g.bias) >= 16;
  if (biasEpilogue) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    PIPEC_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                    &epilogue, sizeof(epilogue)));
    PIPEC_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                    &g.bias, sizeof(g.bias)));
  }
  // Stored shapes, before op(): A is (m, k) or (k, m), B is (k, n) or (n, k).
  Layout aLayout, bLayout, cLayout;
  PIPEC_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&aLayout.handle, abType, g.transA ? g.k : g.m,
                                              g.transA ? g.m : g.k, g.lda));
  PIPEC_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&bLayout.handle, abType, g.transB ? g.n : g.k,
                                              g.transB ? g.k : g.n, g.ldb));
  PIPEC_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&cLayout.handle, cType, g.m, g.n, g.ldc));

  // Algorithms are chosen for the operands' alignment (cuBLASLt assumes 256 bytes unless told),
  // so that pointers into the middle of a buffer (a K/V cache slice) stay valid.
  const uint32_t alignA = alignmentOf(g.a), alignB = alignmentOf(g.b), alignC = alignmentOf(g.c);
  const std::array<int, 14> key{g.transA,    g.transB,    g.m,         g.n,           g.k,
                                g.lda,       g.ldb,       g.ldc,       int(g.abType), g.cIsF32,
                                int(alignA), int(alignB), int(alignC), biasEpilogue};
  auto cached = impl.algos.find(key);
  if (cached == impl.algos.end()) {
    Preference preference;
    PIPEC_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&preference.handle));
    PIPEC_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(
        preference.handle, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspaceBytes,
        sizeof(kWorkspaceBytes)));
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignA},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignB},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignC},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignC},
    };
    for (const auto &[attribute, bytes] : alignments)
      PIPEC_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(preference.handle, attribute, &bytes,
                                                            sizeof(bytes)));
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        impl.lt, desc.handle, aLayout.handle, bLayout.handle, cLayout.handle, cLayout.handle,
        preference.handle, 1, &result, &found);
    if (status != CUBLAS_STATUS_NOT_SUPPORTED)
      PIPEC_CUBLAS_TRY(status);
    // No algorithm is NOT_SUPPORTED, or success with none found: either way, name the GEMM.
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || found == 0)
      return shapeError(fmt::format(
          "cublasLtMatmulAlgoGetHeuristic found no algorithm for m {} n {} k {} ({}, {} output, "
          "op {}{}{})",
          g.m, g.n, g.k, toString(g.abType), g.cIsF32 ? "fp32" : toString(g.abType),
          g.transA ? 'T' : 'N', g.transB ? 'T' : 'N', biasEpilogue ? ", bias" : ""));
    cached = impl.algos.emplace(key, result.algo).first;
  }
  const float alpha = 1.0f;
  PIPEC_CUBLAS_TRY(cublasLtMatmul(impl.lt, desc.handle, &alpha, g.a, aLayout.handle, g.b,
                                  bLayout.handle, &g.beta, g.c, cLayout.handle, g.c, cLayout.handle,
                                  &cached->second, impl.workspace, kWorkspaceBytes, stream));
  if (g.bias && !biasEpilogue) // D is (m, n) column-major: n rows of m, ldc apart, row-major
    PIPEC_CUDA_TRY(launch::addRowBias(g.abType, g.c, g.bias, g.n, g.m, g.ldc, stream));
  return llvm::Error::success();
}

static llvm::Error checkMatmulShape(const char *op, int n, int i, int o) {
  if (n < 0 || i <= 0 || o <= 0)
    return shapeError(
        fmt::format("{}: needs n >= 0 and i, o > 0 (got n {}, i {}, o {})", op, n, i, o));
  return llvm::Error::success();
}

namespace {

/// A size of the row-major product: its rows n, the input's width i, the output's width o.
enum class Dim { N, I, O };

/// One of CudaOps.h's six products as one column-major GEMM (Gemm): which stored operand is
/// transposed, the GEMM's m, n, k and leading dimensions in terms of (n, i, o), and whether it
/// accumulates a weight gradient (fp32 C, beta 1; nothing to add for n = 0). The operands A, B
/// and C are given per product below.
struct MatmulForm {
  const char *name;
  bool transA, transB;
  Dim m, n, k, lda, ldb, ldc;
  bool weightGradient;
};

enum MatmulKind {
  Forward,
  BackwardInput,
  BackwardWeight,
  TForward,
  TBackwardInput,
  TBackwardWeight
};

constexpr MatmulForm kMatmuls[] = {
    // out^T (o, n) = W^T (o, i) . X^T (i, n); row-major W (i, o) is W^T with ld o.
    // A = W, B = X, C = out.
    {"matmulForward", false, false, Dim::O, Dim::N, Dim::I, Dim::O, Dim::I, Dim::O, false},
    // dIn^T (i, n) = W (i, o) . dOut^T (o, n); W is stored as W^T (o, i), so op(A) = T.
    // A = W, B = dOut, C = dIn.
    {"matmulBackwardInput", true, false, Dim::I, Dim::N, Dim::O, Dim::O, Dim::O, Dim::I, false},
    // dW^T (o, i) += dOut^T (o, n) . X (n, i); X is stored as X^T (i, n), so op(B) = T.
    // A = dOut, B = X, C = dW.
    {"matmulBackwardWeight", false, true, Dim::O, Dim::I, Dim::N, Dim::O, Dim::I, Dim::O, true},
    // out^T (o, n) = W (o, i) . X^T (i, n); row-major W (o, i) is stored as W^T (i, o):
    // op(A) = T. A = W, B = X, C = out.
    {"matmulTForward", true, false, Dim::O, Dim::N, Dim::I, Dim::I, Dim::I, Dim::O, false},
    // dIn^T (i, n) = W^T (i, o) . dOut^T (o, n); W^T is how W (o, i) is stored, with ld i.
    // A = W, B = dOut, C = dIn.
    {"matmulTBackwardInput", false, false, Dim::I, Dim::N, Dim::O, Dim::I, Dim::O, Dim::I, false},
    // dW^T (i, o) += X^T (i, n) . dOut (n, o); dOut is stored as dOut^T (o, n), so op(B) = T.
    // A = X, B = dOut, C = dW.
    {"matmulTBackwardWeight", false, true, Dim::I, Dim::O, Dim::N, Dim::I, Dim::O, Dim::I, true},
};

/// Every operand is packed: a leading dimension is its stored matrix's rows (column-major A is
/// stored (m, k), or (k, m) under op T; B (k, n) or (n, k); C (m, n)).
constexpr bool packed(const MatmulForm &f) {
  return f.lda == (f.transA ? f.k : f.m) && f.ldb == (f.transB ? f.n : f.k) && f.ldc == f.m;
}
static_assert(std::all_of(std::begin(kMatmuls), std::end(kMatmuls), packed),
              "a matmul form's leading dimensions do not match its shapes");

/// The product `kind` of kMatmuls: C = A . B (+ bias, which only the forward takes) in the
/// form's terms.
llvm::Error matmul(CudaContext &ctx, MatmulKind kind, DType dtype, void *c, const void *a,
                   const void *b, const void *bias, int n, int i, int o) {
  const MatmulForm &form = kMatmuls[kind];
  if (auto err = checkMatmulShape(form.name, n, i, o))
    return err;
  if (form.weightGradient && n == 0)
    return llvm::Error::success();
  auto size = [&](Dim d) { return d == Dim::N ? n : d == Dim::I ? i : o; };
  Gemm g;
  g.transA = form.transA;
  g.transB = form.transB;
  g.m = size(form.m), g.n = size(form.n), g.k = size(form.k);
  g.a = a, g.lda = size(form.lda);
  g.b = b, g.ldb = size(form.ldb);
  g.c = c, g.ldc = size(form.ldc);
  g.abType = dtype;
  g.cIsF32 = form.weightGradient;
  g.beta = form.weightGradient ? 1.0f : 0.0f;
  g.bias = bias;
  return runGemm(ctx, g);
}

} // namespace

llvm::Error matmulForward(CudaContext &ctx, DType dtype, void *out, const void *in, const void *w,
                          const void *bias, int n, int i, int o) {
  return matmul(ctx, Forward, dtype, out, w, in, bias, n, i, o);
}

llvm::Error matmulBackwardInput(CudaContext &ctx, DType dtype, void *dIn, const void *dOut,
                                const void *w, int n, int i, int o) {
  return matmul(ctx, BackwardInput, dtype, dIn, w, dOut, nullptr, n, i, o);
}

llvm::Error matmulBackwardWeight(CudaContext &ctx, DType dtype, float *dW, float *dBias,
                                 const void *in, const void *dOut, int n, int i, int o) {
  PIPEC_TRY(matmul(ctx, BackwardWeight, dtype, dW, dOut, in, nullptr, n, i, o));
  if (!dBias || n == 0)
    return llvm::Error::success();
  ScratchBuffer partials(ctx.allocator());
  PIPEC_TRY(partials.allocate(launch::columnSumScratchFloats(n, o, 1) * sizeof(float)));
  PIPEC_QUEUE_TRY(ctx, launch::columnSumAccumulate(dtype, dBias, dOut, n, o, partials.as<float>(),
                                                   static_cast<cudaStream_t>(ctx.stream())));
  return llvm::Error::success();
}

llvm::Error matmulTForward(CudaContext &ctx, DType dtype, void *out, const void *in, const void *w,
                           int n, int i, int o) {
  return matmul(ctx, TForward, dtype, out, w, in, nullptr, n, i, o);
}

llvm::Error matmulTBackwardInput(CudaContext &ctx, DType dtype, void *dIn, const void *dOut,
                                 const void *w, int n, int i, int o) {
  return matmul(ctx, TBackwardInput, dtype, dIn, w, dOut, nullptr, n, i, o);
}

llvm::Error matmulTBackwardWeight(CudaContext &ctx, DType dtype, float *dW, const void *in,
                                  const void *dOut, int n, int i, int o) {
  return matmul(ctx, TBackwardWeight, dtype, dW, in, dOut, nullptr, n, i, o);
}

} // namespace pipec::kernels::cuda
