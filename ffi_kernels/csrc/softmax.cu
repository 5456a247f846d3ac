// Attention softmax: scale, padding mask, causal mask and dropout on the probabilities in one pass over the
// scores, and its backward with the dropout mask regenerated from the seed (math: ls_jax/ops/softmax.py).
//
// A row is one (b, h, q) of scores viewed as (B, H, Q, K):
//   logit_k   = scores_k * logit_scale, then + mask_k (float mask) or -inf where mask_k is false (boolean
//               mask), then -inf where causal and k > q + K - Q
//   probs_k   = exp(logit_k - max) / sum_j exp(logit_j - max)     (zeros for a row whose logits are all -inf)
//   y_k       = probs_k * keep_k * scale                          (keep from Philox, flat index of (b, h, q, k))
//   dscores_k = logit_scale * probs_k * (dp_k - sum_j dp_j probs_j),   dp_k = dy_k * keep_k * scale
//
// Two layouts, chosen by the key length K:
//   K <= 1024 (512 when W = 1): a lane group (4 to 32 lanes) holds kRows whole rows in registers: one read,
//     shuffle reductions, one write. `launch_by_length` is the table of group shapes.
//   longer rows: one block per row and two sweeps. The first keeps a running (max, sum of exponentials) per
//     thread and combines them over the block; the second re-reads the row (from L2: the block read it
//     moments ago) and writes it. The backward's first sweep sums dp * probs, the second writes dscores.
// W, the elements per access, is the 16-byte width when K is a multiple of it and every buffer is 16-byte
// aligned, else 1; with W = 1 each element draws its own Philox block (odd key lengths only).
//
// Targets
//   ls_attn_softmax_fwd(scores (B, H, Q, K), seed u32[2] [, mask]) -> (probs [, y])
//       attributes logit_scale: f32, causal: bool, threshold: u32, scale: f32 (dropout, as ls_dropout)
//       mask: bool or f32 of shape (B or 1, H or 1, Q or 1, K); y is present iff dropout is on (else y = probs)
//   ls_attn_softmax_bwd(dy, probs, seed u32[2]) -> dscores     (..., K), one dtype
//       attributes logit_scale: f32, threshold: u32, scale: f32; threshold 0 and scale 1 mean no dropout
#include "common.cuh"

#include <optional>

namespace ls {
namespace {

constexpr int kGroupBlockThreads = 128;  // threads per block of the register layout
constexpr int kRowBlockThreads = 256;    // threads per row of the two-sweep layout
constexpr int kUnroll = 4;               // accesses in flight per thread per sweep step (two-sweep layout)
constexpr int kMaxRegisterFloats = 32;   // row elements per thread of the register layout

// ---- rows, masks and dropout ----------------------------------------------------------------------------

// Scores seen as (batch, heads, queries, keys); rows = batch * heads * queries. Row indices and the axes fit
// in 32 bits (checked), so a row's (b, h, q) is found with 32-bit division; element offsets are 64-bit.
struct Geometry {
  int64_t rows;
  int keys;
  int queries;
  int heads;
  bool causal;
};

// The mask operand: none, boolean (XLA PRED, one byte per element; false hides a key) or additive f32, with
// its element strides along (batch, heads, queries): 0 along the axes it is broadcast over. The kind is a
// runtime value, uniform over the grid, so one kernel serves all three.
struct Mask {
  enum Kind : int { kNone, kKeep, kAdd };
  const void* data;
  Kind kind;
  int64_t batch_stride;
  int64_t head_stride;
  int64_t query_stride;

  template <int W>
  __device__ __forceinline__ void apply(int64_t offset, float (&logit)[W]) const {
    if (kind == kKeep) {
      const auto flags = *reinterpret_cast<const Pack<uint8_t, W>*>(static_cast<const uint8_t*>(data) + offset);
#pragma unroll
      for (int i = 0; i < W; ++i) logit[i] = flags.v[i] ? logit[i] : -INFINITY;
    } else if (kind == kAdd) {
      float add[W];
      load_floats<W>(static_cast<const float*>(data) + offset, add);
#pragma unroll
      for (int i = 0; i < W; ++i) logit[i] += add[i];
    }
  }
};

// What every element of one row needs: where its mask starts and how many leading keys it may see.
struct RowContext {
  int64_t mask_offset;
  int visible;
};

__device__ __forceinline__ RowContext row_context(int64_t row, const Geometry& g, const Mask& mask) {
  const int q = static_cast<int>(row) % g.queries;
  int64_t mask_offset = q * mask.query_stride;
  if (mask.batch_stride != 0 || mask.head_stride != 0) {
    const int bh = static_cast<int>(row) / g.queries;
    mask_offset += (bh / g.heads) * mask.batch_stride + (bh % g.heads) * mask.head_stride;
  }
  return {mask_offset, g.causal ? q + 1 + (g.keys - g.queries) : g.keys};
}

// Scores of W keys starting at `col` -> logits: scale, mask, causal limit.
template <int W>
__device__ __forceinline__ void to_logits(float (&v)[W], int64_t col, const RowContext& row, const Mask& mask,
                                          float logit_scale) {
#pragma unroll
  for (int i = 0; i < W; ++i) v[i] *= logit_scale;
  mask.apply<W>(row.mask_offset + col, v);
#pragma unroll
  for (int i = 0; i < W; ++i) v[i] = col + i < row.visible ? v[i] : -INFINITY;
}

__device__ __forceinline__ float reciprocal_or_zero(float total) { return total > 0.0f ? 1.0f / total : 0.0f; }

// Reduces each of v[0..K) over aligned groups of kLanes lanes (a power of two up to 32); every lane of the
// warp must call it.
template <typename Op, int kLanes, int K>
__device__ __forceinline__ void lane_group_reduce(float (&v)[K]) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = Op::apply(v[k], __shfl_xor_sync(0xffffffffu, v[k], offset));
  }
}

// Dropout that may be off (a null seed): loaded once per thread, applied per vector.
struct MaybeDropout {
  bool on;
  Dropout dropout;

  __device__ __forceinline__ static MaybeDropout load(const DropoutParams& params) {
    if (params.seed == nullptr) return {false, Dropout{make_uint2(0u, 0u), 0u, 1.0f}};
    return {true, Dropout::load(params)};
  }

  // Multiplies v by the multipliers of flat indices first .. first + W - 1.
  template <int W>
  __device__ __forceinline__ void apply(uint64_t first, float (&v)[W]) const {
    if (on) dropout.apply<W>(first, v);
  }
};

// ---- register layout: lane groups holding whole rows -----------------------------------------------------

// kLanes lanes hold kRows consecutive rows; lane l holds the W-wide vectors l, l + kLanes, ... (kVecs of them).
template <int Lanes, int Vecs, int Rows>
struct GroupShape {
  static constexpr int kLanes = Lanes;
  static constexpr int kVecs = Vecs;
  static constexpr int kRows = Rows;
  static constexpr int kRowsPerBlock = kGroupBlockThreads / Lanes * Rows;
};

// Launches the kernel that suits rows of `keys` keys read W at a time: group(GroupShape<...>{}) with the
// smallest lane group (of at least 4 lanes) that holds such rows in registers, or row() when they are too
// long for that (more than 1024 keys, or 512 when W = 1). Each thread keeps 4 accesses in flight when rows
// are short (several rows per group) and at most kMaxRegisterFloats elements of a row.
template <int W, typename Group, typename Row>
ffi::Error launch_by_length(int64_t keys, Group&& group, Row&& row) {
  const int64_t vectors = ceil_div(keys, W);
  if (vectors <= 4) return group(GroupShape<4, 1, 4>{});
  if (vectors <= 8) return group(GroupShape<8, 1, 4>{});
  if (vectors <= 16) return group(GroupShape<16, 1, 4>{});
  if (vectors <= 32) return group(GroupShape<32, 1, 4>{});
  if (vectors <= 64) return group(GroupShape<32, 2, 2>{});
  if (vectors <= 128) return group(GroupShape<32, 4, 1>{});
  if constexpr (8 * W <= kMaxRegisterFloats) {
    if (vectors <= 256) return group(GroupShape<32, 8, 1>{});
  }
  if constexpr (16 * W <= kMaxRegisterFloats) {
    if (vectors <= 512) return group(GroupShape<32, 16, 1>{});
  }
  return row();
}

// The first of the kRows rows of this thread's lane group.
template <typename S>
__device__ __forceinline__ int64_t group_first_row() {
  return (static_cast<int64_t>(blockIdx.x) * (kGroupBlockThreads / S::kLanes) + threadIdx.x / S::kLanes) * S::kRows;
}

// The first key of this lane's vector c.
template <typename S, int W>
__device__ __forceinline__ int lane_column(int c) {
  return (c * S::kLanes + static_cast<int>(threadIdx.x) % S::kLanes) * W;
}

// At least 6 blocks per SM (at most 80 registers): left alone, ptxas spills a register in some shapes to fit 72.
template <typename T, int W, typename S>
__global__ void __launch_bounds__(kGroupBlockThreads, 6)
    softmax_fwd_group_kernel(const T* __restrict__ scores, Mask mask, T* __restrict__ probs,
                             T* __restrict__ y, Geometry g, float logit_scale, DropoutParams dropout_params) {
  const MaybeDropout dropout = MaybeDropout::load(dropout_params);
  const int64_t first_row = group_first_row<S>();
  float v[S::kRows][S::kVecs][W];
#pragma unroll
  for (int r = 0; r < S::kRows; ++r) {
#pragma unroll
    for (int c = 0; c < S::kVecs; ++c) {
      const int col = lane_column<S, W>(c);
      if (first_row + r < g.rows && col < g.keys) load_floats<W>(scores + (first_row + r) * g.keys + col, v[r][c]);
    }
  }

  float stat[S::kRows];  // row maximum, then row sum of exponentials
#pragma unroll
  for (int r = 0; r < S::kRows; ++r) {
    const bool row_valid = first_row + r < g.rows;
    const RowContext context = row_valid ? row_context(first_row + r, g, mask) : RowContext{0, 0};
    stat[r] = -INFINITY;
#pragma unroll
    for (int c = 0; c < S::kVecs; ++c) {
      const int col = lane_column<S, W>(c);
      if (row_valid && col < g.keys) {
        to_logits<W>(v[r][c], col, context, mask, logit_scale);
      } else {
#pragma unroll
        for (int i = 0; i < W; ++i) v[r][c][i] = -INFINITY;
      }
#pragma unroll
      for (int i = 0; i < W; ++i) stat[r] = fmaxf(stat[r], v[r][c][i]);
    }
  }
  lane_group_reduce<MaxOp, S::kLanes>(stat);
#pragma unroll
  for (int r = 0; r < S::kRows; ++r) {
    const float row_max = finite_or_zero(stat[r]);
    stat[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < S::kVecs; ++c) {
#pragma unroll
      for (int i = 0; i < W; ++i) {
        v[r][c][i] = expf(v[r][c][i] - row_max);
        stat[r] += v[r][c][i];
      }
    }
  }
  lane_group_reduce<SumOp, S::kLanes>(stat);

#pragma unroll
  for (int r = 0; r < S::kRows; ++r) {
    if (first_row + r >= g.rows) continue;
    const float inverse = reciprocal_or_zero(stat[r]);
#pragma unroll
    for (int c = 0; c < S::kVecs; ++c) {
      const int col = lane_column<S, W>(c);
      if (col >= g.keys) continue;
      const int64_t index = (first_row + r) * g.keys + col;
#pragma unroll
      for (int i = 0; i < W; ++i) v[r][c][i] *= inverse;
      store_vector<W>(probs + index, v[r][c]);
      if (y != nullptr) {
        dropout.apply<W>(index, v[r][c]);
        store_vector<W>(y + index, v[r][c]);
      }
    }
  }
}

template <typename T, int W, typename S>
__global__ void __launch_bounds__(kGroupBlockThreads)
    softmax_bwd_group_kernel(const T* __restrict__ dy, const T* __restrict__ probs, T* __restrict__ dscores,
                             int64_t rows, int keys, float logit_scale, DropoutParams dropout_params) {
  const MaybeDropout dropout = MaybeDropout::load(dropout_params);
  const int64_t first_row = group_first_row<S>();
  float d[S::kRows][S::kVecs][W], p[S::kRows][S::kVecs][W];
#pragma unroll
  for (int r = 0; r < S::kRows; ++r) {
#pragma unroll
    for (int c = 0; c < S::kVecs; ++c) {
      const int col = lane_column<S, W>(c);
      if (first_row + r < rows && col < keys) {
        load_floats<W>(dy + (first_row + r) * keys + col, d[r][c]);
        load_floats<W>(probs + (first_row + r) * keys + col, p[r][c]);
      } else {
#pragma unroll
        for (int i = 0; i < W; ++i) d[r][c][i] = p[r][c][i] = 0.0f;
      }
    }
  }
  float dot[S::kRows];
#pragma unroll
  for (int r = 0; r < S::kRows; ++r) {
    dot[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < S::kVecs; ++c) {
      const int col = lane_column<S, W>(c);
      if (first_row + r < rows && col < keys) dropout.apply<W>((first_row + r) * keys + col, d[r][c]);
#pragma unroll
      for (int i = 0; i < W; ++i) dot[r] += d[r][c][i] * p[r][c][i];
    }
  }
  lane_group_reduce<SumOp, S::kLanes>(dot);
#pragma unroll
  for (int r = 0; r < S::kRows; ++r) {
#pragma unroll
    for (int c = 0; c < S::kVecs; ++c) {
      const int col = lane_column<S, W>(c);
      if (first_row + r >= rows || col >= keys) continue;
#pragma unroll
      for (int i = 0; i < W; ++i) d[r][c][i] = p[r][c][i] * (d[r][c][i] - dot[r]) * logit_scale;
      store_vector<W>(dscores + (first_row + r) * keys + col, d[r][c]);
    }
  }
}

// ---- two-sweep layout: a block per row -------------------------------------------------------------------

// Calls body(u, vector) for the kUnroll vectors vector = first + u * blockDim.x below `vectors`.
template <typename Body>
__device__ __forceinline__ void for_unrolled(int64_t first, int64_t vectors, Body&& body) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t vector = first + static_cast<int64_t>(u) * blockDim.x;
    if (vector < vectors) body(u, vector);
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kRowBlockThreads)
    softmax_fwd_row_kernel(const T* __restrict__ scores, Mask mask, T* __restrict__ probs,
                           T* __restrict__ y, Geometry g, float logit_scale, DropoutParams dropout_params) {
  const MaybeDropout dropout = MaybeDropout::load(dropout_params);
  __shared__ float scratch[kGroupReduceScratch<1>];
  const int64_t row = blockIdx.x;
  const RowContext context = row_context(row, g, mask);
  const int64_t vectors = g.keys / W;
  const T* in = scores + row * g.keys;
  const int64_t step = static_cast<int64_t>(kUnroll) * blockDim.x;

  // Running maximum and sum of exp(logit - maximum) of this thread's elements.
  float running_max = -INFINITY, running_sum = 0.0f;
  for (int64_t first = threadIdx.x; first < vectors; first += step) {
    float v[kUnroll][W];
    for_unrolled(first, vectors, [&](int u, int64_t vector) { load_floats<W>(in + vector * W, v[u]); });
    float chunk_max = -INFINITY;
    for_unrolled(first, vectors, [&](int u, int64_t vector) {
      to_logits<W>(v[u], vector * W, context, mask, logit_scale);
#pragma unroll
      for (int i = 0; i < W; ++i) chunk_max = fmaxf(chunk_max, v[u][i]);
    });
    if (chunk_max == -INFINITY) continue;  // nothing visible yet: the running values stay (-inf, 0)
    if (chunk_max > running_max) {
      running_sum *= expf(running_max - chunk_max);
      running_max = chunk_max;
    }
    for_unrolled(first, vectors, [&](int u, int64_t) {
#pragma unroll
      for (int i = 0; i < W; ++i) running_sum += expf(v[u][i] - running_max);
    });
  }
  const float row_max = finite_or_zero(group_reduce<MaxOp>(running_max, scratch));
  const float rescaled = running_max == -INFINITY ? 0.0f : running_sum * expf(running_max - row_max);
  const float inverse = reciprocal_or_zero(group_reduce<SumOp>(rescaled, scratch));

  T* out = probs + row * g.keys;
  for (int64_t first = threadIdx.x; first < vectors; first += step) {
    float v[kUnroll][W];
    for_unrolled(first, vectors, [&](int u, int64_t vector) { load_floats<W>(in + vector * W, v[u]); });
    for_unrolled(first, vectors, [&](int u, int64_t vector) {
      to_logits<W>(v[u], vector * W, context, mask, logit_scale);
#pragma unroll
      for (int i = 0; i < W; ++i) v[u][i] = expf(v[u][i] - row_max) * inverse;
      store_vector<W>(out + vector * W, v[u]);
      if (y != nullptr) {
        dropout.apply<W>(row * g.keys + vector * W, v[u]);
        store_vector<W>(y + row * g.keys + vector * W, v[u]);
      }
    });
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kRowBlockThreads)
    softmax_bwd_row_kernel(const T* __restrict__ dy, const T* __restrict__ probs, T* __restrict__ dscores,
                           int keys, float logit_scale, DropoutParams dropout_params) {
  const MaybeDropout dropout = MaybeDropout::load(dropout_params);
  __shared__ float scratch[kGroupReduceScratch<1>];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * keys;
  const int64_t vectors = keys / W;
  const int64_t step = static_cast<int64_t>(kUnroll) * blockDim.x;

  float partial = 0.0f;
  for (int64_t first = threadIdx.x; first < vectors; first += step) {
    float d[kUnroll][W], p[kUnroll][W];
    for_unrolled(first, vectors, [&](int u, int64_t vector) {
      load_floats<W>(dy + offset + vector * W, d[u]);
      load_floats<W>(probs + offset + vector * W, p[u]);
    });
    for_unrolled(first, vectors, [&](int u, int64_t vector) {
      dropout.apply<W>(offset + vector * W, d[u]);
#pragma unroll
      for (int i = 0; i < W; ++i) partial += d[u][i] * p[u][i];
    });
  }
  const float dot = group_reduce<SumOp>(partial, scratch);

  for (int64_t first = threadIdx.x; first < vectors; first += step) {
    float d[kUnroll][W], p[kUnroll][W];
    for_unrolled(first, vectors, [&](int u, int64_t vector) {
      load_floats<W>(dy + offset + vector * W, d[u]);
      load_floats<W>(probs + offset + vector * W, p[u]);
    });
    for_unrolled(first, vectors, [&](int u, int64_t vector) {
      dropout.apply<W>(offset + vector * W, d[u]);
#pragma unroll
      for (int i = 0; i < W; ++i) d[u][i] = p[u][i] * (d[u][i] - dot) * logit_scale;
      store_vector<W>(dscores + offset + vector * W, d[u]);
    });
  }
}

// ---- launches -------------------------------------------------------------------------------------------

struct ForwardCall {
  const void* scores;
  Mask mask;
  void* probs;
  void* y;
  Geometry geometry;
  float logit_scale;
  DropoutParams dropout;
};

template <typename T, int W>
ffi::Error launch_forward(cudaStream_t stream, const ForwardCall& c) {
  const T* scores = static_cast<const T*>(c.scores);
  T* probs = static_cast<T*>(c.probs);
  T* y = static_cast<T*>(c.y);
  const Geometry& g = c.geometry;
  const auto group = [&](auto shape) {
    using S = decltype(shape);
    softmax_fwd_group_kernel<T, W, S><<<ceil_div(g.rows, S::kRowsPerBlock), kGroupBlockThreads, 0, stream>>>(
        scores, c.mask, probs, y, g, c.logit_scale, c.dropout);
    return launch_error("softmax_fwd_group_kernel");
  };
  const auto row = [&] {
    softmax_fwd_row_kernel<T, W>
        <<<g.rows, kRowBlockThreads, 0, stream>>>(scores, c.mask, probs, y, g, c.logit_scale, c.dropout);
    return launch_error("softmax_fwd_row_kernel");
  };
  return launch_by_length<W>(g.keys, group, row);
}

template <typename T, int W>
ffi::Error launch_backward(cudaStream_t stream, const T* dy, const T* probs, T* dscores, int64_t rows, int keys,
                           float logit_scale, DropoutParams dropout) {
  const auto group = [&](auto shape) {
    using S = decltype(shape);
    softmax_bwd_group_kernel<T, W, S><<<ceil_div(rows, S::kRowsPerBlock), kGroupBlockThreads, 0, stream>>>(
        dy, probs, dscores, rows, keys, logit_scale, dropout);
    return launch_error("softmax_bwd_group_kernel");
  };
  const auto row = [&] {
    softmax_bwd_row_kernel<T, W><<<rows, kRowBlockThreads, 0, stream>>>(dy, probs, dscores, keys, logit_scale, dropout);
    return launch_error("softmax_bwd_row_kernel");
  };
  return launch_by_length<W>(keys, group, row);
}

// ---- handlers -------------------------------------------------------------------------------------------

ffi::Error check_like(std::string_view name, const ffi::AnyBuffer& buffer, std::string_view ref_name,
                      const ffi::AnyBuffer& ref) {
  LS_RETURN_IF_ERROR(require_same_shape(name, buffer, ref_name, ref));
  return require(buffer.element_type() == ref.element_type(),
                 std::string(name) + " must have the dtype of " + std::string(ref_name));
}

// Rows index the grid's x axis in the two-sweep layout, and rows and keys are 32-bit in the kernels.
ffi::Error check_rows(int64_t rows) {
  return require(rows <= 0x7fffffff, "attention softmax takes at most 2**31 - 1 rows, got " + std::to_string(rows));
}

ffi::Error check_keys(int64_t keys) {
  return require(keys <= 0x7fffffff, "attention softmax takes at most 2**31 - 1 keys, got " + std::to_string(keys));
}

// The kernel's view of a (B or 1, H or 1, Q or 1, K) mask of scores (B, H, Q, K): bool or f32.
ffi::Error describe_mask(const ffi::AnyBuffer& mask, ffi::AnyBuffer::Dimensions scores, Mask& out) {
  const auto dims = mask.dimensions();
  bool ok = dims.size() == 4 && dims[3] == scores[3];
  for (size_t axis = 0; ok && axis < 3; ++axis) ok = dims[axis] == 1 || dims[axis] == scores[axis];
  LS_RETURN_IF_ERROR(require(ok, "mask must have shape (B or 1, H or 1, Q or 1, K) for scores " +
                                     shape_string(scores) + ", got " + shape_string(dims)));
  const ffi::DataType dtype = mask.element_type();
  LS_RETURN_IF_ERROR(require(dtype == ffi::DataType::PRED || dtype == ffi::DataType::F32,
                             std::string("mask must be bool or float32, got ") + dtype_name(dtype)));
  out = {mask.untyped_data(), dtype == ffi::DataType::PRED ? Mask::kKeep : Mask::kAdd,
         dims[0] == 1 ? 0 : dims[1] * dims[2] * dims[3], dims[1] == 1 ? 0 : dims[2] * dims[3],
         dims[2] == 1 ? 0 : dims[3]};
  return ffi::Error::Success();
}

ffi::Error attn_softmax_fwd(cudaStream_t stream, ffi::AnyBuffer scores, ffi::Buffer<ffi::U32> seed,
                            std::optional<ffi::AnyBuffer> mask, ffi::Result<ffi::AnyBuffer> probs,
                            std::optional<ffi::Result<ffi::AnyBuffer>> y, float logit_scale, bool causal,
                            uint32_t threshold, float scale) {
  const auto dims = scores.dimensions();
  LS_RETURN_IF_ERROR(require(dims.size() == 4, "scores must have shape (B, H, Q, K), got " + shape_string(dims)));
  LS_RETURN_IF_ERROR(check_like("probs", *probs, "scores", scores));
  if (y) LS_RETURN_IF_ERROR(check_like("y", **y, "scores", scores));
  LS_RETURN_IF_ERROR(require(!causal || dims[2] <= dims[3],
                             "causal attention needs queries <= keys, got scores " + shape_string(dims)));
  Mask view{nullptr, Mask::kNone, 0, 0, 0};
  if (mask) LS_RETURN_IF_ERROR(describe_mask(*mask, dims, view));
  const int64_t elements = static_cast<int64_t>(scores.element_count());
  const DropoutParams dropout{y ? seed.typed_data() : nullptr, threshold, scale};
  if (y) LS_RETURN_IF_ERROR(require_dropout_seed(seed, dropout, elements));
  LS_RETURN_IF_ERROR(check_rows(leading_rows(dims)));
  LS_RETURN_IF_ERROR(check_keys(dims[3]));
  const Geometry geometry{leading_rows(dims), static_cast<int>(dims[3]), static_cast<int>(dims[2]),
                          static_cast<int>(dims[1]), causal};
  if (elements == 0) return ffi::Error::Success();

  void* y_data = y ? (*y)->untyped_data() : nullptr;
  const ForwardCall call{scores.untyped_data(), view, probs->untyped_data(), y_data, geometry, logit_scale, dropout};
  return dispatch_float(scores.element_type(), "scores", [&](auto tag) {
    using T = decltype(tag);
    if (vectorizable<T>(geometry.keys, {call.scores, view.data, call.probs, y_data}))
      return launch_forward<T, kVecWidth<T>>(stream, call);
    return launch_forward<T, 1>(stream, call);
  });
}

ffi::Error attn_softmax_bwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer probs, ffi::Buffer<ffi::U32> seed,
                            ffi::Result<ffi::AnyBuffer> dscores, float logit_scale, uint32_t threshold, float scale) {
  LS_RETURN_IF_ERROR(require(probs.dimensions().size() >= 1, "probs must have a key axis"));
  LS_RETURN_IF_ERROR(check_like("dy", dy, "probs", probs));
  LS_RETURN_IF_ERROR(check_like("dscores", *dscores, "probs", probs));
  const int64_t elements = static_cast<int64_t>(probs.element_count());
  const DropoutParams requested{seed.typed_data(), threshold, scale};
  if (requested.enabled()) LS_RETURN_IF_ERROR(require_dropout_seed(seed, requested, elements));
  const int64_t rows = leading_rows(probs.dimensions());
  LS_RETURN_IF_ERROR(check_rows(rows));
  LS_RETURN_IF_ERROR(check_keys(last_dim(probs.dimensions())));
  const int keys = static_cast<int>(last_dim(probs.dimensions()));
  if (elements == 0) return ffi::Error::Success();

  const DropoutParams dropout{requested.enabled() ? seed.typed_data() : nullptr, threshold, scale};
  return dispatch_float(probs.element_type(), "probs", [&](auto tag) {
    using T = decltype(tag);
    const T* d = static_cast<const T*>(dy.untyped_data());
    const T* p = static_cast<const T*>(probs.untyped_data());
    T* out = static_cast<T*>(dscores->untyped_data());
    if (vectorizable<T>(keys, {d, p, out}))
      return launch_backward<T, kVecWidth<T>>(stream, d, p, out, rows, keys, logit_scale, dropout);
    return launch_backward<T, 1>(stream, d, p, out, rows, keys, logit_scale, dropout);
  });
}

}  // namespace

LS_FFI_TARGET(ls_attn_softmax_fwd, attn_softmax_fwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .OptionalArg<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .OptionalRet<ffi::AnyBuffer>()
                  .Attr<float>("logit_scale")
                  .Attr<bool>("causal")
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

LS_FFI_TARGET(ls_attn_softmax_bwd, attn_softmax_bwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<float>("logit_scale")
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

}  // namespace ls
