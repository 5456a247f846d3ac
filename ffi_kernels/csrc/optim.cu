// Multi-tensor optimizer step (Adam, NAdam, Adan): every parameter leaf updated by one kernel launch.
//
// Target ls_optim_step(scalars f32[S], grads[N], params[N] (when has_params), low halves s16[N] (when
//                       split_master), moments f32[W] x K)
//          -> outputs[N], moments f32[W] x K, copies[N] (when write_copies), with clip or write_norm a f32[P]
//             scratch of norm partials, and with write_norm the f32[] global norm.
// Attributes: algorithm (0 adam, 1 adam_nesterov, 2 adan), num_leaves N, has_params, write_params (outputs
// are the new params, else the updates), proximal, clip, write_norm, write_copies (the new params are also
// written in the copies' dtype: the 16-bit params of master weights), split_master (the f32 master of bf16 params is
// the params as high halves and the s16 low halves; the outputs are the new low halves, the copies the new
// params: ls_jax/optim/master.py), decay (int32[N], 1 where weight decay applies).
// The Python wrapper (ls_jax/optim/_kernel.py) aliases the moments, and the params when write_params (with
// split_master the low halves to the outputs and the params to the copies), so the step is in place.
//
// The math is the XLA implementation's (ls_jax/optim/_engine.py, adam.py, adan.py) element for element; the
// scalar vector holds lr, weight_decay, max_norm, grad_scale and then the algorithm's SCALARS in that module's
// order. Every gradient element is multiplied by grad_scale as it is loaded (a training loop's 1 / tokens).
// Moments of leaf i live at [offset_i, offset_i + size_i) of each f32 workspace, offset_i the sum of the
// earlier leaves' sizes rounded up to 4 elements (WorkspaceLayout).
//
// Work split: each leaf is cut into kChunk-element chunks; a grid sized to fill the GPU strides over the
// chunks of all leaves and finds each chunk's leaf by binary search in the leaf table, which travels by value
// as the kernel parameter (__grid_constant__, up to kMaxLeaves leaves; more leaves take one launch per
// kMaxLeaves). Each thread moves kVec consecutive elements per sweep: 16-byte loads of every stream (two for
// f32 streams), all issued before the arithmetic. A leaf with a pointer that is not 16-byte aligned, and the
// last partial group of kVec elements of a leaf, go one element at a time.
//
// Global-norm clipping, or the norm written out: a first kernel writes per-block sums of g^2 into the scratch
// (zeroed first, so any grid size works); every block of the update kernel adds all P partials in the same fixed
// order, so the norm, and the result, are deterministic; block 0 writes the norm.
//
// Bytes per parameter with f32 params and grads: adam reads p, g, mu, nu and writes p, mu, nu (28); adan
// reads p, g, m, v, n, g' and writes p, m, v, n, g' (44); clipping reads g once more (+4). Master weights
// (f32 params, 16-bit grads and copies): adam reads p, g, mu, nu and writes p, mu, nu and the copy (28); split
// over bf16 params and s16 low halves it reads and writes both halves instead (26).
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "common.cuh"

namespace ls {
namespace {

enum class Algorithm : int32_t { kAdam = 0, kAdamNesterov = 1, kAdan = 2 };

constexpr int kThreads = 256;
constexpr int kVec = 8;                                  // 16 bytes of a 16-bit stream, 32 of an f32 one
constexpr int64_t kChunk = int64_t{kThreads} * kVec * 2;  // two sweeps of the block per chunk
constexpr int kMinBlocksPerSm = 2;
constexpr int kMaxLeaves = 448;                          // the table stays under the 32 KiB parameter limit
constexpr int kMaxMoments = 4;
constexpr int64_t kWorkspaceAlign = 4;                   // WorkspaceLayout.ALIGN_ELEMENTS

// Scalar vector positions: COMMON_SCALARS, then adam.SCALARS or adan.SCALARS.
enum CommonScalar { kLr, kWeightDecay, kMaxNorm, kGradScale, kCommonScalars };
enum AdamScalar { kAdamB1 = kCommonScalars, kAdamOmb1, kAdamB2, kAdamOmb2, kAdamBc1, kAdamBc1Next, kAdamBc2,
                  kAdamEps, kAdamEpsRoot, kAdamScalars };
enum AdanScalar { kAdanB1 = kCommonScalars, kAdanOmb1, kAdanB2, kAdanOmb2, kAdanB3, kAdanOmb3, kAdanBc1, kAdanBc2,
                  kAdanBc3, kAdanEps, kAdanEpsRoot, kAdanFirst, kAdanScalars };

enum StorageType : uint8_t { kF32, kBF16, kF16 };
enum LeafFlags : uint8_t { kDecay = 1, kAligned = 2 };

struct Leaf {
  const void* grad;
  const void* param;
  const void* param_low;  // the master's low halves with split_master, else null
  void* out;
  void* copy;      // the new params again, in copy_type; null without write_copies
  int64_t offset;  // of the leaf in every workspace
  int64_t size;
  uint8_t grad_type, param_type, out_type, copy_type, flags;
};

struct LeafTable {
  const float* moments_in[kMaxMoments];
  float* moments_out[kMaxMoments];
  int num_leaves;
  int chunk_end[kMaxLeaves];  // chunks of leaves 0..i together
  Leaf leaf[kMaxLeaves];
};
static_assert(sizeof(LeafTable) + 64 <= 32764, "the leaf table must fit in the kernel parameter space");

struct StepFlags {
  bool has_params, write_params, proximal, clip, split_master;
};

template <Algorithm A>
constexpr int kMoments = A == Algorithm::kAdan ? 4 : 2;

template <Algorithm A>
constexpr int kScalarCount = A == Algorithm::kAdan ? static_cast<int>(kAdanScalars) : static_cast<int>(kAdamScalars);

// ---- loads and stores of any storage type --------------------------------------------------------------

template <int N>
__device__ __forceinline__ void load_any(const void* base, uint8_t type, int64_t index, float (&v)[N]) {
  switch (type) {
    case kF32: load_floats<N>(static_cast<const float*>(base) + index, v); break;
    case kBF16: load_floats<N>(static_cast<const __nv_bfloat16*>(base) + index, v); break;
    default: load_floats<N>(static_cast<const __half*>(base) + index, v); break;
  }
}

template <int N>
__device__ __forceinline__ void store_any(void* base, uint8_t type, int64_t index, const float (&v)[N]) {
  switch (type) {
    case kF32: store_vector<N>(static_cast<float*>(base) + index, v); break;
    case kBF16: store_vector<N>(static_cast<__nv_bfloat16*>(base) + index, v); break;
    default: store_vector<N>(static_cast<__half*>(base) + index, v); break;
  }
}

// ---- master weights split into bf16 params and s16 low halves (ls_jax/optim/master.py) ----------------

// N 16-bit words at ptr: N = kVec (16-byte aligned) as one 16-byte access, N = 1 as a scalar.
template <int N>
__device__ __forceinline__ void load_words(const uint16_t* ptr, uint32_t (&w)[N]) {
  if constexpr (N == 1) {
    w[0] = *ptr;
  } else {
    static_assert(N == 8, "16-bit vectors are one uint4");
    const uint4 v = *reinterpret_cast<const uint4*>(ptr);
    const uint32_t pairs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = pairs[i] & 0xFFFFu;
      w[2 * i + 1] = pairs[i] >> 16;
    }
  }
}

template <int N>
__device__ __forceinline__ void store_words(uint16_t* ptr, const uint32_t (&w)[N]) {
  if constexpr (N == 1) {
    *ptr = static_cast<uint16_t>(w[0]);
  } else {
    static_assert(N == 8, "16-bit vectors are one uint4");
    __stwb(reinterpret_cast<uint4*>(ptr), make_uint4(w[0] | (w[1] << 16), w[2] | (w[3] << 16),
                                                     w[4] | (w[5] << 16), w[6] | (w[7] << 16)));
  }
}

__device__ __forceinline__ bool nan_bits(uint32_t bits) { return (bits & 0x7FFFFFFFu) > 0x7F800000u; }

// master.join_halves: bits(high) * 2^16 + low, or high itself where that would cross zero or make NaN of inf.
__device__ __forceinline__ float join_halves(uint32_t high, uint32_t low) {
  const uint32_t high_bits = high << 16;
  const uint32_t bits = high_bits + static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(low)));
  const bool crossed = ((bits ^ high_bits) >> 31) != 0 || (nan_bits(bits) && !nan_bits(high_bits));
  return __uint_as_float(crossed ? high_bits : bits);
}

// master.round_to_bf16 (nearest, ties away from zero) and master.low_half of x: high and low halves.
__device__ __forceinline__ void split_halves(float x, uint32_t& high, uint32_t& low) {
  const uint32_t bits = __float_as_uint(x);
  high = nan_bits(bits) ? ((bits >> 16) | 0x40u) : ((bits + 0x8000u) >> 16);
  const int32_t difference = static_cast<int32_t>(bits - (high << 16));
  low = static_cast<uint16_t>(static_cast<int16_t>(min(max(difference, -32768), 32767)));
}

template <int N>
__device__ __forceinline__ void load_master(const Leaf& leaf, int64_t index, float (&p)[N]) {
  uint32_t high[N], low[N];
  load_words<N>(static_cast<const uint16_t*>(leaf.param) + index, high);
  load_words<N>(static_cast<const uint16_t*>(leaf.param_low) + index, low);
#pragma unroll
  for (int i = 0; i < N; ++i) p[i] = join_halves(high[i], low[i]);
}

template <int N>
__device__ __forceinline__ void store_master(const Leaf& leaf, int64_t index, const float (&p)[N]) {
  uint32_t high[N], low[N];
#pragma unroll
  for (int i = 0; i < N; ++i) split_halves(p[i], high[i], low[i]);
  store_words<N>(static_cast<uint16_t*>(leaf.copy) + index, high);
  store_words<N>(static_cast<uint16_t*>(leaf.out) + index, low);
}

// ---- the math (one element; `s` is the scalar vector) ---------------------------------------------------

template <Algorithm A>
struct Scalars {
  float v[kScalarCount<A>];

  __device__ __forceinline__ static Scalars load(const float* __restrict__ scalars) {
    Scalars s;
#pragma unroll
    for (int i = 0; i < kScalarCount<A>; ++i) s.v[i] = __ldg(scalars + i);
    return s;
  }
  __device__ __forceinline__ float operator[](int i) const { return v[i]; }
};

// The direction u of one element; updates its moments m[0..kMoments) in place.
template <Algorithm A>
__device__ __forceinline__ float direction(const Scalars<A>& s, float g, float (&m)[kMoments<A>]) {
  if constexpr (A == Algorithm::kAdan) {
    const bool first = s[kAdanFirst] > 0.0f;
    const float diff = first ? 0.0f : g - m[3];
    const float m0 = first ? 0.0f : m[0], v0 = first ? 0.0f : m[1], n0 = first ? 0.0f : m[2];
    const float mt = s[kAdanOmb1] * g + s[kAdanB1] * m0;
    const float vt = s[kAdanOmb2] * diff + s[kAdanB2] * v0;
    const float sq = g + s[kAdanOmb2] * diff;
    const float nt = s[kAdanOmb3] * (sq * sq) + s[kAdanB3] * n0;
    m[0] = mt;
    m[1] = vt;
    m[2] = nt;
    m[3] = g;
    return (mt / s[kAdanBc1] + s[kAdanOmb2] * (vt / s[kAdanBc2])) /
           (sqrtf(nt / s[kAdanBc3] + s[kAdanEpsRoot]) + s[kAdanEps]);
  } else {
    const float mu = s[kAdamOmb1] * g + s[kAdamB1] * m[0];
    const float nu = s[kAdamOmb2] * (g * g) + s[kAdamB2] * m[1];
    m[0] = mu;
    m[1] = nu;
    const float denominator = sqrtf(nu / s[kAdamBc2] + s[kAdamEpsRoot]) + s[kAdamEps];
    if constexpr (A == Algorithm::kAdamNesterov) {
      return (s[kAdamB1] * (mu / s[kAdamBc1Next]) + s[kAdamOmb1] * (g / s[kAdamBc1])) / denominator;
    } else {
      return (mu / s[kAdamBc1]) / denominator;
    }
  }
}

// The new parameter or the update from direction u (ls_jax/optim/_engine.py: _finish).
template <Algorithm A>
__device__ __forceinline__ float finish(const Scalars<A>& s, const StepFlags& flags, bool decayed, float u, float p) {
  const float lr = s[kLr], wd = s[kWeightDecay];
  if (!flags.has_params) return -lr * u;
  if (decayed && flags.proximal) {
    const float new_p = (p - lr * u) / (1.0f + lr * wd);
    return flags.write_params ? new_p : new_p - p;
  }
  const float update = decayed ? -lr * (u + wd * p) : -lr * u;
  return flags.write_params ? p + update : update;
}

// Elements index .. index + N - 1 of one leaf: N = kVec (aligned, whole vector) or 1.
template <Algorithm A, int N>
__device__ __forceinline__ void step_elements(const LeafTable& table, const Leaf& leaf, int64_t index,
                                              const Scalars<A>& s, const StepFlags& flags, bool clipped,
                                              float norm) {
  constexpr int K = kMoments<A>;
  float g[N], p[N], m[K][N];
  load_any<N>(leaf.grad, leaf.grad_type, index, g);
  if (flags.split_master) load_master<N>(leaf, index, p);
  else if (flags.has_params) load_any<N>(leaf.param, leaf.param_type, index, p);
#pragma unroll
  for (int k = 0; k < K; ++k) load_floats<N>(table.moments_in[k] + leaf.offset + index, m[k]);
  const bool decayed = leaf.flags & kDecay;
  float out[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float scaled = g[i] * s[kGradScale];
    const float gi = clipped ? (scaled / norm) * s[kMaxNorm] : scaled;
    float mi[K];
#pragma unroll
    for (int k = 0; k < K; ++k) mi[k] = m[k][i];
    const float u = direction<A>(s, gi, mi);
#pragma unroll
    for (int k = 0; k < K; ++k) m[k][i] = mi[k];
    out[i] = finish<A>(s, flags, decayed, u, flags.has_params ? p[i] : 0.0f);
  }
#pragma unroll
  for (int k = 0; k < K; ++k) store_vector<N>(table.moments_out[k] + leaf.offset + index, m[k]);
  if (flags.split_master) {
    store_master<N>(leaf, index, out);
  } else {
    store_any<N>(leaf.out, leaf.out_type, index, out);
    if (leaf.copy != nullptr) store_any<N>(leaf.copy, leaf.copy_type, index, out);
  }
}

// The leaf that owns `chunk`: the first i with chunk < chunk_end[i].
__device__ __forceinline__ int find_leaf(const LeafTable& table, int chunk) {
  int low = 0, high = table.num_leaves - 1;
  while (low < high) {
    const int mid = (low + high) / 2;
    if (chunk < table.chunk_end[mid]) high = mid;
    else low = mid + 1;
  }
  return low;
}

// Calls visit(leaf, index, aligned_whole_vector) for every kVec-element group of every chunk this block owns.
template <typename Visit>
__device__ __forceinline__ void for_each_group(const LeafTable& table, Visit&& visit) {
  const int chunks = table.chunk_end[table.num_leaves - 1];
  for (int chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const int leaf_index = find_leaf(table, chunk);
    const Leaf& leaf = table.leaf[leaf_index];
    const int first_chunk = leaf_index == 0 ? 0 : table.chunk_end[leaf_index - 1];
    const int64_t begin = (chunk - first_chunk) * kChunk;
    const int64_t end = begin + kChunk < leaf.size ? begin + kChunk : leaf.size;
    for (int64_t index = begin + threadIdx.x * kVec; index < end; index += int64_t{kThreads} * kVec) {
      visit(leaf, index, (leaf.flags & kAligned) && index + kVec <= leaf.size);
    }
  }
}

// The global norm from the P partial sums of squares, added in the same order by every block.
__device__ float global_norm(const float* __restrict__ partials, int count) {
  __shared__ float scratch[kGroupReduceScratch<1>];
  float total = 0.0f;
  for (int i = threadIdx.x; i < count; i += blockDim.x) total += partials[i];
  return sqrtf(group_reduce<SumOp>(total, scratch));
}

__global__ void __launch_bounds__(kThreads) norm_partials_kernel(const __grid_constant__ LeafTable table,
                                                                 const float* __restrict__ scalars,
                                                                 float* __restrict__ partials) {
  __shared__ float scratch[kGroupReduceScratch<1>];
  const float scale = __ldg(scalars + kGradScale);
  float total = 0.0f;
  for_each_group(table, [&](const Leaf& leaf, int64_t index, bool vector) {
    if (vector) {
      float g[kVec];
      load_any<kVec>(leaf.grad, leaf.grad_type, index, g);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float scaled = g[i] * scale;
        total += scaled * scaled;
      }
    } else {
      for (int64_t e = index; e < index + kVec && e < leaf.size; ++e) {
        float g[1];
        load_any<1>(leaf.grad, leaf.grad_type, e, g);
        const float scaled = g[0] * scale;
        total += scaled * scaled;
      }
    }
  });
  total = group_reduce<SumOp>(total, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

template <Algorithm A>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    step_kernel(const __grid_constant__ LeafTable table, const float* __restrict__ scalars,
                const float* __restrict__ norm_partials, int num_partials, float* __restrict__ norm_out,
                StepFlags flags) {
  const Scalars<A> s = Scalars<A>::load(scalars);
  float norm = 0.0f;
  if (norm_partials != nullptr) norm = global_norm(norm_partials, num_partials);
  if (norm_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *norm_out = norm;
  const bool clipped = flags.clip && !(norm < s[kMaxNorm]);
  for_each_group(table, [&](const Leaf& leaf, int64_t index, bool vector) {
    if (vector) {
      step_elements<A, kVec>(table, leaf, index, s, flags, clipped, norm);
    } else {
      for (int64_t e = index; e < index + kVec && e < leaf.size; ++e)
        step_elements<A, 1>(table, leaf, e, s, flags, clipped, norm);
    }
  });
}

// ---- host side -----------------------------------------------------------------------------------------

ffi::Error storage_type(ffi::DataType dtype, const std::string& what, uint8_t& type) {
  switch (dtype) {
    case ffi::DataType::F32: type = kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: type = kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: type = kF16; return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument(what + " must be float32, bfloat16 or float16, got " + dtype_name(dtype));
  }
}

int moment_count(Algorithm algorithm) {
  return algorithm == Algorithm::kAdan ? kMoments<Algorithm::kAdan> : kMoments<Algorithm::kAdam>;
}
int scalar_count(Algorithm algorithm) {
  return algorithm == Algorithm::kAdan ? kScalarCount<Algorithm::kAdan> : kScalarCount<Algorithm::kAdam>;
}

// Leaf i's table entry from its buffers; `offset` is its workspace offset, `low` the master's low halves with
// split_master (then `param` and `copy` are the bf16 params and their new values, `out` the new low halves).
ffi::Error describe_leaf(int64_t i, const ffi::AnyBuffer& grad, const ffi::AnyBuffer* param, const ffi::AnyBuffer* low,
                         const ffi::AnyBuffer& out, const ffi::AnyBuffer* copy, bool write_params, bool decayed,
                         int64_t offset, Leaf& leaf) {
  const std::string name = "leaf " + std::to_string(i);
  LS_RETURN_IF_ERROR(require_same_shape(name + " output", out, name + " gradient", grad));
  LS_RETURN_IF_ERROR(storage_type(grad.element_type(), name + " gradient", leaf.grad_type));
  leaf.copy = nullptr;
  leaf.copy_type = kF32;
  if (copy != nullptr) {
    LS_RETURN_IF_ERROR(require_same_shape(name + " copy", *copy, name + " gradient", grad));
    LS_RETURN_IF_ERROR(storage_type(copy->element_type(), name + " copy", leaf.copy_type));
    leaf.copy = copy->untyped_data();
  }
  if (param != nullptr) {
    LS_RETURN_IF_ERROR(require_same_shape(name + " param", *param, name + " gradient", grad));
    LS_RETURN_IF_ERROR(storage_type(param->element_type(), name + " param", leaf.param_type));
  }
  leaf.param_low = nullptr;
  if (low != nullptr) {
    LS_RETURN_IF_ERROR(require_same_shape(name + " low halves", *low, name + " gradient", grad));
    LS_RETURN_IF_ERROR(require(param != nullptr && copy != nullptr && leaf.param_type == kBF16 &&
                                   leaf.copy_type == kBF16,
                               name + ": split master weights need bfloat16 params and copies"));
    LS_RETURN_IF_ERROR(require(low->element_type() == ffi::DataType::S16 && out.element_type() == ffi::DataType::S16,
                               name + ": the master's low halves and their new values must be int16"));
    leaf.param_low = low->untyped_data();
  } else {
    LS_RETURN_IF_ERROR(storage_type(out.element_type(), name + " output", leaf.out_type));
    if (param == nullptr) leaf.param_type = leaf.out_type;
    LS_RETURN_IF_ERROR(require(param == nullptr || !write_params || param->element_type() == out.element_type(),
                               name + ": the new params must have the params' dtype"));
  }
  leaf.grad = grad.untyped_data();
  leaf.param = param != nullptr ? param->untyped_data() : nullptr;
  leaf.out = out.untyped_data();
  leaf.offset = offset;
  leaf.size = static_cast<int64_t>(grad.element_count());
  const bool aligned = is_aligned(leaf.grad, 16) && is_aligned(leaf.out, 16) &&
                       (leaf.param == nullptr || is_aligned(leaf.param, 16)) &&
                       (leaf.param_low == nullptr || is_aligned(leaf.param_low, 16)) &&
                       (leaf.copy == nullptr || is_aligned(leaf.copy, 16));
  leaf.flags = static_cast<uint8_t>((decayed ? kDecay : 0) | (aligned ? kAligned : 0));
  return ffi::Error::Success();
}

// Fills the leaf entries [first, first + count) of a table whose moment pointers are set; chunk_end counts
// from this table's first leaf.
ffi::Error fill_table(const std::vector<Leaf>& leaves, size_t first, size_t count, LeafTable& table) {
  table.num_leaves = static_cast<int>(count);
  int64_t chunks = 0;
  for (size_t j = 0; j < count; ++j) {
    table.leaf[j] = leaves[first + j];
    chunks += ceil_div(table.leaf[j].size, kChunk);
    LS_RETURN_IF_ERROR(require(chunks < (int64_t{1} << 31), "too many elements for one optimizer launch"));
    table.chunk_end[j] = static_cast<int>(chunks);
  }
  return ffi::Error::Success();
}

template <Algorithm A>
ffi::Error launch_step(cudaStream_t stream, const LeafTable& table, const float* scalars, const float* partials,
                       int num_partials, float* norm_out, StepFlags flags) {
  // As many blocks as fit on the GPU at once (the register count, hence occupancy, differs per algorithm).
  int resident = 0;
  const cudaError_t status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, step_kernel<A>, kThreads, 0);
  if (status != cudaSuccess)
    return ffi::Error::Internal(std::string("cannot size the optimizer grid: ") + cudaGetErrorString(status));
  int64_t blocks = 0;
  LS_RETURN_IF_ERROR(stride_grid(table.chunk_end[table.num_leaves - 1], 1, std::max(resident, 1), blocks));
  step_kernel<A><<<blocks, kThreads, 0, stream>>>(table, scalars, partials, num_partials, norm_out, flags);
  return launch_error("optimizer step_kernel");
}

ffi::Error optim_step(cudaStream_t stream, ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs args,
                      ffi::RemainingRets rets, int32_t algorithm_id, int64_t num_leaves, bool has_params,
                      bool write_params, bool proximal, bool clip, bool write_norm, bool write_copies,
                      bool split_master, ffi::Span<const int32_t> decay) {
  LS_RETURN_IF_ERROR(require(algorithm_id >= 0 && algorithm_id <= 2, "unknown optimizer algorithm " +
                                                                         std::to_string(algorithm_id)));
  const auto algorithm = static_cast<Algorithm>(algorithm_id);
  const int64_t n = num_leaves;
  const int k = moment_count(algorithm);
  LS_RETURN_IF_ERROR(require(n >= 1, "the optimizer step needs at least one leaf"));
  LS_RETURN_IF_ERROR(require(!write_params || has_params, "writing new params needs the params"));
  LS_RETURN_IF_ERROR(require(!write_copies || write_params, "copies are of the new params: write_params is off"));
  LS_RETURN_IF_ERROR(require(!split_master || write_copies, "split master weights write the params as copies"));
  LS_RETURN_IF_ERROR(require(static_cast<int64_t>(decay.size()) == n, "decay must have one flag per leaf"));
  const int64_t first_moment = n * (1 + (has_params ? 1 : 0) + (split_master ? 1 : 0));
  LS_RETURN_IF_ERROR(require(static_cast<int64_t>(args.size()) == first_moment + k,
                             "expected " + std::to_string(n) + " grads, " + (has_params ? "as many params, " : "") +
                                 (split_master ? "as many low halves, " : "") + "and " + std::to_string(k) +
                                 " moments after the scalars"));
  const int64_t copies = write_copies ? n : 0;
  const bool norm_needed = clip || write_norm;
  LS_RETURN_IF_ERROR(require(static_cast<int64_t>(rets.size()) == n + k + copies + (norm_needed ? 1 : 0) +
                                                                       (write_norm ? 1 : 0),
                             "expected " + std::to_string(n) + " outputs, " + std::to_string(k) + " moments" +
                                 (write_copies ? ", " + std::to_string(n) + " copies" : "") +
                                 (norm_needed ? ", the norm scratch" : "") + (write_norm ? ", the norm" : "")));
  LS_RETURN_IF_ERROR(require(static_cast<int>(scalars.element_count()) == scalar_count(algorithm),
                             "expected " + std::to_string(scalar_count(algorithm)) + " scalars, got " +
                                 std::to_string(scalars.element_count())));

  std::vector<Leaf> leaves(static_cast<size_t>(n));
  int64_t workspace = 0;
  bool moments_aligned = true;
  for (int64_t i = 0; i < n; ++i) {
    auto grad = args.get<ffi::AnyBuffer>(i);
    if (grad.has_error()) return grad.error();
    std::optional<ffi::AnyBuffer> param;
    if (has_params) {
      auto p = args.get<ffi::AnyBuffer>(n + i);
      if (p.has_error()) return p.error();
      param = *p;
    }
    std::optional<ffi::AnyBuffer> low;
    if (split_master) {
      auto l = args.get<ffi::AnyBuffer>(2 * n + i);
      if (l.has_error()) return l.error();
      low = *l;
    }
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (out.has_error()) return out.error();
    std::optional<ffi::AnyBuffer> copy;
    if (write_copies) {
      auto c = rets.get<ffi::AnyBuffer>(n + k + i);
      if (c.has_error()) return c.error();
      copy = **c;
    }
    const bool decayed = decay[i] != 0;
    LS_RETURN_IF_ERROR(require(!decayed || has_params, "weight decay needs the params"));
    LS_RETURN_IF_ERROR(describe_leaf(i, *grad, param ? &*param : nullptr, low ? &*low : nullptr, **out,
                                     copy ? &*copy : nullptr, write_params, decayed, workspace, leaves[i]));
    workspace += round_up(leaves[i].size, kWorkspaceAlign);
  }

  LeafTable table;
  for (int j = 0; j < k; ++j) {
    auto in = args.get<ffi::AnyBuffer>(first_moment + j);
    if (in.has_error()) return in.error();
    auto out = rets.get<ffi::AnyBuffer>(n + j);
    if (out.has_error()) return out.error();
    const std::string name = "moment " + std::to_string(j);
    LS_RETURN_IF_ERROR(require(in->element_type() == ffi::DataType::F32 && (*out)->element_type() == ffi::DataType::F32,
                               name + " must be float32"));
    LS_RETURN_IF_ERROR(require(static_cast<int64_t>(in->element_count()) == workspace &&
                                   static_cast<int64_t>((*out)->element_count()) == workspace,
                               name + " must have " + std::to_string(workspace) + " elements (the workspace of these "
                                   "leaves), got " + std::to_string(in->element_count())));
    table.moments_in[j] = static_cast<const float*>(in->untyped_data());
    table.moments_out[j] = static_cast<float*>((*out)->untyped_data());
    moments_aligned = moments_aligned && is_aligned(table.moments_in[j], 16) && is_aligned(table.moments_out[j], 16);
  }
  if (!moments_aligned) {
    for (Leaf& leaf : leaves) leaf.flags &= static_cast<uint8_t>(~kAligned);
  }

  const StepFlags flags{has_params, write_params, proximal, clip, split_master};
  const int64_t groups = ceil_div(n, kMaxLeaves);
  float* partials = nullptr;
  int num_partials = 0;
  float* norm_out = nullptr;
  if (write_norm) {
    auto norm = rets.get<ffi::AnyBuffer>(n + k + copies + 1);
    if (norm.has_error()) return norm.error();
    LS_RETURN_IF_ERROR(require((*norm)->element_type() == ffi::DataType::F32 && (*norm)->element_count() == 1,
                               "the norm result must be one float32"));
    norm_out = static_cast<float*>((*norm)->untyped_data());
  }
  if (norm_needed) {
    auto scratch = rets.get<ffi::AnyBuffer>(n + k + copies);
    if (scratch.has_error()) return scratch.error();
    num_partials = static_cast<int>((*scratch)->element_count());
    LS_RETURN_IF_ERROR(require((*scratch)->element_type() == ffi::DataType::F32 && num_partials >= groups,
                               "the norm scratch must be float32 with at least one slot per " +
                                   std::to_string(kMaxLeaves) + " leaves"));
    partials = static_cast<float*>((*scratch)->untyped_data());
    const cudaError_t status = cudaMemsetAsync(partials, 0, sizeof(float) * num_partials, stream);
    if (status != cudaSuccess)
      return ffi::Error::Internal(std::string("zeroing the norm scratch failed: ") + cudaGetErrorString(status));
    const int64_t slots = num_partials / groups;
    for (int64_t group = 0; group < groups; ++group) {
      const size_t first = static_cast<size_t>(group * kMaxLeaves);
      LS_RETURN_IF_ERROR(fill_table(leaves, first, std::min<size_t>(kMaxLeaves, leaves.size() - first), table));
      int64_t blocks = 0;
      LS_RETURN_IF_ERROR(stride_grid(table.chunk_end[table.num_leaves - 1], 1, 4, blocks));
      blocks = std::min(blocks, slots);
      norm_partials_kernel<<<blocks, kThreads, 0, stream>>>(table, scalars.typed_data(), partials + group * slots);
      LS_RETURN_IF_ERROR(launch_error("optimizer norm_partials_kernel"));
    }
  }
  for (int64_t group = 0; group < groups; ++group) {
    const size_t first = static_cast<size_t>(group * kMaxLeaves);
    LS_RETURN_IF_ERROR(fill_table(leaves, first, std::min<size_t>(kMaxLeaves, leaves.size() - first), table));
    const float* s = scalars.typed_data();
    // Every group's launch computes the same norm; the first one writes it.
    float* group_norm_out = group == 0 ? norm_out : nullptr;
    switch (algorithm) {
      case Algorithm::kAdam:
        LS_RETURN_IF_ERROR(
            launch_step<Algorithm::kAdam>(stream, table, s, partials, num_partials, group_norm_out, flags));
        break;
      case Algorithm::kAdamNesterov:
        LS_RETURN_IF_ERROR(
            launch_step<Algorithm::kAdamNesterov>(stream, table, s, partials, num_partials, group_norm_out, flags));
        break;
      case Algorithm::kAdan:
        LS_RETURN_IF_ERROR(
            launch_step<Algorithm::kAdan>(stream, table, s, partials, num_partials, group_norm_out, flags));
        break;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

LS_FFI_TARGET(ls_optim_step, optim_step,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::Buffer<ffi::F32>>()
                  .RemainingArgs()
                  .RemainingRets()
                  .Attr<int32_t>("algorithm")
                  .Attr<int64_t>("num_leaves")
                  .Attr<bool>("has_params")
                  .Attr<bool>("write_params")
                  .Attr<bool>("proximal")
                  .Attr<bool>("clip")
                  .Attr<bool>("write_norm")
                  .Attr<bool>("write_copies")
                  .Attr<bool>("split_master")
                  .Attr<ffi::Span<const int32_t>>("decay"));

}  // namespace ls
