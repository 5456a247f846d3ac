// Token embedding (math and shapes: ls_jax/ops/embedding.py):
//   y[i] = (token_scale * table[clip(tokens[i])] + pos_table[clip(positions[i])]) * m[i] * (tokens[i] != pad)
// for the n = B * L tokens i in row-major order, m the Philox dropout multiplier of element (i, h) at flat
// index i * H + h.
//
// Backward, deterministic and without atomics: the Python wrapper sorts the clipped ids (XLA's stable sort),
// giving the permutation `order` and the tokens in that order (sorted_tokens, for the padding test), and marks
// where each run of equal ids ends (run_end). The sorted positions are cut into chunks of at most kChunk: a chunk
// starts where a run starts and at every multiple of kChunk inside a run. embed_chunk_kernel gives each window of
// kChunk sorted positions one warp, which adds each of the window's chunks' gradient rows in token order (f32
// registers) into the chunk's first position of an (n, H) f32 output; embed_merge_kernel then adds, in order, the
// later chunk sums of every run longer than its first chunk into the run's first position. The wrapper scatters the run sums into the table, where XLA adds
// them in place to the table's other gradients (a tied output projection's). Cost: one pass over dy, one (n, H)
// write and a read of the later chunk sums; no table-sized buffer per lookup. A token occurring k times costs
// one warp at most kChunk rows plus k / kChunk chunk sums in the merge: BERT's segment embedding, one id at
// every position of the batch, is no longer summed by one warp.
//
// Targets (tokens, positions, order, run_end int32 (n) or (B, L); table (V, H), pos_table (P, H) f32 or the
// output dtype; seed uint32[2]; attributes token_scale: f32, has_padding: bool, padding_id: i64,
// threshold: u32, scale: f32 (dropout, as in dropout.cu)):
//   ls_embed_fwd(tokens, table, seed) -> y (..., H)
//   ls_embed_pos_fwd(tokens, positions, table, pos_table, seed) -> y (..., H)
//   ls_embed_grad(dy (n, H), sorted_tokens, order, run_end, seed) -> sums f32 (n, H)
//     with order the token positions in the order of their sorted clipped ids, sorted_tokens[k] =
//     tokens[order[k]], run_end[k] the end of the run of equal ids starting at k (k where none starts there);
//     sums[k] at a run start k is the run's sum times token_scale (scale for the token table, 1 for the
//     position table), the other rows are scratch.
#include "rows.cuh"

namespace ls {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kRowUnroll = 2;
constexpr int kBlocksPerSm = 4;
// The backward gives a warp to each window of kChunk sorted positions, a lane a 16-byte column vector (grid.y
// covers rows wider than a warp). Lane j reads entry j's token position, token and run end at once; a ballot
// gives the window's chunk starts and shuffles hand the entries to every lane: one memory latency before the dy
// rows, not a chain run end -> position -> row.
constexpr int kChunk = 32;                // entries of a window: one per lane
constexpr int kWindowThreads = 64;        // two windows a block: a few thousand tokens still fill every SM
// dy rows of a window loaded before they are added, in order: 4 KB a warp for 16-bit rows; f32 rows and odd
// widths keep 4 (with 8, ptxas spills them).
template <typename D, int W>
inline constexpr int kWindowRowsInFlight = sizeof(D) == 2 && W > 1 ? 8 : 4;
constexpr int kMergeSumsInFlight = 4;     // chunk sums of a run loaded before they are added, in order
constexpr unsigned kFullWarp = 0xffffffffu;

struct Padding {
  bool enabled;
  int64_t id;

  __device__ __forceinline__ bool is_pad(int32_t token) const { return enabled && token == id; }
};

__device__ __forceinline__ int64_t clip(int32_t index, int64_t rows) {
  return index < 0 ? 0 : (index >= rows ? rows - 1 : index);
}

// ---- forward --------------------------------------------------------------------------------------------

template <typename D, typename TT, typename PT, int W>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm)
    embed_fwd_kernel(const int32_t* __restrict__ tokens, const int32_t* __restrict__ positions,
                     const TT* __restrict__ table, const PT* __restrict__ pos_table, D* __restrict__ y, int64_t n,
                     int64_t cols, int64_t vocab, int64_t max_positions, float token_scale, Padding padding,
                     DropoutParams params) {
  const int64_t vectors = cols / W;
  const int64_t vector = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (vector >= vectors) return;
  const bool drop = params.enabled();
  const Dropout dropout = drop ? Dropout::load(params) : Dropout{};
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; first < n;
       first += step * kRowUnroll) {
    float v[kRowUnroll][W], p[kRowUnroll][W];
    int32_t token[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int64_t i = first + u * step;
      if (i < n) {
        token[u] = tokens[i];
        load_floats<W>(table + clip(token[u], vocab) * cols + vector * W, v[u]);
        if (pos_table != nullptr)
          load_floats<W>(pos_table + clip(positions[i], max_positions) * cols + vector * W, p[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int64_t i = first + u * step;
      if (i < n) {
        const int64_t index = i * cols + vector * W;
#pragma unroll
        for (int e = 0; e < W; ++e) v[u][e] = v[u][e] * token_scale + (pos_table != nullptr ? p[u][e] : 0.0f);
        if (drop) dropout.apply<W>(static_cast<uint64_t>(index), v[u]);
        if (padding.is_pad(token[u])) {
#pragma unroll
          for (int e = 0; e < W; ++e) v[u][e] = 0.0f;
        }
        store_floats<W>(y + index, v[u]);
      }
    }
  }
}

template <typename D, typename TT, typename PT, int W>
ffi::Error launch_forward(cudaStream_t stream, const int32_t* tokens, const int32_t* positions, const TT* table,
                          const PT* pos_table, D* y, int64_t n, int64_t cols, int64_t vocab, int64_t max_positions,
                          float token_scale, Padding padding, DropoutParams params) {
  dim3 block;
  unsigned chunks = 0;
  LS_RETURN_IF_ERROR(strip_layout(cols / W, kBlockThreads, block, chunks));
  int64_t row_blocks = 0;
  LS_RETURN_IF_ERROR(stride_grid(n, int64_t{block.y} * kRowUnroll, kBlocksPerSm, row_blocks));
  embed_fwd_kernel<D, TT, PT, W><<<dim3(static_cast<unsigned>(row_blocks), chunks), block, 0, stream>>>(
      tokens, positions, table, pos_table, y, n, cols, vocab, max_positions, token_scale, padding, params);
  return launch_error("embed_fwd_kernel");
}

ffi::Error require_ids(std::string_view name, const ffi::AnyBuffer& ids, int64_t n) {
  return require(ids.element_type() == ffi::DataType::S32 && static_cast<int64_t>(ids.element_count()) == n,
                 std::string(name) + " must be int32 with " + std::to_string(n) + " elements, got " +
                     dtype_name(ids.element_type()) + shape_string(ids.dimensions()));
}

ffi::Error require_table(std::string_view name, const ffi::AnyBuffer& table, int64_t cols) {
  const auto dims = table.dimensions();
  return require(dims.size() == 2 && dims[0] >= 1 && dims[1] == cols,
                 std::string(name) + " must have shape (rows >= 1, " + std::to_string(cols) + "), got " +
                     shape_string(dims));
}

ffi::Error forward(cudaStream_t stream, const ffi::AnyBuffer& tokens, const ffi::AnyBuffer* positions,
                   const ffi::AnyBuffer& table, const ffi::AnyBuffer* pos_table, const ffi::Buffer<ffi::U32>& seed,
                   ffi::AnyBuffer& y, float token_scale, bool has_padding, int64_t padding_id, uint32_t threshold,
                   float scale) {
  const int64_t n = static_cast<int64_t>(tokens.element_count());
  const int64_t cols = last_dim(y.dimensions());
  LS_RETURN_IF_ERROR(require_ids("tokens", tokens, n));
  LS_RETURN_IF_ERROR(require(static_cast<int64_t>(y.element_count()) == n * cols,
                             "the embedding output must have one row per token, got " + shape_string(y.dimensions())));
  LS_RETURN_IF_ERROR(require_table("table", table, cols));
  if (positions) {
    LS_RETURN_IF_ERROR(require_ids("positions", *positions, n));
    LS_RETURN_IF_ERROR(require_table("pos_table", *pos_table, cols));
  }
  const DropoutParams params{seed.typed_data(), threshold, scale};
  LS_RETURN_IF_ERROR(require_dropout_seed(seed, params, n * cols));
  if (n == 0 || cols == 0) return ffi::Error::Success();
  const int64_t vocab = table.dimensions()[0];
  const int64_t max_positions = pos_table ? pos_table->dimensions()[0] : 1;
  const Padding padding{has_padding, padding_id};
  const int32_t* token_ptr = static_cast<const int32_t*>(tokens.untyped_data());
  const int32_t* position_ptr = positions ? static_cast<const int32_t*>(positions->untyped_data()) : nullptr;
  return dispatch_float(y.element_type(), "the output", [&](auto out_tag) {
    using D = decltype(out_tag);
    return dispatch_param<D>(table.element_type(), "table", [&](auto table_tag) {
      using TT = decltype(table_tag);
      const ffi::DataType pos_dtype = pos_table ? pos_table->element_type() : table.element_type();
      return dispatch_param<D>(pos_dtype, "pos_table", [&](auto pos_tag) {
        using PT = decltype(pos_tag);
        const TT* t = static_cast<const TT*>(table.untyped_data());
        const PT* p = pos_table ? static_cast<const PT*>(pos_table->untyped_data()) : nullptr;
        D* out = static_cast<D*>(y.untyped_data());
        const bool vector = cols % kVecWidth<D> == 0 && is_aligned(t, 16) && is_aligned(out, 16) &&
                            (p == nullptr || is_aligned(p, 16));
        if (vector)
          return launch_forward<D, TT, PT, kVecWidth<D>>(stream, token_ptr, position_ptr, t, p, out, n, cols, vocab,
                                                         max_positions, token_scale, padding, params);
        return launch_forward<D, TT, PT, 1>(stream, token_ptr, position_ptr, t, p, out, n, cols, vocab,
                                            max_positions, token_scale, padding, params);
      });
    });
  });
}

ffi::Error embed_fwd(cudaStream_t stream, ffi::AnyBuffer tokens, ffi::AnyBuffer table, ffi::Buffer<ffi::U32> seed,
                     ffi::Result<ffi::AnyBuffer> y, float token_scale, bool has_padding, int64_t padding_id,
                     uint32_t threshold, float scale) {
  return forward(stream, tokens, nullptr, table, nullptr, seed, *y, token_scale, has_padding, padding_id, threshold,
                 scale);
}

ffi::Error embed_pos_fwd(cudaStream_t stream, ffi::AnyBuffer tokens, ffi::AnyBuffer positions, ffi::AnyBuffer table,
                         ffi::AnyBuffer pos_table, ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> y,
                         float token_scale, bool has_padding, int64_t padding_id, uint32_t threshold, float scale) {
  return forward(stream, tokens, &positions, table, &pos_table, seed, *y, token_scale, has_padding, padding_id,
                 threshold, scale);
}

// ---- backward -------------------------------------------------------------------------------------------

// Stores token_scale * sum (a chunk's sum) and clears sum for the next chunk.
template <int W>
__device__ __forceinline__ void write_chunk_sum(float* __restrict__ out, float (&sum)[W], float token_scale) {
#pragma unroll
  for (int e = 0; e < W; ++e) sum[e] *= token_scale;
  store_floats<W>(out, sum);
#pragma unroll
  for (int e = 0; e < W; ++e) sum[e] = 0.0f;
}

// sums[k] = token_scale * sum of the (dropout-masked, non-padding) dy rows order[k..chunk end) where a chunk
// starts at k (a run start, or a multiple of kChunk), added in that (token) order; other rows are not written. A
// window is the kChunk sorted positions from a multiple of kChunk: it starts a chunk, and no chunk crosses its end.
// One warp per window (blockDim.x == 32): lane j loads entry j's token position, token and whether a run starts
// there, one ballot marks the window's chunk starts, and the warp walks the entries in order, its lanes over
// column vectors, kWindowRowsInFlight dy rows loaded before they are added; a chunk's sum is written when the
// next chunk starts. The index loads and their latency come once per window, not once per sorted position.
template <typename D, int W>
__global__ void __launch_bounds__(kWindowThreads)
    embed_chunk_kernel(const D* __restrict__ dy, const int32_t* __restrict__ sorted_tokens,
                       const int32_t* __restrict__ order, const int32_t* __restrict__ run_end,
                       float* __restrict__ sums, int64_t n, int64_t cols, float token_scale, Padding padding,
                       DropoutParams params) {
  constexpr int kE = kWindowRowsInFlight<D, W>;
  const int lane = static_cast<int>(threadIdx.x);
  const int64_t window = (static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y) * kChunk;
  if (window >= n) return;  // the whole warp: window depends on threadIdx.y only
  const int64_t entry = window + lane;
  const bool valid = entry < n;
  const int32_t entry_position = valid ? order[entry] : 0;
  const int32_t entry_token = valid ? sorted_tokens[entry] : 0;
  const unsigned starts = __ballot_sync(kFullWarp, valid && (lane == 0 || run_end[entry] > entry));
  const int length = static_cast<int>(n - window < kChunk ? n - window : kChunk);
  const int64_t vector = static_cast<int64_t>(blockIdx.y) * 32 + lane;
  const bool has_columns = vector < cols / W;
  const bool drop = params.enabled();
  const Dropout dropout = drop ? Dropout::load(params) : Dropout{};
  float sum[W];
#pragma unroll
  for (int e = 0; e < W; ++e) sum[e] = 0.0f;
  int64_t chunk_start = window;
  for (int first = 0; first < length; first += kE) {  // warp-uniform bounds: all lanes shuffle
    int64_t index[kE];
    bool used[kE];
    float d[kE][W];
#pragma unroll
    for (int u = 0; u < kE; ++u) {
      const int j = first + u;
      const int32_t token_position = __shfl_sync(kFullWarp, entry_position, j & 31);
      const int32_t token = __shfl_sync(kFullWarp, entry_token, j & 31);
      used[u] = j < length && has_columns && !padding.is_pad(token);
      index[u] = static_cast<int64_t>(token_position) * cols + vector * W;
      if (used[u]) load_floats<W>(dy + index[u], d[u]);
    }
#pragma unroll
    for (int u = 0; u < kE; ++u) {
      const int j = first + u;
      if (j > 0 && j < length && (starts >> j & 1u)) {  // entry j starts the next chunk: write this one's sum
        if (has_columns) write_chunk_sum<W>(sums + chunk_start * cols + vector * W, sum, token_scale);
        chunk_start = window + j;
      }
      if (!used[u]) continue;
      if (drop) dropout.apply<W>(static_cast<uint64_t>(index[u]), d[u]);
#pragma unroll
      for (int e = 0; e < W; ++e) sum[e] += d[u][e];
    }
  }
  if (has_columns) write_chunk_sum<W>(sums + chunk_start * cols + vector * W, sum, token_scale);
}

// For the run that starts last in each window, if it reaches past the window: sums[k] += sums[m] for the later
// window starts m in (k, run_end[k]) (its other chunk sums), in order. Only that run of a window can reach past
// its end. One warp per window; rows that are no run start are left as they are (the wrapper's scatter keeps
// only run starts).
template <int W>
__global__ void __launch_bounds__(kWindowThreads)
    embed_merge_kernel(const int32_t* __restrict__ run_end, float* __restrict__ sums, int64_t n, int64_t cols) {
  constexpr int kM = kMergeSumsInFlight;
  const int64_t window = (static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y) * kChunk;
  if (window >= n) return;
  const int64_t entry = window + threadIdx.x;
  const int64_t later = window + kChunk;
  const int64_t end = entry < n ? run_end[entry] : 0;
  const unsigned crossing = __ballot_sync(kFullWarp, end > later);  // a run start whose run leaves the window
  if (crossing == 0) return;
  const int owner = 31 - __clz(crossing);
  const int64_t start = window + owner;
  const int64_t run_stop = __shfl_sync(kFullWarp, end, owner);
  const int64_t vector = static_cast<int64_t>(blockIdx.y) * 32 + threadIdx.x;
  if (vector >= cols / W) return;
  float total[W];
  load_floats<W>(sums + start * cols + vector * W, total);
  for (int64_t first = later; first < run_stop; first += kM * kChunk) {
    float partial[kM][W];
#pragma unroll
    for (int u = 0; u < kM; ++u) {
      const int64_t m = first + u * kChunk;
      if (m < run_stop) load_floats<W>(sums + m * cols + vector * W, partial[u]);
    }
#pragma unroll
    for (int u = 0; u < kM; ++u) {
      if (first + u * kChunk >= run_stop) continue;
#pragma unroll
      for (int e = 0; e < W; ++e) total[e] += partial[u][e];
    }
  }
  store_floats<W>(sums + start * cols + vector * W, total);
}

// Blocks of 32 lanes across rows of `vectors` column vectors (grid.y).
ffi::Error column_blocks(int64_t vectors, int64_t cols, unsigned& blocks) {
  const int64_t needed = ceil_div(vectors, int64_t{32});
  LS_RETURN_IF_ERROR(require(needed <= 65535, "rows of " + std::to_string(cols) + " elements are too long"));
  blocks = static_cast<unsigned>(needed);
  return ffi::Error::Success();
}

template <typename D, int W>
ffi::Error launch_grad(cudaStream_t stream, const D* dy, const int32_t* sorted_tokens, const int32_t* order,
                       const int32_t* run_end, float* sums, int64_t n, int64_t cols, float token_scale,
                       Padding padding, DropoutParams params) {
  const dim3 block(32, kWindowThreads / 32);
  const auto window_blocks = static_cast<unsigned>(ceil_div(ceil_div(n, kChunk), int64_t{block.y}));
  unsigned chunk_columns = 0;
  LS_RETURN_IF_ERROR(column_blocks(cols / W, cols, chunk_columns));
  embed_chunk_kernel<D, W><<<dim3(window_blocks, chunk_columns), block, 0, stream>>>(
      dy, sorted_tokens, order, run_end, sums, n, cols, token_scale, padding, params);
  LS_RETURN_IF_ERROR(launch_error("embed_chunk_kernel"));
  if (n <= kChunk) return ffi::Error::Success();  // one window: every run is one chunk
  constexpr int kF = kVecWidth<float>;           // the merge reads f32 rows, in 16-byte vectors where they allow
  const bool vector = cols % kF == 0 && is_aligned(sums, 16);
  unsigned merge_columns = 0;
  LS_RETURN_IF_ERROR(column_blocks(vector ? cols / kF : cols, cols, merge_columns));
  if (vector)
    embed_merge_kernel<kF><<<dim3(window_blocks, merge_columns), block, 0, stream>>>(run_end, sums, n, cols);
  else
    embed_merge_kernel<1><<<dim3(window_blocks, merge_columns), block, 0, stream>>>(run_end, sums, n, cols);
  return launch_error("embed_merge_kernel");
}

ffi::Error embed_grad(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer sorted_tokens, ffi::AnyBuffer order,
                      ffi::AnyBuffer run_end, ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> sums,
                      float token_scale, bool has_padding, int64_t padding_id, uint32_t threshold, float scale) {
  const auto dy_dims = dy.dimensions();
  LS_RETURN_IF_ERROR(require(dy_dims.size() == 2, "dy must have shape (tokens, hidden), got " +
                                                      shape_string(dy_dims)));
  const int64_t n = dy_dims[0];
  const int64_t cols = dy_dims[1];
  LS_RETURN_IF_ERROR(require(n <= 0x7fffffff, "more than 2**31 - 1 tokens"));
  LS_RETURN_IF_ERROR(require_ids("sorted_tokens", sorted_tokens, n));
  LS_RETURN_IF_ERROR(require_ids("order", order, n));
  LS_RETURN_IF_ERROR(require_ids("run_end", run_end, n));
  LS_RETURN_IF_ERROR(require(sums->element_type() == ffi::DataType::F32 && sums->dimensions().size() == 2 &&
                                 sums->dimensions()[0] == n && sums->dimensions()[1] == cols,
                             "the run sums must be float32 (" + std::to_string(n) + ", " + std::to_string(cols) +
                                 "), got " + dtype_name(sums->element_type()) + shape_string(sums->dimensions())));
  const DropoutParams params{seed.typed_data(), threshold, scale};
  LS_RETURN_IF_ERROR(require_dropout_seed(seed, params, n * cols));
  if (n == 0 || cols == 0) return ffi::Error::Success();
  const Padding padding{has_padding, padding_id};
  const int32_t* sorted_ptr = static_cast<const int32_t*>(sorted_tokens.untyped_data());
  const int32_t* order_ptr = static_cast<const int32_t*>(order.untyped_data());
  const int32_t* end_ptr = static_cast<const int32_t*>(run_end.untyped_data());
  float* out = static_cast<float*>(sums->untyped_data());
  return dispatch_float(dy.element_type(), "dy", [&](auto dy_tag) {
    using D = decltype(dy_tag);
    const D* d = static_cast<const D*>(dy.untyped_data());
    if (cols % kVecWidth<D> == 0 && is_aligned(d, 16) && is_aligned(out, 16))
      return launch_grad<D, kVecWidth<D>>(stream, d, sorted_ptr, order_ptr, end_ptr, out, n, cols, token_scale,
                                          padding, params);
    return launch_grad<D, 1>(stream, d, sorted_ptr, order_ptr, end_ptr, out, n, cols, token_scale, padding, params);
  });
}

}  // namespace

LS_FFI_TARGET(ls_embed_fwd, embed_fwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<float>("token_scale")
                  .Attr<bool>("has_padding")
                  .Attr<int64_t>("padding_id")
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

LS_FFI_TARGET(ls_embed_pos_fwd, embed_pos_fwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<float>("token_scale")
                  .Attr<bool>("has_padding")
                  .Attr<int64_t>("padding_id")
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

LS_FFI_TARGET(ls_embed_grad, embed_grad,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<float>("token_scale")
                  .Attr<bool>("has_padding")
                  .Attr<int64_t>("padding_id")
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

}  // namespace ls
