// The elementwise fusions after a bias-free GEMM (math and shapes: ls_jax/ops/bias.py):
//   bias_dropout_residual   y = r + (x + b) * m            dx = dy * m,               db = sum_rows(dx)
//   bias_act_dropout        y = act(x + b) * m             dx = dy * m * act'(x + b), db = sum_rows(dx)
// with m = keep / (1 - rate) from the Philox seed (regenerated in the backward, never stored). For relu the
// forward also writes the bit mask of y > 0, which holds exactly where x + b > 0 and the element was kept, so
//   bias_relu_dropout       dx = dy * (y > 0 ? 1 / (1 - rate) : 0),  db = sum_rows(dx)
// reads dy and one bit per element: neither x, y, the bias nor the seed. The mask is uint8 (..., ceil(H / 8)),
// bit i of byte j for column 8 j + i (numpy's packbits, bitorder little), padding bits zero.
//
// Layout (rows.cuh strip_layout): a thread owns one 16-byte column vector and its bias values, and walks
// rows kRowUnroll at a time, loads first. In the backward each thread also sums its column of dx; a block
// writes one partial row of the bias gradient and sum_partials adds the partials in a fixed order.
//
// Targets (x, residual, y, dy, dx (..., H) of one dtype; bias, dbias (H,) f32 or that dtype; seed uint32[2];
// partials f32 (blocks, 1, H) scratch whose first axis bounds the backward grid; attributes threshold: u32 and
// scale: f32 as in dropout.cu, with threshold 0 and scale 1 meaning no dropout):
//   ls_bias_dropout_residual_fwd(x, bias, residual, seed) -> y
//   ls_bias_dropout_residual_bwd(dy, seed) -> (dx, dbias, partials)
//   ls_bias_act_dropout_fwd(x, bias, seed) -> y                 attribute activation: i32 (see Activation)
//   ls_bias_act_dropout_bwd(dy, x, bias, seed) -> (dx, dbias, partials)   attribute activation: i32
//   ls_bias_relu_dropout_fwd(x, bias, seed) -> (y, positive)              positive: the mask of y > 0
//   ls_bias_relu_dropout_bwd(dy, positive) -> (dx, dbias, partials)       attribute scale only (no seed)
#include <vector>

#include "rows.cuh"

namespace ls {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kRowUnroll = 2;
constexpr int kForwardBlocksPerSm = 4;

// Matches ls_jax/ops/bias.py ACTIVATIONS order; kIdentity is bias_dropout_residual's; kReluMask is the
// relu backward that reads the forward's mask of y > 0 (never sent from Python as an activation code).
enum class Activation : int32_t { kRelu = 0, kGelu = 1, kGeluTanh = 2, kIdentity = 3, kReluMask = 4 };

// Minimum resident blocks per SM for the register allocator: the forward fits 64 registers (1024 threads per
// SM), and so do the backwards that read no x (bias_dropout_residual's, relu's from its mask); the backward of an
// activation needs more to hold two rows of dy and x without spilling.
constexpr int kForwardMinBlocks = 4;
template <Activation A>
inline constexpr int kBackwardMinBlocks = A == Activation::kIdentity || A == Activation::kReluMask ? 4 : 3;

// The largest f32 that rounds to zero in T: half of T's smallest subnormal (the halfway point rounds to the even
// neighbour, zero).
template <typename T>
inline constexpr float kRoundsToZero = std::is_same_v<T, __nv_bfloat16> ? 0x1p-134f
                                       : std::is_same_v<T, __half>      ? 0x1p-25f
                                                                        : 0.0f;

// Bit i set where v[i], stored as T, is positive (a value that rounds to zero gets gradient zero, as in XLA).
template <typename T, int W>
__device__ __forceinline__ uint8_t positive_bits(const float (&v)[W]) {
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < W; ++i) bits |= (v[i] > kRoundsToZero<T> ? 1u : 0u) << i;
  return static_cast<uint8_t>(bits);
}

constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kGeluTanhCubic = 0.044715f;

template <Activation A>
__device__ __forceinline__ float activate(float z) {
  if constexpr (A == Activation::kRelu) return fmaxf(z, 0.0f);
  if constexpr (A == Activation::kGelu) return 0.5f * z * (1.0f + erff(z * kSqrtHalf));
  if constexpr (A == Activation::kGeluTanh)
    return 0.5f * z * (1.0f + tanhf(kSqrt2OverPi * (z + kGeluTanhCubic * z * z * z)));
  if constexpr (A == Activation::kIdentity) return z;
}

template <Activation A>
__device__ __forceinline__ float activation_derivative(float z) {
  if constexpr (A == Activation::kRelu) return z > 0.0f ? 1.0f : 0.0f;
  if constexpr (A == Activation::kGelu)
    return 0.5f * (1.0f + erff(z * kSqrtHalf)) + z * __expf(-0.5f * z * z) * kInvSqrt2Pi;
  if constexpr (A == Activation::kGeluTanh) {
    const float t = tanhf(kSqrt2OverPi * (z + kGeluTanhCubic * z * z * z));
    return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluTanhCubic * z * z);
  }
  if constexpr (A == Activation::kIdentity) return 1.0f;
}

// ---- forward --------------------------------------------------------------------------------------------

// y = act(x + bias) * m (+ residual when given); with `positive`, relu's mask of y > 0 (W = kMaskBits only: a
// thread of the 16-bit kernels owns exactly one byte's columns).
template <typename T, typename P, int W, Activation A>
__global__ void __launch_bounds__(kBlockThreads, kForwardMinBlocks)
    bias_fwd_kernel(const T* __restrict__ x, const P* __restrict__ bias, const T* __restrict__ residual,
                    T* __restrict__ y, uint8_t* __restrict__ positive, int64_t rows, int64_t cols,
                    DropoutParams params) {
  const int64_t vectors = cols / W;
  const int64_t vector = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (vector >= vectors) return;
  const bool drop = params.enabled();
  const Dropout dropout = drop ? Dropout::load(params) : Dropout{};
  float b[W];
  load_floats<W>(bias + vector * W, b);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; first < rows;
       first += step * kRowUnroll) {
    float v[kRowUnroll][W], r[kRowUnroll][W];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int64_t index = (first + u * step) * cols + vector * W;
      if (first + u * step < rows) {
        load_floats<W>(x + index, v[u]);
        if (residual != nullptr) load_floats<W>(residual + index, r[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int64_t index = (first + u * step) * cols + vector * W;
      if (first + u * step < rows) {
#pragma unroll
        for (int i = 0; i < W; ++i) v[u][i] = activate<A>(v[u][i] + b[i]);
        if (drop) dropout.apply<W>(static_cast<uint64_t>(index), v[u]);
        if (residual != nullptr) {
#pragma unroll
          for (int i = 0; i < W; ++i) v[u][i] += r[u][i];
        }
        if constexpr (A == Activation::kRelu && W == kMaskBits) {
          if (positive != nullptr) positive[(first + u * step) * vectors + vector] = positive_bits<T, W>(v[u]);
        }
        store_floats<W>(y + index, v[u]);
      }
    }
  }
}

// The relu mask from y, where the forward kernel's threads own fewer columns than a byte (f32, or rows that are
// not 16-byte vectors): one thread per byte.
template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    pack_positive_kernel(const T* __restrict__ y, uint8_t* __restrict__ positive, int64_t rows, int64_t cols) {
  const int64_t bytes_per_row = mask_bytes(cols);
  for (int64_t byte = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; byte < rows * bytes_per_row;
       byte += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t column = (byte % bytes_per_row) * kMaskBits;
    const int64_t first = (byte / bytes_per_row) * cols + column;
    const int valid = cols - column < kMaskBits ? static_cast<int>(cols - column) : kMaskBits;
    uint32_t bits = 0;
    for (int i = 0; i < valid; ++i) bits |= (to_float(y[first + i]) > 0.0f ? 1u : 0u) << i;
    positive[byte] = static_cast<uint8_t>(bits);
  }
}

template <typename T, typename P, int W, Activation A>
ffi::Error launch_forward(cudaStream_t stream, const T* x, const P* bias, const T* residual, T* y,
                          uint8_t* positive, int64_t rows, int64_t cols, DropoutParams params) {
  dim3 block;
  unsigned chunks = 0;
  LS_RETURN_IF_ERROR(strip_layout(cols / W, kBlockThreads, block, chunks));
  int64_t row_blocks = 0;
  LS_RETURN_IF_ERROR(stride_grid(rows, int64_t{block.y} * kRowUnroll, kForwardBlocksPerSm, row_blocks));
  bias_fwd_kernel<T, P, W, A><<<dim3(static_cast<unsigned>(row_blocks), chunks), block, 0, stream>>>(
      x, bias, residual, y, W == kMaskBits ? positive : nullptr, rows, cols, params);
  LS_RETURN_IF_ERROR(launch_error("bias_fwd_kernel"));
  if (positive == nullptr || W == kMaskBits) return ffi::Error::Success();
  int64_t blocks = 0;
  LS_RETURN_IF_ERROR(stride_grid(rows * mask_bytes(cols), kBlockThreads, kForwardBlocksPerSm, blocks));
  pack_positive_kernel<T><<<static_cast<unsigned>(blocks), kBlockThreads, 0, stream>>>(y, positive, rows, cols);
  return launch_error("pack_positive_kernel");
}

// Checks shared by both directions: `main` (..., H) and its dtype twins, `bias` (H,) and the dropout (a null
// seed for the relu backward from the output, which draws no random numbers).
ffi::Error check_buffers(const ffi::AnyBuffer& main, std::initializer_list<const ffi::AnyBuffer*> same,
                         const ffi::AnyBuffer& bias, const ffi::Buffer<ffi::U32>* seed,
                         const DropoutParams& params) {
  const auto dims = main.dimensions();
  LS_RETURN_IF_ERROR(require(dims.size() >= 1, "bias ops need an input of rank >= 1"));
  for (const ffi::AnyBuffer* buffer : same) {
    LS_RETURN_IF_ERROR(require_same_shape("an activation", *buffer, "x", main));
    LS_RETURN_IF_ERROR(require(buffer->element_type() == main.element_type(), "activations must share one dtype"));
  }
  LS_RETURN_IF_ERROR(require(bias.dimensions().size() == 1 && bias.dimensions()[0] == last_dim(dims),
                             "bias must have shape (" + std::to_string(last_dim(dims)) + ",), got " +
                                 shape_string(bias.dimensions())));
  return seed == nullptr ? ffi::Error::Success() : require_dropout_seed(*seed, params, main.element_count());
}

// relu's mask of an (..., H) activation (rank >= 1, checked first) is (..., ceil(H / 8)).
ffi::Error check_mask(const ffi::Buffer<ffi::U8>& positive, const ffi::AnyBuffer& main) {
  std::vector<int64_t> expected(main.dimensions().begin(), main.dimensions().end());
  expected.back() = mask_bytes(expected.back());
  return require(same_dims(positive.dimensions(), expected),
                 "the relu mask of an activation of shape " + shape_string(main.dimensions()) + " must have shape " +
                     shape_string(expected) + " (one bit per element), got " + shape_string(positive.dimensions()));
}

template <Activation A>
ffi::Error forward(cudaStream_t stream, const ffi::AnyBuffer& x, const ffi::AnyBuffer& bias,
                   const ffi::AnyBuffer* residual, const ffi::Buffer<ffi::U32>& seed, ffi::AnyBuffer& y,
                   ffi::Buffer<ffi::U8>* positive, uint32_t threshold, float scale) {
  const DropoutParams params{seed.typed_data(), threshold, scale};
  if (residual) {
    LS_RETURN_IF_ERROR(check_buffers(x, {residual, &y}, bias, &seed, params));
  } else {
    LS_RETURN_IF_ERROR(check_buffers(x, {&y}, bias, &seed, params));
  }
  if (positive) LS_RETURN_IF_ERROR(check_mask(*positive, x));
  const int64_t rows = leading_rows(x.dimensions());
  const int64_t cols = last_dim(x.dimensions());
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  return dispatch_float(x.element_type(), "x", [&](auto act) {
    using T = decltype(act);
    return dispatch_param<T>(bias.element_type(), "bias", [&](auto param) {
      using P = decltype(param);
      const T* in = static_cast<const T*>(x.untyped_data());
      const P* b = static_cast<const P*>(bias.untyped_data());
      const T* res = residual ? static_cast<const T*>(residual->untyped_data()) : nullptr;
      T* out = static_cast<T*>(y.untyped_data());
      uint8_t* mask = positive ? positive->typed_data() : nullptr;
      if (vectorizable<T>(cols, {in, b, res, out}))
        return launch_forward<T, P, kVecWidth<T>, A>(stream, in, b, res, out, mask, rows, cols, params);
      return launch_forward<T, P, 1, A>(stream, in, b, res, out, mask, rows, cols, params);
    });
  });
}

// ---- backward -------------------------------------------------------------------------------------------

// dx = dy * m * act'(x + bias) (x and bias unused for kIdentity; for kReluMask only the mask of y > 0 is read,
// dx = dy * (y > 0 ? scale : 0)); this block's column sums of dx go to partials[blockIdx.x].
template <typename T, typename P, int W, Activation A>
__global__ void __launch_bounds__(kBlockThreads, kBackwardMinBlocks<A>)
    bias_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const uint8_t* __restrict__ positive,
                    const P* __restrict__ bias, T* __restrict__ dx, float* __restrict__ partials, int64_t rows,
                    int64_t cols, DropoutParams params) {
  extern __shared__ float shared[];
  const int64_t vectors = cols / W;
  const int64_t vector = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const bool owner = vector < vectors;
  constexpr bool kFromMask = A == Activation::kReluMask;
  constexpr bool kReadsX = A != Activation::kIdentity && !kFromMask;
  const bool drop = !kFromMask && params.enabled();
  const Dropout dropout = drop ? Dropout::load(params) : Dropout{};
  // W divides kMaskBits and the vector starts at a multiple of W, so its bits lie in one byte.
  const int64_t mask_row = mask_bytes(cols);
  const int64_t mask_byte = vector * W / kMaskBits;
  const int mask_shift = static_cast<int>(vector * W % kMaskBits);
  float b[W], sum[1][W];
#pragma unroll
  for (int i = 0; i < W; ++i) b[i] = sum[0][i] = 0.0f;
  if (kReadsX && owner) load_floats<W>(bias + vector * W, b);

  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; owner && first < rows;
       first += step * kRowUnroll) {
    float d[kRowUnroll][W], z[kRowUnroll][W];
    uint32_t kept[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int64_t index = (first + u * step) * cols + vector * W;
      if (first + u * step < rows) {
        load_floats<W>(dy + index, d[u]);
        if constexpr (kReadsX) load_floats<W>(x + index, z[u]);
        if constexpr (kFromMask) kept[u] = positive[(first + u * step) * mask_row + mask_byte] >> mask_shift;
      }
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int64_t index = (first + u * step) * cols + vector * W;
      if (first + u * step < rows) {
        if (drop) dropout.apply<W>(static_cast<uint64_t>(index), d[u]);
        if constexpr (kFromMask) {
#pragma unroll
          for (int i = 0; i < W; ++i) d[u][i] = (kept[u] >> i) & 1u ? d[u][i] * params.scale : 0.0f;
        } else if constexpr (kReadsX) {
#pragma unroll
          for (int i = 0; i < W; ++i) d[u][i] *= activation_derivative<A>(z[u][i] + b[i]);
        }
#pragma unroll
        for (int i = 0; i < W; ++i) sum[0][i] += d[u][i];
        store_floats<W>(dx + index, d[u]);
      }
    }
  }
  write_block_partial<1, W>(sum, vector, vectors, 1, shared, partials + static_cast<int64_t>(blockIdx.x) * cols);
}

template <typename T, typename P, int W, Activation A>
ffi::Error launch_backward(cudaStream_t stream, const T* dy, const T* x, const uint8_t* positive, const P* bias,
                           T* dx, P* dbias, float* partials, int64_t partial_rows, int64_t rows, int64_t cols,
                           DropoutParams params) {
  dim3 block;
  unsigned chunks = 0;
  LS_RETURN_IF_ERROR(strip_layout(cols / W, kBlockThreads, block, chunks));
  const size_t shared = static_cast<size_t>(block.x) * block.y * W * sizeof(float);
  const auto kernel = bias_bwd_kernel<T, P, W, A>;
  int64_t blocks = 0;
  LS_RETURN_IF_ERROR(
      resident_row_blocks(kernel, block, shared, chunks, partial_rows, ceil_div(rows, block.y), blocks));
  kernel<<<dim3(static_cast<unsigned>(blocks), chunks), block, shared, stream>>>(dy, x, positive, bias, dx, partials,
                                                                                rows, cols, params);
  LS_RETURN_IF_ERROR(launch_error("bias_bwd_kernel"));
  return sum_partials<P>(stream, partials, blocks, cols, {{dbias}, 1});
}

// x and bias are read only for an activation; bias_dropout_residual and the relu backward from the mask pass
// the (unread) dbias buffer as bias for its dtype, the latter the mask instead of x and no seed.
template <Activation A>
ffi::Error backward(cudaStream_t stream, const ffi::AnyBuffer& dy, const ffi::AnyBuffer* x,
                    const ffi::Buffer<ffi::U8>* positive, const ffi::AnyBuffer& bias,
                    const ffi::Buffer<ffi::U32>* seed, ffi::AnyBuffer& dx, ffi::AnyBuffer& dbias,
                    ffi::AnyBuffer& partials, uint32_t threshold, float scale) {
  const DropoutParams params{seed ? seed->typed_data() : nullptr, threshold, scale};
  if (x) {
    LS_RETURN_IF_ERROR(check_buffers(dy, {x, &dx}, bias, seed, params));
  } else {
    LS_RETURN_IF_ERROR(check_buffers(dy, {&dx}, bias, seed, params));
  }
  if (positive) LS_RETURN_IF_ERROR(check_mask(*positive, dy));
  LS_RETURN_IF_ERROR(require(dbias.element_type() == bias.element_type() && same_dims(dbias.dimensions(),
                                                                                       bias.dimensions()),
                             "dbias must have bias's shape and dtype"));
  const int64_t rows = leading_rows(dy.dimensions());
  const int64_t cols = last_dim(dy.dimensions());
  if (cols == 0) return ffi::Error::Success();
  int64_t partial_rows = 0;
  LS_RETURN_IF_ERROR(require_partials(partials, 1, cols, partial_rows));
  return dispatch_float(dy.element_type(), "dy", [&](auto act) {
    using T = decltype(act);
    return dispatch_param<T>(bias.element_type(), "bias", [&](auto param) {
      using P = decltype(param);
      const T* grad = static_cast<const T*>(dy.untyped_data());
      const T* in = x ? static_cast<const T*>(x->untyped_data()) : nullptr;
      const uint8_t* mask = positive ? positive->typed_data() : nullptr;
      const P* b = static_cast<const P*>(bias.untyped_data());
      T* out = static_cast<T*>(dx.untyped_data());
      P* db = static_cast<P*>(dbias.untyped_data());
      float* scratch = static_cast<float*>(partials.untyped_data());
      if (vectorizable<T>(cols, {grad, in, b, out}))
        return launch_backward<T, P, kVecWidth<T>, A>(stream, grad, in, mask, b, out, db, scratch, partial_rows, rows,
                                                       cols, params);
      return launch_backward<T, P, 1, A>(stream, grad, in, mask, b, out, db, scratch, partial_rows, rows, cols, params);
    });
  });
}

// ---- handlers -------------------------------------------------------------------------------------------

// Runs body(std::integral_constant<Activation, A>{}) for the activation code sent by Python.
template <typename Body>
ffi::Error dispatch_activation(int32_t code, Body&& body) {
  switch (static_cast<Activation>(code)) {
    case Activation::kRelu: return body(std::integral_constant<Activation, Activation::kRelu>{});
    case Activation::kGelu: return body(std::integral_constant<Activation, Activation::kGelu>{});
    case Activation::kGeluTanh: return body(std::integral_constant<Activation, Activation::kGeluTanh>{});
    default: return ffi::Error::InvalidArgument("unknown activation code " + std::to_string(code));
  }
}

ffi::Error bias_dropout_residual_fwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                                     ffi::AnyBuffer residual, ffi::Buffer<ffi::U32> seed,
                                     ffi::Result<ffi::AnyBuffer> y, uint32_t threshold, float scale) {
  return forward<Activation::kIdentity>(stream, x, bias, &residual, seed, *y, nullptr, threshold, scale);
}

ffi::Error bias_dropout_residual_bwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::Buffer<ffi::U32> seed,
                                     ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dbias,
                                     ffi::Result<ffi::AnyBuffer> partials, uint32_t threshold, float scale) {
  return backward<Activation::kIdentity>(stream, dy, nullptr, nullptr, *dbias, &seed, *dx, *dbias, *partials,
                                         threshold, scale);
}

ffi::Error bias_act_dropout_fwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                                ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> y, uint32_t threshold,
                                float scale, int32_t activation) {
  return dispatch_activation(activation, [&](auto a) {
    return forward<decltype(a)::value>(stream, x, bias, nullptr, seed, *y, nullptr, threshold, scale);
  });
}

ffi::Error bias_act_dropout_bwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                                ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> dx,
                                ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> partials,
                                uint32_t threshold, float scale, int32_t activation) {
  return dispatch_activation(activation, [&](auto a) {
    return backward<decltype(a)::value>(stream, dy, &x, nullptr, bias, &seed, *dx, *dbias, *partials, threshold,
                                        scale);
  });
}

ffi::Error bias_relu_dropout_fwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                                 ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> y,
                                 ffi::Result<ffi::Buffer<ffi::U8>> positive, uint32_t threshold, float scale) {
  return forward<Activation::kRelu>(stream, x, bias, nullptr, seed, *y, &*positive, threshold, scale);
}

ffi::Error bias_relu_dropout_bwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::Buffer<ffi::U8> positive,
                                 ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dbias,
                                 ffi::Result<ffi::AnyBuffer> partials, float scale) {
  return backward<Activation::kReluMask>(stream, dy, nullptr, &positive, *dbias, nullptr, *dx, *dbias, *partials, 0,
                                         scale);
}

}  // namespace

LS_FFI_TARGET(ls_bias_dropout_residual_fwd, bias_dropout_residual_fwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

LS_FFI_TARGET(ls_bias_dropout_residual_bwd, bias_dropout_residual_bwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

LS_FFI_TARGET(ls_bias_act_dropout_fwd, bias_act_dropout_fwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale")
                  .Attr<int32_t>("activation"));

LS_FFI_TARGET(ls_bias_act_dropout_bwd, bias_act_dropout_bwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale")
                  .Attr<int32_t>("activation"));

LS_FFI_TARGET(ls_bias_relu_dropout_fwd, bias_relu_dropout_fwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::Buffer<ffi::U8>>()
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

LS_FFI_TARGET(ls_bias_relu_dropout_bwd, bias_relu_dropout_bwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U8>>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<float>("scale"));

}  // namespace ls
