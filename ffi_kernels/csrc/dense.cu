// The feed-forward block's backward GEMM with relu's backward in its epilogue (cuBLASLt, epilogue DRELU_BGRAD),
// so dropout(relu(.))'s gradient costs no pass of its own (math and shapes: ls_jax/ops/dense.py):
//
//   ls_dense_relu_grad(dy (R, N), kernel (F, N), positive uint8 (R, F / 8)) -> (dx (R, F), dbias (F,), workspace)
//     dx    = (dy @ kernel^T) * scale * [bit (r, f) of positive]        attribute scale: f32 (1 / (1 - rate))
//     dbias = sum_rows(dx)
//
// positive is ls_bias_relu_dropout_fwd's mask (bias.cu): row-major (R, F) bits, byte r * F / 8 + f / 8, bit f % 8.
// In cuBLASLt's column-major terms that is the ReLU bit-mask of the (F, R) output with leading dimension F bits,
// which cuBLASLt requires to be a multiple of 128. dy, kernel, dx and dbias share one dtype, bf16 or f16 (cuBLASLt
// writes the bias gradient in the output's type); accumulation is f32. workspace is uint8 scratch for cuBLASLt.
#include <cublasLt.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "common.cuh"

namespace ls {
namespace {

constexpr int64_t kMaskAlignment = 128;  // cuBLASLt: a ReLU bit-mask's leading dimension, in bits

ffi::Error lt_error(cublasStatus_t status, std::string_view call) {
  if (status == CUBLAS_STATUS_SUCCESS) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(call) + " failed: " + cublasLtGetStatusName(status));
}

// One cuBLASLt handle per device, created on first use and kept for the life of the process.
ffi::Error lt_handle(int device, cublasLtHandle_t& handle) {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static cublasLtHandle_t handles[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return ffi::Error::Internal("CUDA device index out of range");
  std::lock_guard<std::mutex> lock(mutex);
  if (handles[device] == nullptr) LS_RETURN_IF_ERROR(lt_error(cublasLtCreate(&handles[device]), "cublasLtCreate"));
  handle = handles[device];
  return ffi::Error::Success();
}

struct DescDeleter {
  void operator()(cublasLtMatmulDesc_t desc) const { cublasLtMatmulDescDestroy(desc); }
  void operator()(cublasLtMatrixLayout_t layout) const { cublasLtMatrixLayoutDestroy(layout); }
  void operator()(cublasLtMatmulPreference_t preference) const { cublasLtMatmulPreferenceDestroy(preference); }
};
using MatmulDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>, DescDeleter>;
using Layout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>, DescDeleter>;
using Preference = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, DescDeleter>;

ffi::Error make_layout(cudaDataType_t type, int64_t rows, int64_t cols, Layout& layout) {
  cublasLtMatrixLayout_t raw = nullptr;
  LS_RETURN_IF_ERROR(lt_error(cublasLtMatrixLayoutCreate(&raw, type, rows, cols, rows), "cublasLtMatrixLayoutCreate"));
  layout.reset(raw);
  return ffi::Error::Success();
}

template <typename Value>
ffi::Error set_attribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const Value& value) {
  return lt_error(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)),
                  "cublasLtMatmulDescSetAttribute");
}

// The largest power of two, up to 256, that divides every address: cuBLASLt picks kernels by pointer alignment.
int alignment(std::initializer_list<const void*> pointers) {
  uintptr_t bits = 256;
  for (const void* pointer : pointers) bits |= reinterpret_cast<uintptr_t>(pointer);
  return static_cast<int>(bits & (~bits + 1));
}

// The heuristic's first algorithm for each problem, looked up once per process: the lookup costs tens of
// microseconds of host time, and a training step makes the same call once per layer.
using ProblemKey = std::tuple<int, int64_t, int64_t, int64_t, int, size_t, int>;  // device, R, N, F, dtype, ws, align

ffi::Error find_algorithm(cublasLtHandle_t handle, const ProblemKey& key, cublasLtMatmulDesc_t desc,
                          cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t d,
                          size_t workspace_bytes, cublasLtMatmulAlgo_t& algorithm) {
  static std::mutex mutex;
  static std::map<ProblemKey, cublasLtMatmulAlgo_t> found;
  std::lock_guard<std::mutex> lock(mutex);
  const auto cached = found.find(key);
  if (cached != found.end()) {
    algorithm = cached->second;
    return ffi::Error::Success();
  }
  cublasLtMatmulPreference_t raw = nullptr;
  LS_RETURN_IF_ERROR(lt_error(cublasLtMatmulPreferenceCreate(&raw), "cublasLtMatmulPreferenceCreate"));
  const Preference preference(raw);
  LS_RETURN_IF_ERROR(lt_error(cublasLtMatmulPreferenceSetAttribute(preference.get(),
                                                                   CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                                   &workspace_bytes, sizeof(workspace_bytes)),
                              "cublasLtMatmulPreferenceSetAttribute"));
  cublasLtMatmulHeuristicResult_t result = {};
  int count = 0;
  LS_RETURN_IF_ERROR(lt_error(
      cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, preference.get(), 1, &result, &count),
      "cublasLtMatmulAlgoGetHeuristic"));
  if (count == 0)
    return ffi::Error::Internal("cuBLASLt has no algorithm for this GEMM with the DRELU_BGRAD epilogue (R=" +
                                std::to_string(std::get<1>(key)) + ", N=" + std::to_string(std::get<2>(key)) +
                                ", F=" + std::to_string(std::get<3>(key)) + ")");
  found.emplace(key, result.algo);
  algorithm = result.algo;
  return ffi::Error::Success();
}

ffi::Error check(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& kernel, const ffi::Buffer<ffi::U8>& positive,
                 const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dbias) {
  LS_RETURN_IF_ERROR(require(dy.dimensions().size() == 2 && kernel.dimensions().size() == 2,
                             "dy and kernel must be 2-D (R, N) and (F, N), got " + shape_string(dy.dimensions()) +
                                 " and " + shape_string(kernel.dimensions())));
  const ffi::DataType dtype = dy.element_type();
  LS_RETURN_IF_ERROR(require(dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16,
                             std::string("dy must be bfloat16 or float16, got ") + dtype_name(dtype)));
  for (const ffi::AnyBuffer* buffer : {&kernel, &dx, &dbias})
    LS_RETURN_IF_ERROR(require(buffer->element_type() == dtype,
                               std::string("kernel, dx and dbias must have dy's dtype ") + dtype_name(dtype) +
                                   ", got " + dtype_name(buffer->element_type())));
  const int64_t rows = dy.dimensions()[0], n = dy.dimensions()[1], f = kernel.dimensions()[0];
  LS_RETURN_IF_ERROR(require(kernel.dimensions()[1] == n, "kernel has shape " + shape_string(kernel.dimensions()) +
                                                              " but dy has " + shape_string(dy.dimensions()) +
                                                              "; their last axes must match"));
  LS_RETURN_IF_ERROR(require(rows > 0 && n > 0 && f > 0, "dy and kernel must not be empty"));
  LS_RETURN_IF_ERROR(require(f % kMaskAlignment == 0, "the kernel's F = " + std::to_string(f) +
                                                          " must be a multiple of 128 (cuBLASLt's ReLU bit-mask)"));
  LS_RETURN_IF_ERROR(require_shape("positive", positive.dimensions(), {rows, f / 8}));
  LS_RETURN_IF_ERROR(require_shape("dx", dx.dimensions(), {rows, f}));
  return require_shape("dbias", dbias.dimensions(), {f});
}

ffi::Error dense_relu_grad(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer kernel,
                           ffi::Buffer<ffi::U8> positive, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                           float scale) {
  LS_RETURN_IF_ERROR(check(dy, kernel, positive, *dx, *dbias));
  const int64_t rows = dy.dimensions()[0], n = dy.dimensions()[1], f = kernel.dimensions()[0];
  const cudaDataType_t type = dy.element_type() == ffi::DataType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return ffi::Error::Internal("cannot query the current CUDA device");
  cublasLtHandle_t handle = nullptr;
  LS_RETURN_IF_ERROR(lt_handle(device, handle));

  // Column-major, as cuBLASLt sees these row-major arrays: D (F, R) = op(A) (F, N) op(B) (N, R) with A the
  // kernel stored (N, F) and transposed, B = dy stored (N, R).
  cublasLtMatmulDesc_t raw_desc = nullptr;
  LS_RETURN_IF_ERROR(
      lt_error(cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate"));
  const MatmulDesc desc(raw_desc);
  const void* mask = positive.untyped_data();
  void* bias_gradient = dbias->untyped_data();
  LS_RETURN_IF_ERROR(set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T));
  LS_RETURN_IF_ERROR(set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N));
  LS_RETURN_IF_ERROR(set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_DRELU_BGRAD));
  LS_RETURN_IF_ERROR(set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, mask));
  LS_RETURN_IF_ERROR(set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, f));
  LS_RETURN_IF_ERROR(set_attribute(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_gradient));
  Layout a, b, d;
  LS_RETURN_IF_ERROR(make_layout(type, n, f, a));
  LS_RETURN_IF_ERROR(make_layout(type, n, rows, b));
  LS_RETURN_IF_ERROR(make_layout(type, f, rows, d));

  const size_t workspace_bytes = workspace->element_count();
  const ProblemKey key{device,
                       rows,
                       n,
                       f,
                       static_cast<int>(type),
                       workspace_bytes,
                       alignment({dy.untyped_data(), kernel.untyped_data(), dx->untyped_data(), mask, bias_gradient,
                                  workspace->untyped_data()})};
  cublasLtMatmulAlgo_t algorithm;
  LS_RETURN_IF_ERROR(find_algorithm(handle, key, desc.get(), a.get(), b.get(), d.get(), workspace_bytes, algorithm));
  const float beta = 0.0f;
  return lt_error(cublasLtMatmul(handle, desc.get(), &scale, kernel.untyped_data(), a.get(), dy.untyped_data(),
                                 b.get(), &beta, dx->untyped_data(), d.get(), dx->untyped_data(), d.get(),
                                 &algorithm, workspace->untyped_data(), workspace_bytes, stream),
                  "cublasLtMatmul");
}

}  // namespace

LS_FFI_TARGET(ls_dense_relu_grad, dense_relu_grad,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U8>>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::Buffer<ffi::U8>>()
                  .Attr<float>("scale"));

}  // namespace ls
