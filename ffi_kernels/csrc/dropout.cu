// Dropout: y = x * keep / (1 - rate), the mask regenerated from the Philox seed (common.cuh). The backward is
// the same map applied to dy, so one target serves both directions.
//
// Target ls_dropout(x, seed: uint32[2]) -> y, attributes threshold: u32, scale: f32.
#include "common.cuh"

namespace ls {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte vectors in flight per thread
constexpr int kBlocksPerSm = 8;
constexpr int kMinBlocksPerSm = 4;  // caps registers at 64 so that 1024 threads fit on an SM

// Grid-stride over W-element vectors (kUnroll of them per thread per sweep, loads issued before any
// arithmetic), then over the n % W tail elements one by one. W is the 16-byte width, or 1 when a pointer is
// not 16-byte aligned.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    dropout_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n, DropoutParams params) {
  const Dropout dropout = Dropout::load(params);
  const int64_t vectors = n / W;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = thread; base < vectors; base += stride * kUnroll) {
    float v[kUnroll][W];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vec = base + u * stride;
      if (vec < vectors) load_floats<W>(x + vec * W, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vec = base + u * stride;
      if (vec < vectors) {
        dropout.apply<W>(static_cast<uint64_t>(vec) * W, v[u]);
        store_floats<W>(y + vec * W, v[u]);
      }
    }
  }
  for (int64_t i = vectors * W + thread; i < n; i += stride) {
    y[i] = from_float<T>(to_float(x[i]) * dropout.multiplier(i));
  }
}

template <typename T, int W>
ffi::Error launch(cudaStream_t stream, const T* x, T* y, int64_t n, DropoutParams params) {
  int64_t blocks = 0;
  LS_RETURN_IF_ERROR(stride_grid(ceil_div(n, W), int64_t{kThreads} * kUnroll, kBlocksPerSm, blocks));
  dropout_kernel<T, W><<<blocks, kThreads, 0, stream>>>(x, y, n, params);
  return launch_error("dropout_kernel");
}

ffi::Error dropout(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> y,
                   uint32_t threshold, float scale) {
  LS_RETURN_IF_ERROR(require_same_shape("y", *y, "x", x));
  LS_RETURN_IF_ERROR(require(y->element_type() == x.element_type(), "y must have x's dtype"));
  const int64_t n = static_cast<int64_t>(x.element_count());
  const DropoutParams params{seed.typed_data(), threshold, scale};
  LS_RETURN_IF_ERROR(require_dropout_seed(seed, params, n));
  if (n == 0) return ffi::Error::Success();
  return dispatch_float(x.element_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(y->untyped_data());
    if (is_aligned(in, 16) && is_aligned(out, 16)) return launch<T, kVecWidth<T>>(stream, in, out, n, params);
    return launch<T, 1>(stream, in, out, n, params);
  });
}

}  // namespace

LS_FFI_TARGET(ls_dropout, dropout,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

}  // namespace ls
