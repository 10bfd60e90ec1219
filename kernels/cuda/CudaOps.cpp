//===- CudaOps.cpp - host side of the CUDA ops: contexts, cuBLASLt matmuls ----===//
//
// Contexts and the matmuls; the hand-written kernels' entry points are in KernelOps.cpp. Every
// entry point validates its shape (an llvm::Error naming the argument), runs one cuBLASLt
// matmul and passes the status through the checked funnel of CudaCheck.h. Matmuls: our tensors are
// row-major, cuBLAS is column-major, and a row-major (r, c) matrix is the column-major (c, r) one;
// so each row-major product Y = A B is issued as Y^T = B^T A^T with the roles of the operands
// swapped. The derivation for each of the six products is next to it.
//
//===----------------------------------------------------------------------===//
#include "kernels/cuda/CudaOps.h"

#include "kernels/cuda/CudaCheck.h"
#include "kernels/cuda/DeviceMemory.h"
#include "kernels/cuda/Launch.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <array>
#include <cmath>
#include <map>
#include <utility>

namespace pipec::kernels::cuda {

static llvm::Error shapeError(const std::string &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(), message);
}

llvm::Expected<int> deviceCount() {
  int count = 0;
  PIPEC_CUDA_TRY(cudaGetDeviceCount(&count));
  return count;
}

//===--- Context and buffers ----------------------------------------------===//

static constexpr size_t kWorkspaceBytes = CudaContext::kWorkspaceBytes;

struct CudaContext::Impl {
  int device = 0;
  int computeCapability = 0;
  KernelConfig config;
  cudaStream_t stream = nullptr;
  bool ownsStream = false;
  cublasLtHandle_t lt = nullptr;
  void *workspace = nullptr;
  // Heuristic results by the matmul's shape, types and operand alignments: the query costs
  // more than a small matmul.
  std::map<std::array<int, 14>, cublasLtMatmulAlgo_t> algos;
  StreamOrderedAllocator streamOrdered;
  DeviceAllocator *allocator = &streamOrdered;
  bool sizing = false;

  // Frees whatever was created, so that create() can return early at any step.
  ~Impl() {
    if (workspace)
      (void)cudaFree(workspace);
    if (lt)
      (void)cublasLtDestroy(lt);
    if (stream && ownsStream)
      (void)cudaStreamDestroy(stream);
  }
};

CudaContext::CudaContext(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaContext::~CudaContext() = default;

llvm::Expected<std::unique_ptr<CudaContext>>
CudaContext::create(int device, const KernelConfig &config, void *stream) {
  auto impl = std::make_unique<Impl>();
  impl->device = device;
  impl->config = config;
  PIPEC_CUDA_TRY(cudaSetDevice(device));
  auto capability = computeCapabilityOf(device);
  if (!capability)
    return capability.takeError();
  impl->computeCapability = *capability;
  if (stream) {
    impl->stream = static_cast<cudaStream_t>(stream);
  } else {
    PIPEC_CUDA_TRY(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
    impl->ownsStream = true;
  }
  impl->streamOrdered.stream = impl->stream;
  PIPEC_CUBLAS_TRY(cublasLtCreate(&impl->lt));
  PIPEC_CUDA_TRY(cudaMalloc(&impl->workspace, kWorkspaceBytes));
  return std::unique_ptr<CudaContext>(new CudaContext(std::move(impl)));
}

int CudaContext::device() const { return impl_->device; }
void *CudaContext::stream() const { return impl_->stream; }
int CudaContext::computeCapability() const { return impl_->computeCapability; }
const KernelConfig &CudaContext::kernelConfig() const { return impl_->config; }

llvm::Error CudaContext::synchronize() {
  PIPEC_QUEUE_TRY(*this, cudaStreamSynchronize(impl_->stream));
  return llvm::Error::success();
}

llvm::Error CudaContext::upload(void *device, const void *host, size_t bytes) {
  PIPEC_QUEUE_TRY(*this,
                  cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, impl_->stream));
  PIPEC_QUEUE_TRY(*this, cudaStreamSynchronize(impl_->stream));
  return llvm::Error::success();
}

llvm::Error CudaContext::download(void *host, const void *device, size_t bytes) {
  PIPEC_QUEUE_TRY(*this,
                  cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, impl_->stream));
  PIPEC_QUEUE_TRY(*this, cudaStreamSynchronize(impl_->stream));
  return llvm::Error::success();
}

llvm::Error CudaContext::memsetZero(void *device, size_t bytes) {
  PIPEC_QUEUE_TRY(*this, cudaMemsetAsync(device, 0, bytes, impl_->stream));
  return llvm::Error::success();
}

void CudaContext::setAllocator(DeviceAllocator *allocator) {
  impl_->allocator = allocator ? allocator : &impl_->streamOrdered;
}

DeviceAllocator &CudaContext::allocator() { return *impl_->allocator; }

void CudaContext::setSizing(bool on) { impl_->sizing = on; }
bool CudaContext::sizing() const { return impl_->sizing; }

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
  CudaContext::Impl &impl = ctx.impl();
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
                                  &cached->second, impl.workspace, kWorkspaceBytes, impl.stream));
  if (g.bias && !biasEpilogue) // D is (m, n) column-major: n rows of m, ldc apart, row-major
    PIPEC_CUDA_TRY(launch::addRowBias(g.abType, g.c, g.bias, g.n, g.m, g.ldc, impl.stream));
  return llvm::Error::success();
}

static llvm::Error checkMatmulShape(const char *op, int n, int i, int o) {
  if (n < 0 || i <= 0 || o <= 0)
    return shapeError(
        fmt::format("{}: needs n >= 0 and i, o > 0 (got n {}, i {}, o {})", op, n, i, o));
  return llvm::Error::success();
}

llvm::Error matmulForward(CudaContext &ctx, DType dtype, void *out, const void *in, const void *w,
                          const void *bias, int n, int i, int o) {
  if (auto err = checkMatmulShape("matmulForward", n, i, o))
    return err;
  // Column-major: out^T (o, n) = W^T (o, i) . X^T (i, n); row-major W (i, o) is W^T with ld o.
  Gemm g;
  g.m = o, g.n = n, g.k = i;
  g.a = w, g.lda = o;
  g.b = in, g.ldb = i;
  g.c = out, g.ldc = o;
  g.abType = dtype;
  g.bias = bias;
  return runGemm(ctx, g);
}

llvm::Error matmulBackwardInput(CudaContext &ctx, DType dtype, void *dIn, const void *dOut,
                                const void *w, int n, int i, int o) {
  if (auto err = checkMatmulShape("matmulBackwardInput", n, i, o))
    return err;
  // dIn^T (i, n) = W (i, o) . dOut^T (o, n); W is stored as W^T (o, i), so op(A) = T.
  Gemm g;
  g.transA = true;
  g.m = i, g.n = n, g.k = o;
  g.a = w, g.lda = o;
  g.b = dOut, g.ldb = o;
  g.c = dIn, g.ldc = i;
  g.abType = dtype;
  return runGemm(ctx, g);
}

llvm::Error matmulBackwardWeight(CudaContext &ctx, DType dtype, float *dW, float *dBias,
                                 const void *in, const void *dOut, int n, int i, int o) {
  if (auto err = checkMatmulShape("matmulBackwardWeight", n, i, o))
    return err;
  if (n == 0)
    return llvm::Error::success();
  // dW^T (o, i) += dOut^T (o, n) . X (n, i); X is stored as X^T (i, n), so op(B) = T.
  Gemm g;
  g.transB = true;
  g.m = o, g.n = i, g.k = n;
  g.a = dOut, g.lda = o;
  g.b = in, g.ldb = i;
  g.c = dW, g.ldc = o;
  g.abType = dtype;
  g.cIsF32 = true;
  g.beta = 1.0f;
  if (auto err = runGemm(ctx, g))
    return err;
  if (dBias) {
    ScratchBuffer partials(ctx.allocator());
    if (auto err = partials.allocate(launch::columnSumScratchFloats(n, o, 1) * sizeof(float)))
      return err;
    PIPEC_QUEUE_TRY(ctx, launch::columnSumAccumulate(dtype, dBias, dOut, n, o, partials.as<float>(),
                                                     static_cast<cudaStream_t>(ctx.stream())));
  }
  return llvm::Error::success();
}

llvm::Error matmulTForward(CudaContext &ctx, DType dtype, void *out, const void *in, const void *w,
                           int n, int i, int o) {
  if (auto err = checkMatmulShape("matmulTForward", n, i, o))
    return err;
  // out^T (o, n) = W (o, i) . X^T (i, n); row-major W (o, i) is stored as W^T (i, o): op(A) = T.
  Gemm g;
  g.transA = true;
  g.m = o, g.n = n, g.k = i;
  g.a = w, g.lda = i;
  g.b = in, g.ldb = i;
  g.c = out, g.ldc = o;
  g.abType = dtype;
  return runGemm(ctx, g);
}

llvm::Error matmulTBackwardInput(CudaContext &ctx, DType dtype, void *dIn, const void *dOut,
                                 const void *w, int n, int i, int o) {
  if (auto err = checkMatmulShape("matmulTBackwardInput", n, i, o))
    return err;
  // dIn^T (i, n) = W^T (i, o) . dOut^T (o, n); W^T is how W (o, i) is stored, with ld i.
  Gemm g;
  g.m = i, g.n = n, g.k = o;
  g.a = w, g.lda = i;
  g.b = dOut, g.ldb = o;
  g.c = dIn, g.ldc = i;
  g.abType = dtype;
  return runGemm(ctx, g);
}

llvm::Error matmulTBackwardWeight(CudaContext &ctx, DType dtype, float *dW, const void *in,
                                  const void *dOut, int n, int i, int o) {
  if (auto err = checkMatmulShape("matmulTBackwardWeight", n, i, o))
    return err;
  if (n == 0)
    return llvm::Error::success();
  // dW^T (i, o) += X^T (i, n) . dOut (n, o); dOut is stored as dOut^T (o, n), so op(B) = T.
  Gemm g;
  g.transB = true;
  g.m = i, g.n = o, g.k = n;
  g.a = in, g.lda = i;
  g.b = dOut, g.ldb = o;
  g.c = dW, g.ldc = i;
  g.abType = dtype;
  g.cIsF32 = true;
  g.beta = 1.0f;
  return runGemm(ctx, g);
}

} // namespace pipec::kernels::cuda
