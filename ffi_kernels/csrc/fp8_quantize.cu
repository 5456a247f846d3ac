// FP8 quantization with delayed scaling for FP8 matrix products: one pass over x writes its FP8 values in both
// layouts and the next amax history.
//
//   s             = 1 / (fp8_max / max(history))   (1 / (1 / scale) when that maximum is 0, inf or NaN)
//   q             = fp8(clip(x * (1 / round_T(s)), -fp8_max, fp8_max))   (rows, cols), in f32, round to nearest even
//   q_t           = q transposed                                   (cols, rows)
//   next_history  = history rolled left by one, max |x| in front   f32[H], NaN in front if any x is NaN
//
// as Flax's FP8 ops compute them (ls_jax/ops/quantize.py); T is x's dtype, to which s is rounded first.
// cuBLASLt's FP8 GEMMs on Hopper take both operands with the contracted axis innermost, so a weight gradient
// (contracting the rows) needs the transposed copy; writing it from the same tile saves a second pass over x.
// The blocks loop over the tiles (enough of them to fill the SMs); each computes s from the history first (4 KB at
// Flax's 1,024 steps, read from L2) rather than waiting for another kernel to, and the last block to finish writes
// s and the next history over the previous ones once every block's amax is in.
//
// Target ls_fp8_quantize(x, history: f32[H], scale: f32[1]) -> (q, q_t, s: f32[1], next_history: f32[H],
// scratch: u32[2]), s aliased to scale and next_history to history (updated in place, so a step that donates its
// scaling state copies none of it); q's dtype (float8_e4m3fn or float8_e5m2) picks the format. The scratch holds
// the amax's bits and the count of finished blocks; the handler zeroes it before the launch.
#include <cuda_fp8.h>

#include "common.cuh"

namespace ls {
namespace {

constexpr int kTile = 64;                 // a block's tile: kTile x kTile elements of x
constexpr int kChunk = 16;                // elements per thread per pass: one 16-byte vector of FP8
constexpr int kThreads = kTile * kTile / kChunk;
constexpr int kChunksPerRow = kTile / kChunk;
constexpr int kPitch = kTile + 4;         // shared-memory row pitch in bytes, off the 32-bank period
constexpr int kBlocksPerSm = 8;           // resident blocks of kThreads per SM in the grid-stride loop

template <__nv_fp8_interpretation_t Format>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, Format);  // saturates like the clip, keeps NaN
}

// The larger of a running maximum and v, NaN once any v is NaN (fmaxf would drop it), as jnp.max gives.
__device__ __forceinline__ float max_with(float running, float v) { return (v > running || isnan(v)) ? v : running; }

// The larger of a running |x| maximum and |v|, NaN once any v is NaN.
__device__ __forceinline__ float amax_with(float amax, float v) { return max_with(amax, fabsf(v)); }

// max_with over the block's threads; every thread gets the result. `partials` holds a value per warp.
__device__ float block_max(float value, float* partials) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = max_with(value, __shfl_xor_sync(0xffffffffu, value, offset));
  if (threadIdx.x % 32 == 0) partials[threadIdx.x / 32] = value;
  __syncthreads();
  value = partials[0];
  for (int w = 1; w < kThreads / 32; ++w) value = max_with(value, partials[w]);
  __syncthreads();  // partials may be reused
  return value;
}

// This step's scale from the history of the steps before, as Flax's compute_scale (margin 0), division for
// division: IEEE-rounded divisions give its bits.
__device__ float delayed_scale(const float* history, int64_t length, float previous, float fp8_max,
                               float* partials) {
  float amax = -INFINITY;
  for (int64_t i = threadIdx.x; i < length; i += kThreads) amax = max_with(amax, history[i]);
  amax = block_max(amax, partials);
  float factor = fp8_max / amax;
  if (!(amax > 0.0f) || !isfinite(amax)) factor = 1.0f / previous;
  return 1.0f / factor;
}

// The amax history and the scale, read by every block and overwritten by the last one to finish.
struct ScalingState {
  float* history;
  int64_t length;
  float* scale;
};

// jnp.roll(history, -1) with [0] = amax, in place, by the block's threads: each pass reads the kThreads values its
// threads will write next (one past each, the first element kept for the end) before any is overwritten.
__device__ void roll_in_amax(float* history, int64_t length, float amax) {
  const float first = history[0];
  for (int64_t base = 0; base < length; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    const float next = i + 1 < length ? history[i + 1] : first;
    __syncthreads();  // every thread of this pass has read before any writes
    if (i < length) history[i] = i == 0 ? amax : next;
  }
}

// One kTile x kTile tile at (row0, col0): q from the rows of x, q_t from the tile staged in shared memory; the
// running |x| maximum of this thread in `amax`. Every thread of the block calls it (it holds a barrier).
template <typename T, __nv_fp8_interpretation_t Format>
__device__ void quantize_tile(const T* __restrict__ x, uint8_t* __restrict__ q, uint8_t* __restrict__ q_t,
                              uint8_t (*tile)[kPitch], int64_t row0, int64_t col0, int64_t rows, int64_t cols,
                              float inverse, int t_store, bool vector_cols, float& amax) {
  // Rows of the tile: each thread quantizes kChunk consecutive elements of one row of x.
  {
    const int r = threadIdx.x / kChunksPerRow, c = (threadIdx.x % kChunksPerRow) * kChunk;
    const int64_t row = row0 + r, col = col0 + c;
    uint8_t out[kChunk];
    if (row < rows && col + kChunk <= cols && vector_cols) {
      float v[kChunk];
      load_floats<kChunk>(x + row * cols + col, v);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        amax = amax_with(amax, v[i]);
        out[i] = to_fp8<Format>(v[i] * inverse);
      }
      uint4 packed;
      memcpy(&packed, out, kChunk);
      *reinterpret_cast<uint4*>(q + row * cols + col) = packed;
    } else {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        out[i] = 0;
        if (row < rows && col + i < cols) {
          const float v = to_float(x[row * cols + col + i]);
          amax = amax_with(amax, v);
          out[i] = to_fp8<Format>(v * inverse);
          q[row * cols + col + i] = out[i];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kChunk; ++i) tile[r][c + i] = out[i];
  }
  __syncthreads();

  // Columns of the tile: each thread writes kChunk consecutive elements of one row of q_t (a column of x).
  const int c = threadIdx.x / kChunksPerRow, r = (threadIdx.x % kChunksPerRow) * kChunk;
  const int64_t col = col0 + c, row = row0 + r;
  if (col < cols) {
    uint8_t out[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) out[i] = tile[r + i][c];
    uint8_t* dst = q_t + col * rows + row;
    if (t_store == 16) {  // rows % 16 == 0: a chunk is either whole or past the end
      if (row < rows) {
        uint4 packed;
        memcpy(&packed, out, 16);
        *reinterpret_cast<uint4*>(dst) = packed;
      }
    } else if (t_store == 8) {  // rows % 8 == 0: each half of a chunk is either whole or past the end
#pragma unroll
      for (int half = 0; half < kChunk; half += 8) {
        if (row + half < rows) {
          uint2 packed;
          memcpy(&packed, out + half, 8);
          *reinterpret_cast<uint2*>(dst + half) = packed;
        }
      }
    } else {
      for (int i = 0; i < kChunk && row + i < rows; ++i) dst[i] = out[i];
    }
  }
}

// A grid-stride loop over the tiles: each block computes the scale once, however many tiles it quantizes.
template <typename T, __nv_fp8_interpretation_t Format>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    quantize_kernel(const T* __restrict__ x, ScalingState state, uint8_t* __restrict__ q, uint8_t* __restrict__ q_t,
                    unsigned int* __restrict__ scratch, int64_t rows, int64_t cols, int t_store,
                    bool vector_cols) {
  __shared__ uint8_t tile[kTile][kPitch];
  __shared__ float partials[kThreads / 32];
  __shared__ bool last_block;
  __shared__ float grid_amax;
  __shared__ float scale;  // kept for the last block's write, out of the loop's registers
  const float fp8_max = Format == __NV_E4M3 ? 448.0f : 57344.0f;
  const float s = delayed_scale(state.history, state.length, *state.scale, fp8_max, partials);
  if (threadIdx.x == 0) scale = s;
  const float inverse = 1.0f / round_to<T>(s);
  float amax = 0.0f;
  const int64_t col_tiles = (cols + kTile - 1) / kTile, tiles = (rows + kTile - 1) / kTile * col_tiles;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    quantize_tile<T, Format>(x, q, q_t, tile, t / col_tiles * kTile, t % col_tiles * kTile, rows, cols, inverse,
                             t_store, vector_cols, amax);
    __syncthreads();  // this tile's shared bytes are read before the next tile's are written
  }

  // The block's amax into the grid's (a non-negative float, NaN included, orders as its bits); the last block to
  // finish, when every block has read the history and the previous scale, writes s and the next history.
  amax = block_max(amax, partials);
  if (threadIdx.x == 0) {
    atomicMax(&scratch[0], __float_as_uint(amax));
    __threadfence();  // this block's amax is visible before it counts as finished
    last_block = atomicAdd(&scratch[1], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;
  if (threadIdx.x == 0) {
    __threadfence();
    grid_amax = __uint_as_float(atomicOr(&scratch[0], 0u));  // every block's amax is in
  }
  __syncthreads();
  if (threadIdx.x == 0) *state.scale = scale;
  roll_in_amax(state.history, state.length, grid_amax);
}

template <typename T, __nv_fp8_interpretation_t Format>
ffi::Error launch(cudaStream_t stream, const T* x, ScalingState state, uint8_t* q, uint8_t* q_t,
                  unsigned int* scratch, int64_t rows, int64_t cols) {
  const cudaError_t zeroed = cudaMemsetAsync(scratch, 0, 2 * sizeof(unsigned int), stream);
  if (zeroed != cudaSuccess)
    return ffi::Error::Internal(std::string("zeroing the scratch failed: ") + cudaGetErrorString(zeroed));
  // Enough blocks to fill every SM (at least one: an empty x still gets its scale and next history).
  int64_t blocks = 0;
  LS_RETURN_IF_ERROR(stride_grid(ceil_div(rows, kTile) * ceil_div(cols, kTile), 1, kBlocksPerSm, blocks));
  // 16-byte accesses: a row chunk of x (kChunk elements), of q and of q_t start at multiples of 16 bytes. A q_t
  // row whose length is a multiple of 8, not 16 (8,184 tokens), is stored 8 bytes at a time, else byte by byte.
  const bool vector_cols = cols % kChunk == 0 && is_aligned(x, 16) && is_aligned(q, 16);
  const int t_store = rows % 16 == 0 && is_aligned(q_t, 16) ? 16 : rows % 8 == 0 && is_aligned(q_t, 8) ? 8 : 1;
  quantize_kernel<T, Format><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      x, state, q, q_t, scratch, rows, cols, t_store, vector_cols);
  return launch_error("quantize_kernel");
}

ffi::Error fp8_quantize(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> history,
                        ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> q_t,
                        ffi::Result<ffi::Buffer<ffi::F32>> scale_out, ffi::Result<ffi::Buffer<ffi::F32>> next_history,
                        ffi::Result<ffi::Buffer<ffi::U32>> scratch) {
  const auto dims = x.dimensions();
  LS_RETURN_IF_ERROR(require(dims.size() == 2, "x must be 2-D (rows, cols), got shape " + shape_string(dims)));
  const int64_t rows = dims[0], cols = dims[1];
  const int64_t length = history.element_count();
  LS_RETURN_IF_ERROR(require(history.dimensions().size() == 1 && length >= 1, "history must be float32[H], H >= 1"));
  LS_RETURN_IF_ERROR(require(next_history->dimensions().size() == 1 && next_history->element_count() == length,
                             "next_history must have history's shape"));
  LS_RETURN_IF_ERROR(require(scale.element_count() == 1, "scale must hold one float32"));
  LS_RETURN_IF_ERROR(require(scale_out->element_count() == 1, "the scale result must hold one float32"));
  LS_RETURN_IF_ERROR(require(scratch->element_count() == 2, "scratch must hold two uint32"));
  LS_RETURN_IF_ERROR(require(next_history->typed_data() == history.typed_data() &&
                                 scale_out->typed_data() == scale.typed_data(),
                             "next_history and s must alias history and scale (input_output_aliases {1: 3, 2: 2}): "
                             "the kernel updates them in place"));
  LS_RETURN_IF_ERROR(require_same_shape("q", *q, "x", x));
  const auto t_dims = q_t->dimensions();
  LS_RETURN_IF_ERROR(require(t_dims.size() == 2 && t_dims[0] == cols && t_dims[1] == rows,
                             "q_t must have shape (cols, rows) = (" + std::to_string(cols) + ", " +
                                 std::to_string(rows) + "), got " + shape_string(t_dims)));
  const ffi::DataType format = q->element_type();
  LS_RETURN_IF_ERROR(require(format == ffi::DataType::F8E4M3FN || format == ffi::DataType::F8E5M2,
                             "q must be float8_e4m3fn or float8_e5m2"));
  LS_RETURN_IF_ERROR(require(q_t->element_type() == format, "q_t must have q's dtype"));
  auto* out = static_cast<uint8_t*>(q->untyped_data());
  auto* out_t = static_cast<uint8_t*>(q_t->untyped_data());
  const ScalingState state{next_history->typed_data(), length, scale_out->typed_data()};
  return dispatch_float(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.untyped_data());
    auto run = [&](auto launcher) {
      return launcher(stream, in, state, out, out_t, scratch->typed_data(), rows, cols);
    };
    if (format == ffi::DataType::F8E4M3FN) return run(launch<T, __NV_E4M3>);
    return run(launch<T, __NV_E5M2>);
  });
}

}  // namespace

LS_FFI_TARGET(ls_fp8_quantize, fp8_quantize,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()    // x
                  .Arg<ffi::Buffer<ffi::F32>>()  // history (aliased to next_history)
                  .Arg<ffi::Buffer<ffi::F32>>()  // scale, the previous step's (aliased to s)
                  .Ret<ffi::AnyBuffer>()    // q
                  .Ret<ffi::AnyBuffer>()    // q_t
                  .Ret<ffi::Buffer<ffi::F32>>()  // s, this step's scale
                  .Ret<ffi::Buffer<ffi::F32>>()  // next_history
                  .Ret<ffi::Buffer<ffi::U32>>());  // scratch

}  // namespace ls
