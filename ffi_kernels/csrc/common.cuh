// Shared building blocks of the ls-jax CUDA kernels: target registration, errors, dtype dispatch, 16-byte
// vector access with f32 conversion, warp and row-group reductions, Philox dropout and launch sizing.
//
// Conventions: tensors are row-major; storage is f32, bf16 or f16 and every kernel computes in f32 registers;
// handlers validate shapes and dtypes and return ffi::Error (never abort, never synchronize, never allocate).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>

#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ls {

namespace ffi = ::xla::ffi;

// ---- registration ---------------------------------------------------------------------------------------

// Defines the extern "C" handler `name` (binding as in XLA_FFI_DEFINE_HANDLER_SYMBOL), declares it safe to
// record into CUDA graphs (it only enqueues work on the stream XLA gives it) and registers it as target `name`.
#define LS_FFI_TARGET(name, impl, binding)                                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, binding, {::xla::ffi::Traits::kCmdBufferCompatible}); \
  LS_REGISTER_TARGET(name)

// ---- errors ---------------------------------------------------------------------------------------------

#define LS_RETURN_IF_ERROR(expr)       \
  do {                                 \
    ::xla::ffi::Error ls_error_ = (expr); \
    if (!ls_error_.success()) return ls_error_; \
  } while (0)

inline ffi::Error require(bool ok, const std::string& message) {
  return ok ? ffi::Error::Success() : ffi::Error::InvalidArgument(message);
}

// The error of the last kernel launch on this thread (bad configuration, missing kernel image, ...), if any.
inline ffi::Error launch_error(std::string_view kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(kernel) + " launch failed: " + cudaGetErrorString(status));
}

// ---- shapes ---------------------------------------------------------------------------------------------

inline std::string shape_string(ffi::AnyBuffer::Dimensions dims) {
  std::string text = "(";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + (dims.size() == 1 ? ",)" : ")");
}

// Size of the last axis (1 for a scalar).
inline int64_t last_dim(ffi::AnyBuffer::Dimensions dims) { return dims.size() == 0 ? 1 : dims.back(); }

// Product of every axis but the last: the number of rows of the tensor seen as (rows, last_dim).
inline int64_t leading_rows(ffi::AnyBuffer::Dimensions dims) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];
  return rows;
}

inline bool same_dims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

inline ffi::Error require_same_shape(std::string_view name, const ffi::AnyBuffer& buffer, std::string_view ref_name,
                                     const ffi::AnyBuffer& ref) {
  return require(same_dims(buffer.dimensions(), ref.dimensions()),
                 std::string(name) + " has shape " + shape_string(buffer.dimensions()) + " but " +
                     std::string(ref_name) + " has " + shape_string(ref.dimensions()));
}

// ---- dtypes ---------------------------------------------------------------------------------------------

inline const char* dtype_name(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::PRED: return "bool";
    default: return "an unsupported dtype";
  }
}

template <typename T>
constexpr ffi::DataType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return ffi::DataType::F32;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return ffi::DataType::BF16;
  if constexpr (std::is_same_v<T, __half>) return ffi::DataType::F16;
}

// Calls body(T{}) with T the storage type of `dtype` (float, __nv_bfloat16 or __half); an InvalidArgument
// error naming `what` for any other dtype.
template <typename Body>
ffi::Error dispatch_float(ffi::DataType dtype, std::string_view what, Body&& body) {
  switch (dtype) {
    case ffi::DataType::F32: return body(float{});
    case ffi::DataType::BF16: return body(__nv_bfloat16{});
    case ffi::DataType::F16: return body(__half{});
    default:
      return ffi::Error::InvalidArgument(std::string(what) + " must be float32, bfloat16 or float16, got " +
                                         dtype_name(dtype));
  }
}

// Parameters (gamma, beta, bias, tables) are float32 or the activation dtype T: calls body(P{}) for that P.
template <typename T, typename Body>
ffi::Error dispatch_param(ffi::DataType dtype, std::string_view what, Body&& body) {
  if (dtype == ffi::DataType::F32) return body(float{});
  if constexpr (!std::is_same_v<T, float>) {
    if (dtype == dtype_of<T>()) return body(T{});
  }
  return ffi::Error::InvalidArgument(std::string(what) + " must be float32 or " + dtype_name(dtype_of<T>()) +
                                     " (the activation dtype), got " + dtype_name(dtype));
}

// ---- conversion and vector access -----------------------------------------------------------------------

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// Round to nearest even, as XLA's convert does.
template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
}

// v rounded to T and back: the value a T store and load would give.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// Elements of T in one 16-byte access: the natural vector width of a kernel over T.
template <typename T>
inline constexpr int kVecWidth = 16 / sizeof(T);

// N elements of T in memory, aligned like one access of min(16, N * sizeof(T)) bytes. N * sizeof(T) is
// sizeof(T) (scalar), 16 or 32: the latter is two 16-byte accesses, used when a vector of a 16-bit
// activation meets an f32 parameter.
template <typename T, int N>
struct alignas((N * sizeof(T)) < 16 ? N * sizeof(T) : 16) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ void load_floats(const T* __restrict__ ptr, float (&out)[N]) {
  const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(ptr);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(pack.v[i]);
}

template <int N, typename T>
__device__ __forceinline__ void store_floats(T* __restrict__ ptr, const float (&in)[N]) {
  Pack<T, N> pack;
#pragma unroll
  for (int i = 0; i < N; ++i) pack.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, N>*>(ptr) = pack;
}

// store_floats with every 16 bytes written by one explicit vector store (st.global.wb.v4) when W elements of T
// fill whole 16-byte vectors, else store_floats itself. In grid-stride, two-sweep and multi-tensor loops nvcc
// splits some 16-byte Pack copies into 4-byte stores and does not merge them back; this keeps them 16 bytes wide.
template <int W, typename T>
__device__ __forceinline__ void store_vector(T* __restrict__ ptr, const float (&v)[W]) {
  constexpr int kBytes = W * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    Pack<T, W> pack;
#pragma unroll
    for (int i = 0; i < W; ++i) pack.v[i] = from_float<T>(v[i]);
    uint4 words[kBytes / 16];
    memcpy(words, &pack, kBytes);
    uint4* out = reinterpret_cast<uint4*>(ptr);
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) __stwb(out + i, words[i]);
  } else {
    store_floats<W>(ptr, v);
  }
}

inline bool is_aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// Whether rows of `cols` elements of T can be read and written as 16-byte vectors (kVecWidth<T> elements): cols
// is a multiple of the width and every pointer is 16-byte aligned (a null pointer, an absent operand, passes).
template <typename T>
bool vectorizable(int64_t cols, std::initializer_list<const void*> pointers) {
  if (cols % kVecWidth<T> != 0) return false;
  for (const void* pointer : pointers)
    if (pointer != nullptr && !is_aligned(pointer, 16)) return false;
  return true;
}

// The same over buffers (a null pointer, an absent optional buffer, passes).
template <typename T>
bool vectorizable(int64_t cols, std::initializer_list<const ffi::AnyBuffer*> buffers) {
  for (const ffi::AnyBuffer* buffer : buffers)
    if (buffer != nullptr && !is_aligned(buffer->untyped_data(), 16)) return false;
  return cols % kVecWidth<T> == 0;
}

// A row maximum that is not finite (every logit -inf) is replaced by 0, as XLA's softmax does, so the
// exponentials of the row are all 0 and its probabilities 0.
__device__ __forceinline__ float finite_or_zero(float m) { return isfinite(m) ? m : 0.0f; }

// ---- reductions -----------------------------------------------------------------------------------------

struct SumOp {
  static constexpr float kIdentity = 0.0f;
  __device__ __forceinline__ static float apply(float a, float b) { return a + b; }
};

struct MaxOp {
  static constexpr float kIdentity = -INFINITY;
  __device__ __forceinline__ static float apply(float a, float b) { return fmaxf(a, b); }
};

// Reduces each of v[0..K) over the 32 lanes of the warp; every lane receives the results.
template <typename Op, int K>
__device__ __forceinline__ void warp_reduce(float (&v)[K]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = Op::apply(v[k], __shfl_xor_sync(0xffffffffu, v[k], offset));
  }
}

// Shared memory a group_reduce of K values needs: one float per value per warp of the block.
template <int K>
inline constexpr int kGroupReduceScratch = 32 * K;

// Reduces each of v[0..K) over a row group: the blockDim.x threads sharing threadIdx.y (blockDim.x is a
// multiple of 32, so groups are whole warps). Every thread of the block must call it, with the same K, because
// a group wider than a warp synchronizes the block; every thread of a group receives its group's results.
// The order of the reduction is fixed, so results are deterministic. `scratch`: kGroupReduceScratch<K>
// floats of shared memory.
template <typename Op, int K>
__device__ __forceinline__ void group_reduce(float (&v)[K], float* scratch) {
  warp_reduce<Op>(v);
  const int warps_per_group = blockDim.x / 32;
  if (warps_per_group == 1) return;
  const int warp = (threadIdx.y * blockDim.x + threadIdx.x) / 32;
  const int first_warp = threadIdx.y * warps_per_group;
  __syncthreads();  // an earlier call may still be reading scratch
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) scratch[k * 32 + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float total = scratch[k * 32 + first_warp];
    for (int w = 1; w < warps_per_group; ++w) total = Op::apply(total, scratch[k * 32 + first_warp + w]);
    v[k] = total;
  }
}

template <typename Op>
__device__ __forceinline__ float group_reduce(float v, float* scratch) {
  float values[1] = {v};
  group_reduce<Op, 1>(values, scratch);
  return values[0];
}

// ---- Philox dropout -------------------------------------------------------------------------------------

// Philox-4x32-10 (Salmon et al., 2011), word for word as ls_jax/ops/random.py computes it.
__host__ __device__ inline uint4 philox4x32_10(uint4 counter, uint2 key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key.x += kW0;
      key.y += kW1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kM0) * counter.x;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * counter.z;
    counter = make_uint4(static_cast<uint32_t>(p1 >> 32) ^ counter.y ^ key.x, static_cast<uint32_t>(p1),
                         static_cast<uint32_t>(p0 >> 32) ^ counter.w ^ key.y, static_cast<uint32_t>(p0));
  }
  return counter;
}

// One Philox call serves eight consecutive elements (row-major flat index of a dropped tensor), each a 16-bit
// draw: element i takes half i % 2 (0 the low half) of word (i % 8) / 2 of the call at counter i / 8.
inline constexpr int kDrawsPerCall = 8;

__host__ __device__ inline uint4 dropout_words(uint2 key, uint64_t call) {
  return philox4x32_10(make_uint4(static_cast<uint32_t>(call), 0u, 0u, 0u), key);
}

__host__ __device__ inline uint32_t word_of(uint4 words, uint32_t index) {
  return index == 0 ? words.x : index == 1 ? words.y : index == 2 ? words.z : words.w;
}

// Draw `index` (0..7) of a call's words.
__host__ __device__ inline uint32_t draw_of(uint4 words, uint32_t index) {
  return (word_of(words, index / 2) >> (16 * (index % 2))) & 0xffffu;
}

// The 16-bit draw of the element at flat index i.
__host__ __device__ inline uint32_t dropout_draw(uint2 key, uint64_t i) {
  return draw_of(dropout_words(key, i / kDrawsPerCall), static_cast<uint32_t>(i % kDrawsPerCall));
}

// What a handler passes to a kernel that drops elements: the device seed (uint32[2], the Philox key), the
// keep threshold (an element is kept iff its draw >= threshold) and the multiplier 1 / (1 - rate) of kept
// elements, both computed by the Python wrapper exactly as the XLA implementation computes them.
struct DropoutParams {
  const uint32_t* seed;
  uint32_t threshold;
  float scale;

  // Rate 0 arrives as threshold 0 and scale 1: nothing is dropped or scaled, and the seed is not read.
  __host__ __device__ bool enabled() const { return threshold != 0 || scale != 1.0f; }
};

inline constexpr DropoutParams kNoDropout{nullptr, 0, 1.0f};

// DropoutParams with the key read from device memory, ready to produce multipliers.
struct Dropout {
  uint2 key;
  uint32_t threshold;
  float scale;

  __device__ __forceinline__ static Dropout load(const DropoutParams& params) {
    return {make_uint2(__ldg(params.seed), __ldg(params.seed + 1)), params.threshold, params.scale};
  }

  __device__ __forceinline__ float factor(uint32_t draw) const { return draw >= threshold ? scale : 0.0f; }

  // Multiplier (0 or scale) of the element at flat index i.
  __device__ __forceinline__ float multiplier(uint64_t i) const { return factor(dropout_draw(key, i)); }

  // Multiplies v[0..N) by the multipliers of flat indices first .. first + N - 1. With N a multiple of 8 the
  // caller guarantees first % 8 == 0, so each Philox call serves eight elements; with N a multiple of 4,
  // first % 4 == 0, and each group of four takes one half of a call's words.
  template <int N>
  __device__ __forceinline__ void apply(uint64_t first, float (&v)[N]) const {
    if constexpr (N % kDrawsPerCall == 0) {
#pragma unroll
      for (int g = 0; g < N / kDrawsPerCall; ++g) {
        const uint4 words = dropout_words(key, first / kDrawsPerCall + g);
#pragma unroll
        for (int e = 0; e < kDrawsPerCall; ++e) v[kDrawsPerCall * g + e] *= factor(draw_of(words, e));
      }
    } else if constexpr (N % 4 == 0) {
#pragma unroll
      for (int g = 0; g < N / 4; ++g) {
        const uint64_t start = first + 4 * g;
        const uint4 words = dropout_words(key, start / kDrawsPerCall);
        const bool upper = start % kDrawsPerCall != 0;
        const uint4 half = upper ? make_uint4(words.z, words.w, 0u, 0u) : make_uint4(words.x, words.y, 0u, 0u);
#pragma unroll
        for (int e = 0; e < 4; ++e) v[4 * g + e] *= factor(draw_of(half, e));
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] *= multiplier(first + i);
    }
  }
};

// Dropout over 2**35 elements would wrap the 32-bit Philox counter (random.py refuses it too).
inline constexpr uint64_t kMaxDropoutElements = uint64_t{1} << 35;

inline ffi::Error require_dropout_range(const DropoutParams& params, uint64_t elements) {
  return require(!params.enabled() || elements < kMaxDropoutElements,
                 "dropout over " + std::to_string(elements) + " elements exceeds the 2**35-element Philox range");
}

// A dropout kernel's seed operand (two words) and its tensor of `elements` within the Philox range.
inline ffi::Error require_dropout_seed(const ffi::Buffer<ffi::U32>& seed, const DropoutParams& params,
                                       uint64_t elements) {
  LS_RETURN_IF_ERROR(require(seed.element_count() == 2,
                             "seed must have 2 uint32 words, got shape " + shape_string(seed.dimensions())));
  return require_dropout_range(params, elements);
}

// ---- bit masks ------------------------------------------------------------------------------------------

// Masks the kernels save for their backward hold one bit per element, 8 to a byte: bit i of byte j of a row is
// column 8 j + i (numpy's packbits, bitorder little), padding bits zero.
constexpr int kMaskBits = 8;

// Bytes per row of such a mask over `cols` columns.
__host__ __device__ constexpr int64_t mask_bytes(int64_t cols) { return (cols + kMaskBits - 1) / kMaskBits; }

// ---- launch sizing --------------------------------------------------------------------------------------

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Number of SMs of the current device, queried once per device. (Out-parameters rather than ffi::ErrorOr keep
// this independent of the FFI header version.)
inline ffi::Error sm_count(int& count) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices)
    return ffi::Error::Internal("cannot query the current CUDA device");
  count = cache[device].load(std::memory_order_relaxed);
  if (count == 0) {
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0)
      return ffi::Error::Internal("cannot query the multiprocessor count of CUDA device " + std::to_string(device));
    cache[device].store(count, std::memory_order_relaxed);
  }
  return ffi::Error::Success();
}

// Blocks for a grid-stride kernel over `work` items, `per_block` items per block per sweep: enough to keep
// `blocks_per_sm` blocks on every SM, never more than the work needs (and at least one).
inline ffi::Error stride_grid(int64_t work, int64_t per_block, int blocks_per_sm, int64_t& blocks) {
  int sms = 0;
  LS_RETURN_IF_ERROR(sm_count(sms));
  const int64_t needed = ceil_div(work, per_block);
  const int64_t resident = static_cast<int64_t>(sms) * blocks_per_sm;
  blocks = needed < 1 ? 1 : needed < resident ? needed : resident;
  return ffi::Error::Success();
}

}  // namespace ls
