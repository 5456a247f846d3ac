// FP8 quantization for FP8 matrix products: one pass over x writes its FP8 values in both layouts and its amax.
//
//   q     = fp8(clip(x / round_T(scale), -fp8_max, fp8_max))   (rows, cols), in f32, round to nearest even
//   q_t   = q transposed                                       (cols, rows)
//   amax  = max |x|                                            f32[1], NaN if any x is NaN
//
// T is x's dtype, to which the scale is rounded first, as Flax's FP8 ops do (ls_jax/ops/quantize.py).
// cuBLASLt's FP8 GEMMs on Hopper take both operands with the contracted axis innermost, so a weight gradient
// (contracting the rows) needs the transposed copy; writing it from the same tile saves a second pass over x.
//
// Target ls_fp8_quantize(x, scale: f32[1]) -> (q, q_t, amax: f32[1]); q's dtype (float8_e4m3fn or float8_e5m2)
// picks the format.
#include <cuda_fp8.h>

#include "common.cuh"

namespace ls {
namespace {

constexpr int kTile = 64;                 // a block's tile: kTile x kTile elements of x
constexpr int kChunk = 16;                // elements per thread per pass: one 16-byte vector of FP8
constexpr int kThreads = kTile * kTile / kChunk;
constexpr int kChunksPerRow = kTile / kChunk;
constexpr int kPitch = kTile + 4;         // shared-memory row pitch in bytes, off the 32-bank period

template <__nv_fp8_interpretation_t Format>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, Format);  // saturates like the clip, keeps NaN
}

// The larger of a running |x| maximum and |v|, NaN once any v is NaN (fmaxf would drop it).
__device__ __forceinline__ float amax_with(float amax, float v) {
  const float magnitude = fabsf(v);
  return (magnitude > amax || isnan(magnitude)) ? magnitude : amax;
}

template <typename T, __nv_fp8_interpretation_t Format>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ x, const float* __restrict__ scale, uint8_t* __restrict__ q,
                    uint8_t* __restrict__ q_t, unsigned int* __restrict__ amax_bits, int64_t rows, int64_t cols,
                    bool vector_rows, bool vector_cols) {
  __shared__ uint8_t tile[kTile][kPitch];
  __shared__ float warp_amax[kThreads / 32];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const float divisor = round_to<T>(*scale);
  float amax = 0.0f;

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
        out[i] = to_fp8<Format>(v[i] / divisor);
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
          out[i] = to_fp8<Format>(v / divisor);
          q[row * cols + col + i] = out[i];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kChunk; ++i) tile[r][c + i] = out[i];
  }
  __syncthreads();

  // Columns of the tile: each thread writes kChunk consecutive elements of one row of q_t (a column of x).
  {
    const int c = threadIdx.x / kChunksPerRow, r = (threadIdx.x % kChunksPerRow) * kChunk;
    const int64_t col = col0 + c, row = row0 + r;
    if (col < cols) {
      uint8_t out[kChunk];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) out[i] = tile[r + i][c];
      if (row + kChunk <= rows && vector_rows) {
        uint4 packed;
        memcpy(&packed, out, kChunk);
        *reinterpret_cast<uint4*>(q_t + col * rows + row) = packed;
      } else {
        for (int i = 0; i < kChunk && row + i < rows; ++i) q_t[col * rows + row + i] = out[i];
      }
    }
  }

  // The block's amax, then the largest over blocks: a non-negative float (NaN included) orders as its bits.
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = amax_with(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) amax = amax_with(amax, warp_amax[w]);
    atomicMax(amax_bits, __float_as_uint(amax));
  }
}

ffi::Error zero_amax(cudaStream_t stream, float* amax) {
  const cudaError_t status = cudaMemsetAsync(amax, 0, sizeof(float), stream);
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("zeroing amax failed: ") + cudaGetErrorString(status));
}

template <typename T, __nv_fp8_interpretation_t Format>
ffi::Error launch(cudaStream_t stream, const T* x, const float* scale, uint8_t* q, uint8_t* q_t, float* amax,
                  int64_t rows, int64_t cols) {
  LS_RETURN_IF_ERROR(zero_amax(stream, amax));
  const dim3 grid(static_cast<unsigned>(ceil_div(rows, kTile)), static_cast<unsigned>(ceil_div(cols, kTile)));
  // 16-byte accesses: a row chunk of x (kChunk elements), of q and of q_t start at multiples of 16 bytes.
  const bool vector_cols = cols % kChunk == 0 && is_aligned(x, 16) && is_aligned(q, 16);
  const bool vector_rows = rows % kChunk == 0 && is_aligned(q_t, 16);
  quantize_kernel<T, Format><<<grid, kThreads, 0, stream>>>(x, scale, q, q_t, reinterpret_cast<unsigned int*>(amax),
                                                             rows, cols, vector_rows, vector_cols);
  return launch_error("quantize_kernel");
}

ffi::Error fp8_quantize(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                        ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> q_t,
                        ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  const auto dims = x.dimensions();
  LS_RETURN_IF_ERROR(require(dims.size() == 2, "x must be 2-D (rows, cols), got shape " + shape_string(dims)));
  const int64_t rows = dims[0], cols = dims[1];
  LS_RETURN_IF_ERROR(require(scale.element_count() == 1, "scale must hold one float32"));
  LS_RETURN_IF_ERROR(require(amax->element_count() == 1, "amax must hold one float32"));
  LS_RETURN_IF_ERROR(require_same_shape("q", *q, "x", x));
  const auto t_dims = q_t->dimensions();
  LS_RETURN_IF_ERROR(require(t_dims.size() == 2 && t_dims[0] == cols && t_dims[1] == rows,
                             "q_t must have shape (cols, rows) = (" + std::to_string(cols) + ", " +
                                 std::to_string(rows) + "), got " + shape_string(t_dims)));
  const ffi::DataType format = q->element_type();
  LS_RETURN_IF_ERROR(require(format == ffi::DataType::F8E4M3FN || format == ffi::DataType::F8E5M2,
                             "q must be float8_e4m3fn or float8_e5m2"));
  LS_RETURN_IF_ERROR(require(q_t->element_type() == format, "q_t must have q's dtype"));
  LS_RETURN_IF_ERROR(require(ceil_div(cols, kTile) <= 65535, "x has more than 65535 * 64 columns"));
  if (rows == 0 || cols == 0) return zero_amax(stream, amax->typed_data());
  auto* out = static_cast<uint8_t*>(q->untyped_data());
  auto* out_t = static_cast<uint8_t*>(q_t->untyped_data());
  return dispatch_float(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.untyped_data());
    if (format == ffi::DataType::F8E4M3FN)
      return launch<T, __NV_E4M3>(stream, in, scale.typed_data(), out, out_t, amax->typed_data(), rows, cols);
    return launch<T, __NV_E5M2>(stream, in, scale.typed_data(), out, out_t, amax->typed_data(), rows, cols);
  });
}

}  // namespace

LS_FFI_TARGET(ls_fp8_quantize, fp8_quantize,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::F32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::Buffer<ffi::F32>>());

}  // namespace ls
