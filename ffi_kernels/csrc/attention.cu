// Fused attention for short sequences: softmax(q k^T * scale + masks) with Philox dropout, times v, a (batch, head)
// at a time per block, all in registers and shared memory; its backward recomputes the probabilities from the
// saved log-sum-exp (math: ls_jax/ops/attention.py).
//
// Shapes: queries and keys 1..128, head_dim 64, bf16 or f16 (tensor cores: mma.sync m16n8k16, f32 accumulators).
// Each warp owns 16 query rows and holds their whole score rows, so the softmax reductions are quad shuffles.
// Rounding follows XLA's composition (scores GEMM in the activation dtype, then f32 softmax): the scores and
// dp = dout v^T are rounded to the activation dtype before the softmax math. The kernels hold logits in base 2
// (scaled by log2(e) with logit_scale) so that each exponential is one ex2.approx instruction; lse leaves and
// enters in natural-log units, as the XLA implementation has it.
//
//   logits = round(q k^T) * logit_scale, -inf where key_mask is false or (causal) k > q + K - Q
//   lse    = log sum_k exp(logits)                  (+inf for a row with no visible key: its probs are 0)
//   probs  = exp(logits - lse);   kept = probs * keep * scale     (keep: Philox word of (b, h, q, k) >= threshold)
//   out    = kept v
//   dp     = round(dout v^T) * keep * scale;   dscores = logit_scale * probs * (dp - sum_k dp * probs)
//   dq = dscores k,   dk = dscores^T q,   dv = kept^T dout
//
// Operands are "sources" of shape (B, L, P, H, 64): the query is part 0 of query_source (P = 1, or P = 3 for a
// packed self-attention qkv), key and value are parts P - 2 and P - 1 of key_value_source (P = 2, or the same
// qkv). The backward writes gradients in the sources' layouts, so a packed qkv gets one packed gradient.
// query_bias (P, H, 64) is the query source's projection bias, added (in T, as XLA adds a T bias) to every
// part of it as the tiles are loaded: q for a query, q, k and v for a packed qkv. The backward returns its
// gradient as f32 partial sums over each warp's 16 rows, (B, ceil(Q / 16), P, H, 64), for XLA to add up.
//
// Targets
//   ls_attention_fwd(query_source, key_value_source, query_bias, seed u32[2] [, key_mask bool (B, K)])
//       -> (out (B, Q, H, 64), lse f32 (B, H, Q), keep_bits u8 (B, H, Q, ceil(K / 8))); attributes causal: bool,
//       logit_scale: f32, threshold: u32, scale: f32 (as ls_dropout). keep_bits is the dropout keep mask, 8 keys
//       to a byte as numpy's packbits(bitorder="little") writes it; shape (0,) without dropout.
//   ls_attention_bwd(dout, query_source, key_value_source, query_bias, lse, keep_bits [, key_mask])
//       -> (d_query_source, d_query_bias_partials [, d_key_value_source]); without d_key_value_source the sources
//       are one packed qkv (P = 3) and d_query_source receives dq, dk and dv. Same attributes. The backward reads
//       the forward's keep mask instead of drawing the Philox words again (about a fifth of its instructions).
#include "common.cuh"

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

namespace ls {
namespace {

constexpr int kHeadDim = 64;
constexpr int kRowBytes = kHeadDim * 2;  // one 64-element row of a 16-bit type: 8 chunks of 16 bytes
constexpr int kMaxLength = 128;

// ---- tensor-core primitives ------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Four 8x8 16-bit matrices; lane i gives the address of row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_transposed(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// c += a b for a 16x16 A (row-major fragment), a 16x8 B (column-major fragment) and f32 C. Fragment layouts
// (g = lane / 4, t = lane % 4): a = {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}; b = {(2t..2t+1, g),
// (2t+8.., g)}; c = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats as a pair of T (the lower column in the low half), as the fragments hold them.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float low, float high) {
  Pack<T, 2> pair;
  pair.v[0] = from_float<T>(low);
  pair.v[1] = from_float<T>(high);
  return *reinterpret_cast<uint32_t*>(&pair);
}

// The A fragment of columns 16c..16c+15 of a 16-row tile held as C fragments of 8 columns each.
template <typename T>
__device__ __forceinline__ void to_a_fragment(uint32_t (&a)[4], const float (&left)[4], const float (&right)[4]) {
  a[0] = pack_pair<T>(left[0], left[1]);
  a[1] = pack_pair<T>(left[2], left[3]);
  a[2] = pack_pair<T>(right[0], right[1]);
  a[3] = pack_pair<T>(right[2], right[3]);
}

// ---- shared-memory tiles ---------------------------------------------------------------------------------

// A tile of 16-bit rows of `pitch` bytes (a multiple of 128) whose 16-byte chunks are XOR-swizzled by the row,
// so that the 8 rows one ldmatrix reads (or one fragment store writes) fall in different banks.
struct Tile {
  uint8_t* base;
  int pitch;

  __device__ __forceinline__ uint8_t* chunk(int row, int chunk_index) const {
    return base + row * pitch + ((chunk_index ^ (row & 7)) << 4);
  }
  __device__ __forceinline__ uint32_t address(int row, int chunk_index) const {
    return shared_address(chunk(row, chunk_index));
  }
};

// Starts copying `rows` rows of 64 elements (row r at src + r * row_stride) into a 64-wide tile and zero-fills
// rows rows..padded_rows - 1, so that padding contributes exact zeros to the products. Asynchronous (cp.async,
// sm_80+): every copy of the block is in flight at once; finish_loads() ends them. Thread i copies 16-byte chunk
// i % 8 of rows i / 8, i / 8 + blockDim.x / 8, ... (blockDim.x is a multiple of 32).
template <typename T>
__device__ __forceinline__ void load_rows(const Tile& tile, const T* __restrict__ src, int64_t row_stride, int rows,
                                          int padded_rows) {
  for (int index = threadIdx.x; index < padded_rows * 8; index += blockDim.x) {
    const int row = index / 8, chunk = index % 8;
    const bool inside = row < rows;
    const T* from = src + (inside ? row : 0) * row_stride + chunk * 8;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(tile.address(row, chunk)), "l"(from),
                 "r"(inside ? 16 : 0));
  }
}

// Two T in one register, as the packed-arithmetic intrinsics take them.
template <typename T>
using Pair = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;

// The 16-byte chunk of a (64,) projection bias that this thread adds to the rows it copied (chunk
// threadIdx.x % 8, as load_rows assigns them); absent for a null bias.
template <typename T>
struct ChunkBias {
  bool present;
  Pack<Pair<T>, 4> value;
};

template <typename T>
__device__ __forceinline__ ChunkBias<T> load_chunk_bias(const T* __restrict__ bias) {
  ChunkBias<T> chunk_bias{bias != nullptr, {}};
  if (bias != nullptr) chunk_bias.value = *reinterpret_cast<const Pack<Pair<T>, 4>*>(bias + threadIdx.x % 8 * 8);
  return chunk_bias;
}

// In place, on the chunks this thread's load_rows copied: rows 0..rows-1 of a tile += bias, in T's packed add
// (one rounding of the exact sum). Four rows are read before any is written, so that their shared-memory
// latencies overlap.
template <typename T>
__device__ __forceinline__ void add_bias(const Tile& tile, const ChunkBias<T>& bias, int rows) {
  if (!bias.present) return;
  using Chunk = Pack<Pair<T>, 4>;
  constexpr int kBatch = 4;
  const int chunk = threadIdx.x % 8, stride = blockDim.x / 8;
  for (int first = threadIdx.x / 8; first < rows; first += kBatch * stride) {
    Chunk values[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (first + u * stride < rows) values[u] = *reinterpret_cast<const Chunk*>(tile.chunk(first + u * stride, chunk));
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (first + u * stride >= rows) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) values[u].v[i] = __hadd2(values[u].v[i], bias.value.v[i]);
      *reinterpret_cast<Chunk*>(tile.chunk(first + u * stride, chunk)) = values[u];
    }
  }
}

// A = rows row0..row0+15, columns 16c..16c+15 of a tile (row-major operand).
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const Tile& tile, int row0, int c) {
  const int lane = threadIdx.x % 32;
  ldmatrix(a, tile.address(row0 + lane % 16, 2 * c + lane / 16));
}

// A = the transpose of rows 16c..16c+15, columns col0..col0+15 of a tile: A[m][k] = tile[16c + k][col0 + m].
__device__ __forceinline__ void load_a_transposed(uint32_t (&a)[4], const Tile& tile, int col0, int c) {
  const int lane = threadIdx.x % 32;
  ldmatrix_transposed(a, tile.address(16 * c + lane % 8 + (lane / 16) * 8, col0 / 8 + (lane / 8) % 2));
}

// B fragments of two 8-column n-tiles whose B[k][n] = tile[row0 + n][16c + k] (tile rows are B's columns, as
// keys are for q k^T): b[0], b[1] for n-tile row0..row0+7, b[2], b[3] for row0+8..row0+15.
__device__ __forceinline__ void load_b_rows(uint32_t (&b)[4], const Tile& tile, int row0, int c) {
  const int lane = threadIdx.x % 32;
  ldmatrix(b, tile.address(row0 + lane % 8 + (lane / 16) * 8, 2 * c + (lane / 8) % 2));
}

// B fragments of two n-tiles whose B[k][n] = tile[16c + k][col0 + n] (tile rows are B's rows, as keys are for
// probs v): b[0], b[1] for columns col0..col0+7, b[2], b[3] for col0+8..col0+15.
__device__ __forceinline__ void load_b_columns(uint32_t (&b)[4], const Tile& tile, int col0, int c) {
  const int lane = threadIdx.x % 32;
  ldmatrix_transposed(b, tile.address(16 * c + lane % 8 + ((lane / 8) % 2) * 8, col0 / 8 + lane / 16));
}

// Writes a C fragment pair (row, 8j + 2t .. +1) of T into a tile.
template <typename T>
__device__ __forceinline__ void store_pair(const Tile& tile, int row, int j, float low, float high) {
  const int t = threadIdx.x % 4;
  *reinterpret_cast<uint32_t*>(tile.chunk(row, j) + 4 * t) = pack_pair<T>(low, high);
}

// ---- geometry ---------------------------------------------------------------------------------------------

// A (B, L, P, H, 64) source or a (B, L, H, 64) tensor: element (b, l, h, d) of its part lives at
// data + b * batch_stride + l * row_stride + h * 64 + d.
struct Strided {
  void* data;
  int64_t batch_stride;
  int64_t row_stride;

  template <typename T>
  __device__ __forceinline__ T* rows(int b, int h) const {
    return static_cast<T*>(data) + b * batch_stride + h * kHeadDim;
  }
};

struct Geometry {
  int heads, queries, keys;
  bool causal;
  float logit_scale;
  float log2_scale;      // logit_scale * log2(e): the scale of the kernels' base-2 logits
  const bool* key_mask;  // (B, K) or null
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

// 2^x by the SFU (ex2.approx.ftz: relative error about 2^-22, subnormal results flushed to 0; 2^-inf = 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Scores of a warp's 16 rows against every key: s[j] is the C fragment of keys 8j..8j+7.
template <typename T, int kKeyTiles>
__device__ __forceinline__ void row_products(float (&s)[kKeyTiles][4], const Tile& rows, int row0, const Tile& cols,
                                             int col_chunks) {
#pragma unroll
  for (int j = 0; j < kKeyTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
  uint32_t a[4][4];
#pragma unroll
  for (int c = 0; c < 4; ++c) load_a(a[c], rows, row0, c);
#pragma unroll
  for (int n = 0; n < kKeyTiles / 2; ++n) {
    if (n >= col_chunks) break;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      uint32_t b[4];
      load_b_rows(b, cols, 16 * n, c);
      mma<T>(s[2 * n], a[c], b[0], b[1]);
      mma<T>(s[2 * n + 1], a[c], b[2], b[3]);
    }
  }
}

// acc += A B for a warp's 16 rows, A (16 x 16) in registers, B rows 16 block..16 block + 15 of a tile (all 64
// columns; the 8 C fragments of acc hold 8 columns each).
template <typename T>
__device__ __forceinline__ void accumulate_row_block(float (&acc)[kHeadDim / 8][4], const uint32_t (&a)[4],
                                                     const Tile& tile, int block) {
#pragma unroll
  for (int c = 0; c < kHeadDim / 16; ++c) {
    uint32_t b[4];
    load_b_columns(b, tile, 16 * c, block);
    mma<T>(acc[2 * c], a, b[0], b[1]);
    mma<T>(acc[2 * c + 1], a, b[2], b[3]);
  }
}

// acc = P B for a warp's 16 rows: P (16 x keys) held as C fragments (p[j] for keys 8j..8j+7), B (keys x 64) the
// rows of a tile (v for the context, k for dq).
template <typename T, int kKeyTiles>
__device__ __forceinline__ void register_products(float (&acc)[kHeadDim / 8][4], const float (&p)[kKeyTiles][4],
                                                  const Tile& cols, int key_chunks) {
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
  for (int n = 0; n < kKeyTiles / 2; ++n) {
    if (n >= key_chunks) break;
    uint32_t a[4];
    to_a_fragment<T>(a, p[2 * n], p[2 * n + 1]);
    accumulate_row_block<T>(acc, a, cols, n);
  }
}

// Writes a warp's 16 x 64 f32 accumulators (rows row0.., C fragments of 8 columns) as T to rows < limit.
template <typename T>
__device__ __forceinline__ void store_rows(T* dst, int64_t row_stride, int row0, int limit,
                                           const float (&acc)[kHeadDim / 8][4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + lane / 4 + 8 * half;
    if (row >= limit) continue;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j)
      *reinterpret_cast<uint32_t*>(dst + row * row_stride + 8 * j + 2 * (lane % 4)) =
          pack_pair<T>(acc[j][2 * half], acc[j][2 * half + 1]);
  }
}

// One halving of store_column_sums: lanes with bit 2 * kHalf set keep v[kHalf..2 kHalf), the others v[0..kHalf),
// each adding the partner lane's copy; the kept half moves to v[0..kHalf).
template <int kHalf>
__device__ __forceinline__ void halve_columns(float (&v)[16], int lane) {
  const bool upper = lane & (2 * kHalf);
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float send = upper ? v[i] : v[i + kHalf];
    v[i] = (upper ? v[i + kHalf] : v[i]) + __shfl_xor_sync(0xffffffffu, send, 2 * kHalf);
  }
}

// Writes the column sums of a warp's 16 x 64 f32 accumulators to sums[0..63]: the warp's share of a bias
// gradient; nothing when sums is null. Each lane holds 16 columns (8j + 2t + e) of rows g and g + 8; the eight
// lanes of a t halve their columns three times (with the lane 16, 8, then 4 apart), so 14 shuffles leave lane
// (g, t) with the sums of columns 8g + 2t and 8g + 2t + 1.
__device__ __forceinline__ void store_column_sums(float* sums, const float (&acc)[kHeadDim / 8][4]) {
  if (sums == nullptr) return;
  const int lane = threadIdx.x % 32;
  float v[16];
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
    v[2 * j] = acc[j][0] + acc[j][2];
    v[2 * j + 1] = acc[j][1] + acc[j][3];
  }
  halve_columns<8>(v, lane);
  halve_columns<4>(v, lane);
  halve_columns<2>(v, lane);
  *reinterpret_cast<float2*>(sums + 8 * (lane / 4) + 2 * (lane % 4)) = make_float2(v[0], v[1]);
}

// Bit k % 32 of words[k / 32], the same in every lane of a warp: key k exists (k < K) and the key mask admits it.
template <int kMaxKeys>
struct VisibleKeys {
  uint32_t words[kMaxKeys / 32];
};

// The key mask row of batch element b as bits (one ballot per 32 keys instead of a mask load per score element).
// Every lane of the warp must call it.
template <int kMaxKeys>
__device__ __forceinline__ VisibleKeys<kMaxKeys> visible_keys(const Geometry& g, int b) {
  const int lane = threadIdx.x % 32;
  const bool* mask = g.key_mask == nullptr ? nullptr : g.key_mask + static_cast<int64_t>(b) * g.keys;
  VisibleKeys<kMaxKeys> keys;
#pragma unroll
  for (int w = 0; w < kMaxKeys / 32; ++w) {
    const int col = 32 * w + lane;
    keys.words[w] = __ballot_sync(0xffffffffu, col < g.keys && (mask == nullptr || mask[col]));
  }
  return keys;
}

// In place: scores of this thread's two rows (row0 + g, row0 + g + 8) -> base-2 logits (rounded to T, scaled
// by log2_scale, masked).
template <typename T, int kKeyTiles>
__device__ __forceinline__ void to_logits(float (&s)[kKeyTiles][4], const Geometry& g,
                                          const VisibleKeys<kKeyTiles * 8>& keys, int row0) {
  const int lane = threadIdx.x % 32, t = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + lane / 4 + 8 * half;
    const int causal_limit = g.causal ? row + 1 + g.keys - g.queries : kKeyTiles * 8;
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
      const uint32_t bits = keys.words[j / 4] >> (8 * (j % 4) + 2 * t);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool seen = (bits >> e & 1u) && 8 * j + 2 * t + e < causal_limit;
        float& v = s[j][2 * half + e];
        v = seen ? round_to<T>(v) * g.log2_scale : -INFINITY;
      }
    }
  }
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Drops this thread's probabilities s[j][i] (times 0 or scale) and stores their keep flags. Element (row, col) of
// head block bh has flat index (bh * Q + row) * K + col. When K is a multiple of 8 the four lanes of a quad draw
// the four Philox calls of a row's 32 columns, one each (8 columns), and exchange keep flags by shuffle; otherwise
// each element draws its own call and the quad gathers each 8 columns' flags by shuffle. keep_bits is the head
// block's (Q, mask_bytes(K)) mask (common.cuh's bit order). Every lane of the warp must call it.
template <int kKeyTiles>
__device__ __forceinline__ void apply_dropout(float (&s)[kKeyTiles][4], const Dropout& dropout, const Geometry& g,
                                              int64_t bh, int row0, uint8_t* keep_bits) {
  const int lane = threadIdx.x % 32, t = lane % 4, quad = lane & ~3;
  const int row_bytes = static_cast<int>(mask_bytes(g.keys));
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + lane / 4 + 8 * half;
    const uint64_t row_start = (static_cast<uint64_t>(bh) * g.queries + row) * g.keys;
    if (g.keys % kDrawsPerCall == 0) {
#pragma unroll
      for (int block = 0; block < kKeyTiles / 4; ++block) {
        if (32 * block >= g.keys) break;
        uint32_t flags = 0;
        if (32 * block + 8 * t < g.keys) {
          const uint4 words = dropout_words(dropout.key, row_start / kDrawsPerCall + 4 * block + t);
#pragma unroll
          for (int e = 0; e < kDrawsPerCall; ++e) flags |= uint32_t{draw_of(words, e) >= dropout.threshold} << e;
          if (row < g.queries) keep_bits[row * row_bytes + 4 * block + t] = static_cast<uint8_t>(flags);
        }
#pragma unroll
        for (int tile = 0; tile < 4; ++tile) {
          const uint32_t bits = __shfl_sync(0xffffffffu, flags, quad + tile) >> (2 * t);
          s[4 * block + tile][2 * half] *= (bits & 1u) ? dropout.scale : 0.0f;
          s[4 * block + tile][2 * half + 1] *= (bits & 2u) ? dropout.scale : 0.0f;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) {
        if (8 * j >= g.keys) break;
        uint32_t flags = 0;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * j + 2 * t + e;
          const float multiplier = dropout.multiplier(row_start + col);
          s[j][2 * half + e] *= multiplier;
          if (col < g.keys && multiplier != 0.0f) flags |= 1u << (2 * t + e);
        }
        flags |= __shfl_xor_sync(0xffffffffu, flags, 1);
        flags |= __shfl_xor_sync(0xffffffffu, flags, 2);
        if (t == 0 && row < g.queries) keep_bits[row * row_bytes + j] = static_cast<uint8_t>(flags);
      }
    }
  }
}

// Dropout multipliers (0 or scale) of this thread's elements, m[j][i] for s[j][i], from the keep mask
// apply_dropout stored.
template <int kKeyTiles>
__device__ __forceinline__ void stored_multipliers(float (&m)[kKeyTiles][4], const uint8_t* keep_bits, float scale,
                                                   const Geometry& g, int row0) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  const int row_bytes = static_cast<int>(mask_bytes(g.keys));
#pragma unroll
  for (int j = 0; j < kKeyTiles; ++j) m[j][0] = m[j][1] = m[j][2] = m[j][3] = 0.0f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + lane / 4 + 8 * half;
    if (row >= g.queries) continue;
    const uint8_t* row_bits = keep_bits + static_cast<int64_t>(row) * row_bytes;
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
      if (8 * j >= g.keys) break;
      const uint32_t bits = row_bits[j] >> (2 * t);
      m[j][2 * half] = (bits & 1u) ? scale : 0.0f;
      m[j][2 * half + 1] = (bits & 2u) ? scale : 0.0f;
    }
  }
}

// ---- kernels ----------------------------------------------------------------------------------------------

struct Tensors {
  Strided query, key, value;                 // inputs
  const void *query_bias, *key_bias, *value_bias;  // (H, 64) of T each; key and value ones null unless packed
  Strided out;                               // forward: out (B, Q, H, 64); backward: dout
  float* lse;                                // (B, H, Q)
  Strided dquery, dkey, dvalue;
  Strided dquery_bias, dkey_bias, dvalue_bias;  // f32 partials, a "row" per warp; key and value ones as above
  uint8_t* keep_bits;  // (B, H, Q, mask_bytes(K)): the forward's dropout keep mask, the backward's input; or
                       // null without dropout

  // Head block bh's (Q, mask_bytes(K)) rows of keep_bits.
  __device__ uint8_t* head_keep_bits(const Geometry& g, int bh) const {
    return keep_bits + static_cast<int64_t>(bh) * g.queries * mask_bytes(g.keys);
  }
};

// Waits for this thread's load_rows copies of the q, k and v tiles of head h, adds the projection biases to them
// (see the header), then makes every thread's tiles visible to the block. The biases are read before the wait, so
// that their latency overlaps the copies'. Every thread must call it.
template <typename T>
__device__ __forceinline__ void finish_loads(const Tensors& x, const Geometry& g, int h, const Tile& q_tile,
                                             const Tile& k_tile, const Tile& v_tile) {
  const auto head = [h](const void* bias) {
    return load_chunk_bias(bias == nullptr ? nullptr : static_cast<const T*>(bias) + h * kHeadDim);
  };
  const ChunkBias<T> q_bias = head(x.query_bias), k_bias = head(x.key_bias), v_bias = head(x.value_bias);
  asm volatile("cp.async.wait_all;" ::: "memory");
  add_bias(q_tile, q_bias, g.queries);
  add_bias(k_tile, k_bias, g.keys);
  add_bias(v_tile, v_bias, g.keys);
  __syncthreads();
}

// The f32 partial-sum row of warp `warp` of head block (b, h), or null.
__device__ __forceinline__ float* warp_sums(const Strided& sums, int b, int h, int warp) {
  return sums.data == nullptr ? nullptr : sums.rows<float>(b, h) + warp * sums.row_stride;
}

constexpr int kMaxThreads = kMaxLength / 16 * 32;  // a warp per 16 rows of the longer of queries and keys

__host__ __device__ inline int padded(int length) { return (length + 15) / 16 * 16; }

// Whether the kernels for up to kMaxKeys keys pipeline heads (pipelined_heads). At 64 keys 4 (backward) to 6
// (forward) blocks share an SM and overlap one another's copies and math already; a second stage of tiles would
// halve them, and measured slower. At 128 keys one block fills an SM's registers, and copying its next head during
// the math measured faster both ways (ffi_kernels/NOTES.md).
template <int kMaxKeys>
inline constexpr bool kPipelinesHeads = kMaxKeys == 128;

// Computes head block blockIdx.x; with kPipelined, then blockIdx.x + gridDim.x, ... in turn, copying the next
// one's tiles while the current one computes. start(bh, stage) issues head block bh's copies into stage `stage`
// (0 or 1) of shared memory; finish(bh, stage) waits for them and ends in a block barrier, after which every warp
// is also done with the other stage, so the next head's copies go there; compute(bh, stage) does the math. The
// launcher makes the grid smaller than batch_heads only for a pipelined kernel with two stages of shared memory.
template <bool kPipelined, typename Start, typename Finish, typename Compute>
__device__ __forceinline__ void pipelined_heads(int batch_heads, Start start, Finish finish, Compute compute) {
  start(blockIdx.x, 0);
  if constexpr (kPipelined) {
    int stage = 0;
    for (int64_t bh = blockIdx.x; bh < batch_heads; bh += gridDim.x, stage ^= 1) {
      finish(static_cast<int>(bh), stage);
      const int64_t next = bh + gridDim.x;
      if (next < batch_heads) start(static_cast<int>(next), stage ^ 1);
      compute(static_cast<int>(bh), stage);
    }
  } else {
    finish(blockIdx.x, 0);
    compute(blockIdx.x, 0);
  }
}

// One head's q, k and v tiles: stage `stage` of the block's shared memory.
struct ForwardTiles {
  Tile q, k, v;
};

__host__ __device__ inline size_t forward_shared_bytes(int queries, int keys, int stages) {
  return stages * (padded(queries) + 2 * padded(keys)) * kRowBytes;
}

__device__ __forceinline__ ForwardTiles forward_tiles(uint4* shared, int stage, const Geometry& g) {
  uint8_t* base = reinterpret_cast<uint8_t*>(shared) + stage * forward_shared_bytes(g.queries, g.keys, 1);
  const Tile q{base, kRowBytes};
  const Tile k{q.base + padded(g.queries) * kRowBytes, kRowBytes};
  return {q, k, Tile{k.base + padded(g.keys) * kRowBytes, kRowBytes}};
}

template <typename T>
__device__ __forceinline__ void start_forward_loads(const Tensors& x, const Geometry& g, int bh,
                                                    const ForwardTiles& t) {
  const int b = bh / g.heads, h = bh % g.heads;
  load_rows(t.q, x.query.rows<const T>(b, h), x.query.row_stride, g.queries, padded(g.queries));
  load_rows(t.k, x.key.rows<const T>(b, h), x.key.row_stride, g.keys, padded(g.keys));
  load_rows(t.v, x.value.rows<const T>(b, h), x.value.row_stride, g.keys, padded(g.keys));
}

// out and lse of head block bh from its loaded tiles.
template <typename T, int kMaxKeys>
__device__ __forceinline__ void forward_head(const Tensors& x, const Geometry& g, const DropoutParams& dropout_params,
                                             int bh, const ForwardTiles& t) {
  constexpr int kKeyTiles = kMaxKeys / 8;
  const int b = bh / g.heads, h = bh % g.heads, k_pad = padded(g.keys);
  const int lane = threadIdx.x % 32, row0 = 16 * (threadIdx.x / 32);

  float s[kKeyTiles][4];
  row_products<T>(s, t.q, row0, t.k, k_pad / 16);
  to_logits<T>(s, g, visible_keys<kMaxKeys>(g, b), row0);
  float lse[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float row_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) row_max = fmaxf(row_max, fmaxf(s[j][2 * half], s[j][2 * half + 1]));
    row_max = finite_or_zero(quad_max(row_max));
    float total = 0.0f;
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[j][2 * half + e] = exp2_approx(s[j][2 * half + e] - row_max);
        total += s[j][2 * half + e];
      }
    }
    total = quad_sum(total);
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    lse[half] = total > 0.0f ? (row_max + log2f(total)) * kLn2 : INFINITY;
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
      s[j][2 * half] *= inverse;
      s[j][2 * half + 1] *= inverse;
    }
  }
  if (dropout_params.seed != nullptr)
    apply_dropout(s, Dropout::load(dropout_params), g, bh, row0, x.head_keep_bits(g, bh));

  float o[kHeadDim / 8][4];
  register_products<T>(o, s, t.v, k_pad / 16);
  T* out = x.out.rows<T>(b, h);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + lane / 4 + 8 * half;
    if (row >= g.queries) continue;
    if (lane % 4 == 0) x.lse[static_cast<int64_t>(bh) * g.queries + row] = lse[half];
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j)
      *reinterpret_cast<uint32_t*>(out + row * x.out.row_stride + 8 * j + 2 * (lane % 4)) =
          pack_pair<T>(o[j][2 * half], o[j][2 * half + 1]);
  }
}

// kMaxKeys (64 or 128, at least K) sizes the register arrays. A warp per 16 queries; the block strides over the
// head blocks (see pipelined_heads).
template <typename T, int kMaxKeys>
__global__ void __launch_bounds__(kMaxThreads, kMaxKeys == 64 ? 3 : 1)
    attention_fwd_kernel(Tensors x, Geometry g, DropoutParams dropout_params, int batch_heads) {
  extern __shared__ uint4 shared[];
  pipelined_heads<kPipelinesHeads<kMaxKeys>>(
      batch_heads, [&](int bh, int stage) { start_forward_loads<T>(x, g, bh, forward_tiles(shared, stage, g)); },
      [&](int bh, int stage) {
        const ForwardTiles t = forward_tiles(shared, stage, g);
        finish_loads<T>(x, g, bh % g.heads, t.q, t.k, t.v);
      },
      [&](int bh, int stage) { forward_head<T, kMaxKeys>(x, g, dropout_params, bh, forward_tiles(shared, stage, g)); });
}

// The block's probability tiles, written by phase 1 and read by phase 2 of one head: kept and dscores (queries x
// kMaxKeys each), then the stages of input tiles, one head's q, dout, k and v each.
struct BackwardTiles {
  Tile q, dout, k, v, kept, dscores;
};

inline size_t backward_shared_bytes(int queries, int keys, int max_keys, int stages) {
  return 2 * padded(queries) * max_keys * 2 + stages * (2 * padded(queries) + 2 * padded(keys)) * kRowBytes;
}

template <int kMaxKeys>
__device__ __forceinline__ BackwardTiles backward_tiles(uint4* shared, int stage, const Geometry& g) {
  const int q_pad = padded(g.queries), k_pad = padded(g.keys);
  const Tile kept{reinterpret_cast<uint8_t*>(shared), kMaxKeys * 2};
  const Tile dscores{kept.base + q_pad * kMaxKeys * 2, kMaxKeys * 2};
  const Tile q{dscores.base + q_pad * kMaxKeys * 2 + stage * (2 * q_pad + 2 * k_pad) * kRowBytes, kRowBytes};
  const Tile dout{q.base + q_pad * kRowBytes, kRowBytes};
  const Tile k{dout.base + q_pad * kRowBytes, kRowBytes};
  return {q, dout, k, Tile{k.base + k_pad * kRowBytes, kRowBytes}, kept, dscores};
}

template <typename T>
__device__ __forceinline__ void start_backward_loads(const Tensors& x, const Geometry& g, int bh,
                                                     const BackwardTiles& t) {
  const int b = bh / g.heads, h = bh % g.heads, q_pad = padded(g.queries), k_pad = padded(g.keys);
  load_rows(t.q, x.query.rows<const T>(b, h), x.query.row_stride, g.queries, q_pad);
  load_rows(t.dout, x.out.rows<const T>(b, h), x.out.row_stride, g.queries, q_pad);
  load_rows(t.k, x.key.rows<const T>(b, h), x.key.row_stride, g.keys, k_pad);
  load_rows(t.v, x.value.rows<const T>(b, h), x.value.row_stride, g.keys, k_pad);
}

// acc += A^T B over the padded query rows, A = rows col0.. of `scores` (queries x keys), B = `rows` (queries x 64).
template <typename T>
__device__ __forceinline__ void transposed_products(float (&acc)[kHeadDim / 8][4], const Tile& scores, int col0,
                                                    const Tile& rows, int row_chunks) {
  for (int c = 0; c < row_chunks; ++c) {
    uint32_t a[4];
    load_a_transposed(a, scores, col0, c);
    accumulate_row_block<T>(acc, a, rows, c);
  }
}

// dq, dk, dv and the bias-gradient partials of head block bh from its loaded tiles.
template <typename T, int kMaxKeys>
__device__ __forceinline__ void backward_head(const Tensors& x, const Geometry& g,
                                              const DropoutParams& dropout_params, int bh, const BackwardTiles& t) {
  constexpr int kKeyTiles = kMaxKeys / 8;
  const int b = bh / g.heads, h = bh % g.heads;
  const int q_pad = padded(g.queries), k_pad = padded(g.keys);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row0 = 16 * warp;

  // Phase 1, a warp per 16 query rows: probabilities, dscores, dq; kept and dscores go to shared memory.
  if (row0 < q_pad) {
    float p[kKeyTiles][4], dp[kKeyTiles][4];
    row_products<T>(p, t.q, row0, t.k, k_pad / 16);
    to_logits<T>(p, g, visible_keys<kMaxKeys>(g, b), row0);
    row_products<T>(dp, t.dout, row0, t.v, k_pad / 16);
    float m[kKeyTiles][4];
    if (x.keep_bits != nullptr) {
      stored_multipliers(m, x.head_keep_bits(g, bh), dropout_params.scale, g, row0);
    } else {
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) m[j][0] = m[j][1] = m[j][2] = m[j][3] = 1.0f;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + lane / 4 + 8 * half;
      const float lse2 = row < g.queries ? x.lse[static_cast<int64_t>(bh) * g.queries + row] * kLog2e : INFINITY;
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 2 * half + e;
          p[j][i] = exp2_approx(p[j][i] - lse2);
          dp[j][i] = round_to<T>(dp[j][i]) * m[j][i];
          dot += dp[j][i] * p[j][i];
        }
      }
      dot = quad_sum(dot);
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) {
        if (j >= k_pad / 8) break;
        const int i = 2 * half;
        store_pair<T>(t.kept, row, j, p[j][i] * m[j][i], p[j][i + 1] * m[j][i + 1]);
        dp[j][i] = g.logit_scale * p[j][i] * (dp[j][i] - dot);
        dp[j][i + 1] = g.logit_scale * p[j][i + 1] * (dp[j][i + 1] - dot);
        store_pair<T>(t.dscores, row, j, dp[j][i], dp[j][i + 1]);
      }
    }
    float dq[kHeadDim / 8][4];
    register_products<T>(dq, dp, t.k, k_pad / 16);
    store_rows(x.dquery.rows<T>(b, h), x.dquery.row_stride, row0, g.queries, dq);
    store_column_sums(warp_sums(x.dquery_bias, b, h, warp), dq);
  }
  __syncthreads();

  // Phase 2, a warp per 16 key rows: dv = kept^T dout, dk = dscores^T q.
  if (row0 < k_pad) {
    float acc[kHeadDim / 8][4] = {};
    transposed_products<T>(acc, t.kept, row0, t.dout, q_pad / 16);
    store_rows(x.dvalue.rows<T>(b, h), x.dvalue.row_stride, row0, g.keys, acc);
    store_column_sums(warp_sums(x.dvalue_bias, b, h, warp), acc);
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    transposed_products<T>(acc, t.dscores, row0, t.q, q_pad / 16);
    store_rows(x.dkey.rows<T>(b, h), x.dkey.row_stride, row0, g.keys, acc);
    store_column_sums(warp_sums(x.dkey_bias, b, h, warp), acc);
  }
}

// A warp per 16 rows of the longer of queries and keys; the block strides over the head blocks (see
// pipelined_heads).
template <typename T, int kMaxKeys>
__global__ void __launch_bounds__(kMaxThreads, kMaxKeys == 64 ? 2 : 1)
    attention_bwd_kernel(Tensors x, Geometry g, DropoutParams dropout_params, int batch_heads) {
  extern __shared__ uint4 shared[];
  pipelined_heads<kPipelinesHeads<kMaxKeys>>(
      batch_heads,
      [&](int bh, int stage) { start_backward_loads<T>(x, g, bh, backward_tiles<kMaxKeys>(shared, stage, g)); },
      [&](int bh, int stage) {
        const BackwardTiles t = backward_tiles<kMaxKeys>(shared, stage, g);
        finish_loads<T>(x, g, bh % g.heads, t.q, t.k, t.v);
      },
      [&](int bh, int stage) {
        backward_head<T, kMaxKeys>(x, g, dropout_params, bh, backward_tiles<kMaxKeys>(shared, stage, g));
      });
}

// ---- handlers ---------------------------------------------------------------------------------------------

// The dims of a (B, L, P, H, 64) source.
struct Source {
  int64_t batch, length, parts, heads;
};

ffi::Error describe_source(std::string_view name, const ffi::AnyBuffer& buffer, Source& out) {
  const auto dims = buffer.dimensions();
  LS_RETURN_IF_ERROR(require(dims.size() == 5 && dims[4] == kHeadDim,
                             std::string(name) + " must have shape (B, L, parts, heads, 64), got " +
                                 shape_string(dims)));
  LS_RETURN_IF_ERROR(require(dims[1] >= 1 && dims[1] <= kMaxLength,
                             std::string(name) + ": the fused attention takes 1 to 128 positions, got " +
                                 shape_string(dims)));
  out = {dims[0], dims[1], dims[2], dims[3]};
  return ffi::Error::Success();
}

// Part `part` of a source of 16-bit elements.
Strided part_of(void* data, const Source& s, int64_t part) {
  const int64_t row = s.parts * s.heads * kHeadDim;
  return {static_cast<uint16_t*>(data) + part * s.heads * kHeadDim, s.length * row, row};
}

ffi::Error check_tensor(std::string_view name, const ffi::AnyBuffer& buffer, ffi::DataType dtype,
                        std::initializer_list<int64_t> dims) {
  const auto actual = buffer.dimensions();
  const bool ok = buffer.element_type() == dtype && actual.size() == dims.size() &&
                  std::equal(dims.begin(), dims.end(), actual.begin());
  std::string expected;
  for (int64_t dim : dims) expected += (expected.empty() ? "(" : ", ") + std::to_string(dim);
  return require(ok, std::string(name) + " must be " + dtype_name(dtype) + expected + "), got " +
                         dtype_name(buffer.element_type()) + shape_string(actual));
}

// Part `part` of a (P, H, 64) bias of 16-bit elements.
const void* bias_part(const ffi::AnyBuffer& bias, const Source& s, int64_t part) {
  return static_cast<const uint16_t*>(bias.untyped_data()) + part * s.heads * kHeadDim;
}

// Part `part` of f32 bias-gradient partials (B, G, P, H, 64): "row" g of head block (b, h) is warp g's sums.
Strided partials_part(void* data, const Source& s, int64_t part) {
  const int64_t row = s.parts * s.heads * kHeadDim;
  return {static_cast<float*>(data) + part * s.heads * kHeadDim, (s.length + 15) / 16 * row, row};
}

struct Problem {
  Source query, key_value;
  Geometry geometry;
  int64_t batch_heads;
};

ffi::Error describe_problem(const ffi::AnyBuffer& query_source, const ffi::AnyBuffer& key_value_source,
                            const ffi::AnyBuffer& query_bias, const std::optional<ffi::AnyBuffer>& key_mask,
                            bool causal, float logit_scale, Problem& out) {
  LS_RETURN_IF_ERROR(describe_source("query_source", query_source, out.query));
  LS_RETURN_IF_ERROR(describe_source("key_value_source", key_value_source, out.key_value));
  const Source& q = out.query;
  const Source& kv = out.key_value;
  LS_RETURN_IF_ERROR(require(q.parts == 1 || q.parts == 3,
                             "query_source must have 1 part (a query) or 3 (a packed qkv), got " +
                                 shape_string(query_source.dimensions())));
  const bool packed = q.parts == 3;
  LS_RETURN_IF_ERROR(require(packed ? same_dims(key_value_source.dimensions(), query_source.dimensions())
                                    : kv.parts == 2 && kv.batch == q.batch && kv.heads == q.heads,
                             "key_value_source " + shape_string(key_value_source.dimensions()) +
                                 " does not match query_source " + shape_string(query_source.dimensions()) +
                                 ": expected (B, K, 2, heads, 64), or the same packed qkv"));
  const ffi::DataType dtype = query_source.element_type();
  LS_RETURN_IF_ERROR(require(dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16,
                             std::string("the fused attention takes bfloat16 or float16, got ") + dtype_name(dtype)));
  LS_RETURN_IF_ERROR(require(key_value_source.element_type() == dtype,
                             "key_value_source must have the dtype of query_source"));
  LS_RETURN_IF_ERROR(check_tensor("query_bias", query_bias, dtype, {q.parts, q.heads, kHeadDim}));
  LS_RETURN_IF_ERROR(require(!causal || q.length <= kv.length, "causal attention needs queries <= keys"));
  if (key_mask) {
    const auto dims = key_mask->dimensions();
    LS_RETURN_IF_ERROR(require(key_mask->element_type() == ffi::DataType::PRED && dims.size() == 2 &&
                                   dims[0] == q.batch && dims[1] == kv.length,
                               "key_mask must be bool of shape (B, K) = (" + std::to_string(q.batch) + ", " +
                                   std::to_string(kv.length) + "), got " + dtype_name(key_mask->element_type()) +
                                   shape_string(dims)));
  }
  out.batch_heads = q.batch * q.heads;
  LS_RETURN_IF_ERROR(require(out.batch_heads <= 0x7fffffff, "batch * heads must be below 2**31"));
  out.geometry = {static_cast<int>(q.heads), static_cast<int>(q.length), static_cast<int>(kv.length), causal,
                  logit_scale, logit_scale * kLog2e,
                  key_mask ? static_cast<const bool*>(key_mask->untyped_data()) : nullptr};
  return ffi::Error::Success();
}

// The seed, for dropout over every (batch, head, query, key) element.
ffi::Error check_dropout_seed(const ffi::Buffer<ffi::U32>& seed, const DropoutParams& params, const Problem& p) {
  return require_dropout_seed(seed, params,
                              static_cast<uint64_t>(p.batch_heads) * p.geometry.queries * p.geometry.keys);
}

// The dropout keep mask the forward writes and the backward reads: (B, H, Q, mask_bytes(K)) with dropout,
// empty without.
ffi::Error check_keep_bits(const ffi::Buffer<ffi::U8>& keep_bits, bool dropout, const Problem& p) {
  const std::vector<int64_t> expected =
      dropout ? std::vector<int64_t>{p.query.batch, p.query.heads, p.query.length, mask_bytes(p.geometry.keys)}
              : std::vector<int64_t>{0};
  return require(dropout ? same_dims(keep_bits.dimensions(), expected) : keep_bits.element_count() == 0,
                 "keep_bits must have shape " + shape_string(expected) + (dropout ? "" : " (no dropout)") + ", got " +
                     shape_string(keep_bits.dimensions()));
}

ffi::Error check_aligned(std::initializer_list<const void*> buffers) {
  for (const void* buffer : buffers)
    LS_RETURN_IF_ERROR(
        require(buffer == nullptr || is_aligned(buffer, 16), "attention buffers must be 16-byte aligned"));
  return ffi::Error::Success();
}

// Launches kernel<T, 64 or 128>: the register arrays sized for the keys.
template <typename T, template <typename, int> class Launch>
ffi::Error launch_sized(cudaStream_t stream, const Problem& p, const Tensors& x, const DropoutParams& dropout) {
  if (p.geometry.keys <= 64) return Launch<T, 64>::run(stream, p, x, dropout);
  return Launch<T, 128>::run(stream, p, x, dropout);
}

// Launches `kernel` over the problem's head blocks, with shared_bytes(stages) of shared memory. A pipelined kernel
// gets two stages of tiles where the device admits them, and a grid of what fits on the GPU at once, whose blocks
// pipeline their heads (pipelined_heads); otherwise a block per head block.
template <typename Kernel, typename SharedBytes>
ffi::Error launch_kernel(Kernel kernel, const char* name, cudaStream_t stream, const Problem& p, const Tensors& x,
                         const DropoutParams& dropout, int warps, bool pipelined, SharedBytes shared_bytes) {
  int stages = 1;
  if (pipelined) {
    int device = 0, shared_limit = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
      return launch_error(name);
    if (shared_bytes(2) <= static_cast<size_t>(shared_limit)) stages = 2;
  }
  const size_t bytes = shared_bytes(stages);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)) != cudaSuccess)
    return launch_error(name);
  int64_t blocks = p.batch_heads;
  if (stages == 2) {
    int resident = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, 32 * warps, bytes) != cudaSuccess)
      return launch_error(name);
    LS_RETURN_IF_ERROR(stride_grid(p.batch_heads, 1, std::max(resident, 1), blocks));
  }
  kernel<<<static_cast<unsigned>(blocks), 32 * warps, bytes, stream>>>(x, p.geometry, dropout,
                                                                       static_cast<int>(p.batch_heads));
  return launch_error(name);
}

template <typename T, int kMaxKeys>
struct LaunchForward {
  static ffi::Error run(cudaStream_t stream, const Problem& p, const Tensors& x, const DropoutParams& dropout) {
    const Geometry& g = p.geometry;
    return launch_kernel(attention_fwd_kernel<T, kMaxKeys>, "attention_fwd_kernel", stream, p, x, dropout,
                         padded(g.queries) / 16, kPipelinesHeads<kMaxKeys>,
                         [&](int stages) { return forward_shared_bytes(g.queries, g.keys, stages); });
  }
};

template <typename T, int kMaxKeys>
struct LaunchBackward {
  static ffi::Error run(cudaStream_t stream, const Problem& p, const Tensors& x, const DropoutParams& dropout) {
    const Geometry& g = p.geometry;
    return launch_kernel(attention_bwd_kernel<T, kMaxKeys>, "attention_bwd_kernel", stream, p, x, dropout,
                         padded(std::max(g.queries, g.keys)) / 16, kPipelinesHeads<kMaxKeys>,
                         [&](int stages) { return backward_shared_bytes(g.queries, g.keys, kMaxKeys, stages); });
  }
};

// bf16 or f16 (describe_problem admits nothing else).
template <template <typename, int> class Launch>
ffi::Error dispatch_half(ffi::DataType dtype, cudaStream_t stream, const Problem& p, const Tensors& x,
                         const DropoutParams& dropout) {
  if (dtype == ffi::DataType::BF16) return launch_sized<__nv_bfloat16, Launch>(stream, p, x, dropout);
  return launch_sized<__half, Launch>(stream, p, x, dropout);
}

ffi::Error attention_fwd(cudaStream_t stream, ffi::AnyBuffer query_source, ffi::AnyBuffer key_value_source,
                         ffi::AnyBuffer query_bias, ffi::Buffer<ffi::U32> seed, std::optional<ffi::AnyBuffer> key_mask,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                         ffi::Result<ffi::Buffer<ffi::U8>> keep_bits, bool causal, float logit_scale,
                         uint32_t threshold, float scale) {
  Problem p;
  LS_RETURN_IF_ERROR(describe_problem(query_source, key_value_source, query_bias, key_mask, causal, logit_scale, p));
  const DropoutParams dropout{seed.typed_data(), threshold, scale};
  LS_RETURN_IF_ERROR(check_dropout_seed(seed, dropout, p));
  LS_RETURN_IF_ERROR(check_keep_bits(*keep_bits, dropout.enabled(), p));
  const ffi::DataType dtype = query_source.element_type();
  LS_RETURN_IF_ERROR(check_tensor("out", *out, dtype, {p.query.batch, p.query.length, p.query.heads, kHeadDim}));
  LS_RETURN_IF_ERROR(check_tensor("lse", *lse, ffi::DataType::F32, {p.query.batch, p.query.heads, p.query.length}));
  LS_RETURN_IF_ERROR(check_aligned({query_source.untyped_data(), key_value_source.untyped_data(),
                                    query_bias.untyped_data(), out->untyped_data()}));
  if (p.batch_heads == 0) return ffi::Error::Success();
  const Source& q = p.query;
  const Source& kv = p.key_value;
  const bool packed = q.parts == 3;
  const int64_t out_row = q.heads * kHeadDim;
  Tensors x{part_of(query_source.untyped_data(), q, 0),
            part_of(key_value_source.untyped_data(), kv, kv.parts - 2),
            part_of(key_value_source.untyped_data(), kv, kv.parts - 1),
            bias_part(query_bias, q, 0),
            packed ? bias_part(query_bias, q, 1) : nullptr,
            packed ? bias_part(query_bias, q, 2) : nullptr,
            {out->untyped_data(), q.length * out_row, out_row},
            static_cast<float*>(lse->untyped_data()),
            {},
            {},
            {},
            {},
            {},
            {},
            dropout.enabled() ? keep_bits->typed_data() : nullptr};
  const DropoutParams kernel_dropout{dropout.enabled() ? dropout.seed : nullptr, threshold, scale};
  return dispatch_half<LaunchForward>(dtype, stream, p, x, kernel_dropout);
}

ffi::Error attention_bwd(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer query_source,
                         ffi::AnyBuffer key_value_source, ffi::AnyBuffer query_bias, ffi::AnyBuffer lse,
                         ffi::Buffer<ffi::U8> keep_bits, std::optional<ffi::AnyBuffer> key_mask,
                         ffi::Result<ffi::AnyBuffer> d_query_source, ffi::Result<ffi::AnyBuffer> d_query_bias_partials,
                         std::optional<ffi::Result<ffi::AnyBuffer>> d_key_value_source, bool causal,
                         float logit_scale, uint32_t threshold, float scale) {
  Problem p;
  LS_RETURN_IF_ERROR(describe_problem(query_source, key_value_source, query_bias, key_mask, causal, logit_scale, p));
  // The backward draws nothing: the keep mask comes from the forward; the dropout attributes say whether there is one.
  const DropoutParams dropout{nullptr, threshold, scale};
  LS_RETURN_IF_ERROR(check_keep_bits(keep_bits, dropout.enabled(), p));
  const ffi::DataType dtype = query_source.element_type();
  const Source& q = p.query;
  LS_RETURN_IF_ERROR(check_tensor("dout", dout, dtype, {q.batch, q.length, q.heads, kHeadDim}));
  LS_RETURN_IF_ERROR(check_tensor("lse", lse, ffi::DataType::F32, {q.batch, q.heads, q.length}));
  const bool packed = q.parts == 3;
  LS_RETURN_IF_ERROR(require(packed != d_key_value_source.has_value(),
                             packed ? "a packed qkv takes one gradient output (d_query_source)"
                                    : "separate query and key_value sources take two gradient outputs"));
  LS_RETURN_IF_ERROR(require_same_shape("d_query_source", *d_query_source, "query_source", query_source));
  LS_RETURN_IF_ERROR(check_tensor("d_query_bias_partials", *d_query_bias_partials, ffi::DataType::F32,
                                  {q.batch, (q.length + 15) / 16, q.parts, q.heads, kHeadDim}));
  if (!packed)
    LS_RETURN_IF_ERROR(require_same_shape("d_key_value_source", **d_key_value_source, "key_value_source",
                                          key_value_source));
  void* dkv_data = packed ? d_query_source->untyped_data() : (*d_key_value_source)->untyped_data();
  LS_RETURN_IF_ERROR(check_aligned({dout.untyped_data(), query_source.untyped_data(), key_value_source.untyped_data(),
                                    query_bias.untyped_data(), d_query_source->untyped_data(), dkv_data}));
  if (p.batch_heads == 0) return ffi::Error::Success();
  const Source& kv = p.key_value;
  const int64_t dout_row = q.heads * kHeadDim;
  void* bias_sums = d_query_bias_partials->untyped_data();
  Tensors x{part_of(query_source.untyped_data(), q, 0),
            part_of(key_value_source.untyped_data(), kv, kv.parts - 2),
            part_of(key_value_source.untyped_data(), kv, kv.parts - 1),
            bias_part(query_bias, q, 0),
            packed ? bias_part(query_bias, q, 1) : nullptr,
            packed ? bias_part(query_bias, q, 2) : nullptr,
            {dout.untyped_data(), q.length * dout_row, dout_row},
            static_cast<float*>(lse.untyped_data()),
            part_of(d_query_source->untyped_data(), q, 0),
            part_of(dkv_data, kv, kv.parts - 2),
            part_of(dkv_data, kv, kv.parts - 1),
            partials_part(bias_sums, q, 0),
            packed ? partials_part(bias_sums, q, 1) : Strided{},
            packed ? partials_part(bias_sums, q, 2) : Strided{},
            dropout.enabled() ? keep_bits.typed_data() : nullptr};
  return dispatch_half<LaunchBackward>(dtype, stream, p, x, dropout);
}

}  // namespace

LS_FFI_TARGET(ls_attention_fwd, attention_fwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .OptionalArg<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::Buffer<ffi::U8>>()
                  .Attr<bool>("causal")
                  .Attr<float>("logit_scale")
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

LS_FFI_TARGET(ls_attention_bwd, attention_bwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U8>>()
                  .OptionalArg<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .OptionalRet<ffi::AnyBuffer>()
                  .Attr<bool>("causal")
                  .Attr<float>("logit_scale")
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

}  // namespace ls
