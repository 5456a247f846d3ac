// LayerNorm over the last axis, optionally of s = x + residual or of s = residual + dropout(x + bias), the
// tail of a pre-LN sublayer and the head of the next (math and shapes: ls_jax/ops/layer_norm.py).
//
// Forward: one row group per row holds the row in registers (one read of x and residual), takes the mean
// and then the variance of the centred values from registers, and writes y (and s, rounded to the activation
// dtype before the statistics, as XLA does), mean and rstd. s is bias_dropout_residual's (bias.cu) to the bit.
// Backward: the same row layout; a block strides over rows, computes ds with the two row sums
// sum(dy * gamma) and sum(dy * gamma * xhat) in one group reduction, and keeps its columns' dgamma and dbeta
// sums in registers; each block writes one partial row, and sum_partials adds the partials in a fixed order.
// With bias and dropout it also writes dx = round(ds) * m and sums dbias = sum_rows(dx) the same way, as
// bias_dropout_residual's backward would from the stored ds.
//
// Targets
//   ls_layer_norm_fwd(x, gamma, beta) -> (y, mean, rstd)                      attribute eps: f32
//   ls_layer_norm_add_fwd(x, residual, gamma, beta) -> (y, s, mean, rstd)    attribute eps: f32
//   ls_layer_norm_bwd(dy, s, mean, rstd, gamma) -> (ds, dgamma, dbeta, partials)
//   ls_layer_norm_add_bwd(dy, dsum, s, mean, rstd, gamma) -> (ds, dgamma, dbeta, partials)
//   ls_bias_dropout_residual_layer_norm_fwd(x, bias, residual, gamma, beta, seed) -> (y, s, mean, rstd)
//       attributes eps: f32, threshold: u32, scale: f32 (as in dropout.cu)
//   ls_bias_dropout_residual_layer_norm_bwd(dy, dsum, s, mean, rstd, gamma, seed)
//       -> (ds, dx, dgamma, dbeta, dbias, partials)                        attributes threshold, scale
// with x, residual, y, s, dy, dsum, ds, dx (..., H) of one dtype; gamma, beta, bias, dgamma, dbeta, dbias (H,)
// f32 or that dtype, all one; mean, rstd f32 (...); seed uint32[2]; partials f32 (blocks, 2 or 3 with dbias, H)
// scratch whose first axis bounds the backward grid.
#include "rows.cuh"

namespace ls {
namespace {

constexpr int kForwardBlockThreads = 256;
constexpr int kBackwardBlockThreads = 512;

// ---- forward --------------------------------------------------------------------------------------------

template <typename T, typename P, int W>
__global__ void __launch_bounds__(1024, 1)
    layer_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ residual, const P* __restrict__ bias,
                          const P* __restrict__ gamma, const P* __restrict__ beta, T* __restrict__ y,
                          T* __restrict__ sum_out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                          int64_t rows, int64_t cols, int vpt, float eps, DropoutParams params) {
  constexpr int kVpt = kMaxRowElements / W;
  __shared__ float scratch[kGroupReduceScratch<1>];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int vectors = static_cast<int>(cols / W);  // cols <= kMaxRowLength: int column indices
  const int64_t offset = row * cols;
  const bool drop = params.enabled();
  const Dropout dropout = drop ? Dropout::load(params) : Dropout{};

  float v[kVpt][W];
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    const int vector = threadIdx.x + k * blockDim.x;
    if (k < vpt && row < rows && vector < vectors) {
      load_floats<W>(x + offset + vector * W, v[k]);
      if (residual != nullptr) {
        float r[W];
        load_floats<W>(residual + offset + vector * W, r);
        if (bias != nullptr) {
          float b[W];
          load_floats<W>(bias + vector * W, b);
#pragma unroll
          for (int i = 0; i < W; ++i) v[k][i] += b[i];
        }
        if (drop) dropout.apply<W>(static_cast<uint64_t>(offset + vector * W), v[k]);
#pragma unroll
        for (int i = 0; i < W; ++i) v[k][i] = round_to<T>(v[k][i] + r[i]);
        store_floats<W>(sum_out + offset + vector * W, v[k]);
      }
#pragma unroll
      for (int i = 0; i < W; ++i) sum += v[k][i];
    }
  }
  const float mean = group_reduce<SumOp>(sum, scratch) / static_cast<float>(cols);

  float squares = 0.0f;
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    const int vector = threadIdx.x + k * blockDim.x;
    if (k < vpt && row < rows && vector < vectors) {
#pragma unroll
      for (int i = 0; i < W; ++i) {
        const float centered = v[k][i] - mean;
        squares += centered * centered;
      }
    }
  }
  const float rstd = rsqrtf(group_reduce<SumOp>(squares, scratch) / static_cast<float>(cols) + eps);
  if (row >= rows) return;

#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    const int vector = threadIdx.x + k * blockDim.x;
    if (k < vpt && vector < vectors) {
      float g[W], b[W], out[W];
      load_floats<W>(gamma + vector * W, g);
      load_floats<W>(beta + vector * W, b);
#pragma unroll
      for (int i = 0; i < W; ++i) out[i] = (v[k][i] - mean) * rstd * g[i] + b[i];
      store_floats<W>(y + offset + vector * W, out);
    }
  }
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

struct ForwardArgs {
  const ffi::AnyBuffer& x;
  const ffi::AnyBuffer* residual;
  const ffi::AnyBuffer* bias;
  const ffi::AnyBuffer& gamma;
  const ffi::AnyBuffer& beta;
  ffi::AnyBuffer& y;
  ffi::AnyBuffer* sum;
  ffi::AnyBuffer& mean;
  ffi::AnyBuffer& rstd;
  DropoutParams dropout;
};

template <typename T, typename P, int W>
ffi::Error launch_forward(cudaStream_t stream, const ForwardArgs& a, int64_t rows, int64_t cols, float eps) {
  const RowLayout layout = row_layout(cols, W, kForwardBlockThreads);
  const int64_t blocks = ceil_div(rows, layout.block.y);
  layer_norm_fwd_kernel<T, P, W><<<blocks, layout.block, 0, stream>>>(
      static_cast<const T*>(a.x.untyped_data()),
      a.residual ? static_cast<const T*>(a.residual->untyped_data()) : nullptr,
      a.bias ? static_cast<const P*>(a.bias->untyped_data()) : nullptr, static_cast<const P*>(a.gamma.untyped_data()),
      static_cast<const P*>(a.beta.untyped_data()), static_cast<T*>(a.y.untyped_data()),
      a.sum ? static_cast<T*>(a.sum->untyped_data()) : nullptr, static_cast<float*>(a.mean.untyped_data()),
      static_cast<float*>(a.rstd.untyped_data()), rows, cols, layout.vectors_per_thread, eps, a.dropout);
  return launch_error("layer_norm_fwd_kernel");
}

// Shape and dtype checks shared by both directions: `what` names the (..., H) activation, `params` the (H,)
// parameters, `stats` the f32 per-row statistics.
ffi::Error check_row_buffers(const ffi::AnyBuffer& activation, std::initializer_list<const ffi::AnyBuffer*> same,
                             std::initializer_list<const ffi::AnyBuffer*> params,
                             std::initializer_list<const ffi::AnyBuffer*> stats) {
  const auto dims = activation.dimensions();
  const int64_t cols = last_dim(dims);
  LS_RETURN_IF_ERROR(require(dims.size() >= 1 && cols >= 1, "LayerNorm input must have a nonempty last axis, got " +
                                                                 shape_string(dims)));
  LS_RETURN_IF_ERROR(require(cols <= kMaxRowLength, "LayerNorm kernels take hidden sizes up to " +
                                                        std::to_string(kMaxRowLength) + ", got " +
                                                        std::to_string(cols)));
  for (const ffi::AnyBuffer* buffer : same) {
    LS_RETURN_IF_ERROR(require_same_shape("a LayerNorm activation", *buffer, "the input", activation));
    LS_RETURN_IF_ERROR(require(buffer->element_type() == activation.element_type(),
                               "LayerNorm activations must share one dtype"));
  }
  for (const ffi::AnyBuffer* buffer : params) {
    LS_RETURN_IF_ERROR(require(buffer->dimensions().size() == 1 && buffer->dimensions()[0] == cols,
                               "LayerNorm parameters must have shape (" + std::to_string(cols) + ",), got " +
                                   shape_string(buffer->dimensions())));
    LS_RETURN_IF_ERROR(require(buffer->element_type() == params.begin()[0]->element_type(),
                               "LayerNorm parameters must share one dtype"));
  }
  for (const ffi::AnyBuffer* buffer : stats) {
    LS_RETURN_IF_ERROR(require(buffer->element_type() == ffi::DataType::F32 &&
                                   static_cast<int64_t>(buffer->element_count()) == leading_rows(dims),
                               "LayerNorm mean and rstd must be float32 with one value per row"));
  }
  return ffi::Error::Success();
}

ffi::Error forward(cudaStream_t stream, const ForwardArgs& a, float eps) {
  if (a.bias) {
    LS_RETURN_IF_ERROR(check_row_buffers(a.x, {a.residual, &a.y, a.sum}, {&a.gamma, &a.beta, a.bias},
                                         {&a.mean, &a.rstd}));
  } else if (a.residual) {
    LS_RETURN_IF_ERROR(check_row_buffers(a.x, {a.residual, &a.y, a.sum}, {&a.gamma, &a.beta}, {&a.mean, &a.rstd}));
  } else {
    LS_RETURN_IF_ERROR(check_row_buffers(a.x, {&a.y}, {&a.gamma, &a.beta}, {&a.mean, &a.rstd}));
  }
  const int64_t rows = leading_rows(a.x.dimensions());
  const int64_t cols = last_dim(a.x.dimensions());
  if (rows == 0) return ffi::Error::Success();
  return dispatch_float(a.x.element_type(), "x", [&](auto act) {
    using T = decltype(act);
    return dispatch_param<T>(a.gamma.element_type(), "gamma", [&](auto param) {
      using P = decltype(param);
      if (vectorizable<T>(cols, {&a.x, a.residual, a.bias, &a.gamma, &a.beta, &a.y, a.sum}))
        return launch_forward<T, P, kVecWidth<T>>(stream, a, rows, cols, eps);
      return launch_forward<T, P, 1>(stream, a, rows, cols, eps);
    });
  });
}

ffi::Error layer_norm_fwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                          ffi::Result<ffi::AnyBuffer> rstd, float eps) {
  return forward(stream, {x, nullptr, nullptr, gamma, beta, *y, nullptr, *mean, *rstd, kNoDropout}, eps);
}

ffi::Error layer_norm_add_fwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer gamma,
                              ffi::AnyBuffer beta, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> sum,
                              ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd, float eps) {
  return forward(stream, {x, &residual, nullptr, gamma, beta, *y, &*sum, *mean, *rstd, kNoDropout}, eps);
}

ffi::Error bias_dropout_residual_layer_norm_fwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                                                ffi::AnyBuffer residual, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                                                ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> y,
                                                ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> mean,
                                                ffi::Result<ffi::AnyBuffer> rstd, float eps, uint32_t threshold,
                                                float scale) {
  const DropoutParams dropout{seed.typed_data(), threshold, scale};
  LS_RETURN_IF_ERROR(require_dropout_seed(seed, dropout, x.element_count()));
  return forward(stream, {x, &residual, &bias, gamma, beta, *y, &*sum, *mean, *rstd, dropout}, eps);
}

// ---- backward -------------------------------------------------------------------------------------------

// kBiasDropout: also dx = round(ds) * m and its column sums (the bias gradient), partials (blocks, 3, H).
template <typename T, typename P, int W, bool kBiasDropout>
__global__ void __launch_bounds__(1024, 1)
    layer_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ dsum, const T* __restrict__ s,
                          const float* __restrict__ mean, const float* __restrict__ rstd,
                          const P* __restrict__ gamma, T* __restrict__ ds, T* __restrict__ dx,
                          float* __restrict__ partials, int64_t rows, int64_t cols, int vpt, DropoutParams params) {
  constexpr int kVpt = kMaxRowElements / W;
  extern __shared__ float shared[];
  __shared__ float scratch[kGroupReduceScratch<2>];
  const int vectors = static_cast<int>(cols / W);  // cols <= kMaxRowLength: int column indices
  const float inv_cols = 1.0f / static_cast<float>(cols);
  const bool drop = kBiasDropout && params.enabled();
  const Dropout dropout = drop ? Dropout::load(params) : Dropout{};

  float dgamma[kVpt][W], dbeta[kVpt][W], dbias[kBiasDropout ? kVpt : 1][W];
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
#pragma unroll
    for (int i = 0; i < W; ++i) dgamma[k][i] = dbeta[k][i] = dbias[kBiasDropout ? k : 0][i] = 0.0f;
  }

  // Every thread runs the same number of iterations: group_reduce synchronizes the block.
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.y; first < rows; first += step) {
    const int64_t row = first + threadIdx.y;
    const bool active = row < rows;
    const T* dy_row = dy + row * cols;
    const T* s_row = s + row * cols;
    const float row_mean = active ? mean[row] : 0.0f;
    const float row_rstd = active ? rstd[row] : 0.0f;
    // gamma is re-read per row (from L1) and dsum read with dy and s, so that one memory latency covers the
    // row; dgamma and dbeta take their terms before the reduction, so that only dy * gamma and xhat stay live.
    // With kBiasDropout dsum is read after the reduction instead: the Philox registers of the second loop then
    // fit in the 64 of a 1024-thread block without spilling.
    float dg[kVpt][W], xhat[kVpt][W];
    Pack<T, W> incoming[kVpt];
    float sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < kVpt; ++k) {
      const int vector = threadIdx.x + k * blockDim.x;
      if (k < vpt && active && vector < vectors) {
        float d[W], g[W];
        load_floats<W>(dy_row + vector * W, d);
        load_floats<W>(s_row + vector * W, xhat[k]);
        load_floats<W>(gamma + vector * W, g);
        if (dsum != nullptr && !kBiasDropout)
          incoming[k] = *reinterpret_cast<const Pack<T, W>*>(dsum + row * cols + vector * W);
#pragma unroll
        for (int i = 0; i < W; ++i) {
          xhat[k][i] = (xhat[k][i] - row_mean) * row_rstd;
          dg[k][i] = d[i] * g[i];
          sums[0] += dg[k][i];
          sums[1] += dg[k][i] * xhat[k][i];
          dgamma[k][i] += d[i] * xhat[k][i];
          dbeta[k][i] += d[i];
        }
      }
    }
    group_reduce<SumOp, 2>(sums, scratch);
    const float mean_dg = sums[0] * inv_cols;
    const float mean_dg_xhat = sums[1] * inv_cols;
#pragma unroll
    for (int k = 0; k < kVpt; ++k) {
      const int vector = threadIdx.x + k * blockDim.x;
      if (k < vpt && active && vector < vectors) {
        float out[W];
        if constexpr (kBiasDropout) incoming[k] = *reinterpret_cast<const Pack<T, W>*>(dsum + row * cols + vector * W);
#pragma unroll
        for (int i = 0; i < W; ++i) {
          out[i] = dsum != nullptr ? to_float(incoming[k].v[i]) : 0.0f;
          out[i] += row_rstd * (dg[k][i] - mean_dg - xhat[k][i] * mean_dg_xhat);
        }
        store_floats<W>(ds + row * cols + vector * W, out);
        if constexpr (kBiasDropout) {
#pragma unroll
          for (int i = 0; i < W; ++i) out[i] = round_to<T>(out[i]);
          if (drop) dropout.apply<W>(static_cast<uint64_t>(row * cols + vector * W), out);
#pragma unroll
          for (int i = 0; i < W; ++i) dbias[k][i] += out[i];
          store_floats<W>(dx + row * cols + vector * W, out);
        }
      }
    }
  }
  float* partial = partials + static_cast<int64_t>(blockIdx.x) * (kBiasDropout ? 3 : 2) * cols;
  write_block_partial<kVpt, W>(dgamma, threadIdx.x, vectors, vpt, shared, partial);
  write_block_partial<kVpt, W>(dbeta, threadIdx.x, vectors, vpt, shared, partial + cols);
  if constexpr (kBiasDropout)
    write_block_partial<kVpt, W>(dbias, threadIdx.x, vectors, vpt, shared, partial + 2 * cols);
}

struct BackwardArgs {
  const ffi::AnyBuffer& dy;
  const ffi::AnyBuffer* dsum;
  const ffi::AnyBuffer& s;
  const ffi::AnyBuffer& mean;
  const ffi::AnyBuffer& rstd;
  const ffi::AnyBuffer& gamma;
  ffi::AnyBuffer& ds;
  ffi::AnyBuffer& dgamma;
  ffi::AnyBuffer& dbeta;
  ffi::AnyBuffer& partials;
  ffi::AnyBuffer* dx;     // with dbias: the bias_dropout_residual targets
  ffi::AnyBuffer* dbias;
  DropoutParams dropout;
};

template <typename T, typename P, int W, bool kBiasDropout>
ffi::Error launch_backward(cudaStream_t stream, const BackwardArgs& a, int64_t rows, int64_t cols,
                           int64_t partial_rows) {
  const RowLayout layout = row_layout(cols, W, kBackwardBlockThreads);
  const size_t shared = static_cast<size_t>(layout.block.x) * layout.block.y * kPartialSharedBytes;
  float* partials = static_cast<float*>(a.partials.untyped_data());
  const auto kernel = layer_norm_bwd_kernel<T, P, W, kBiasDropout>;
  int64_t blocks = 0;
  LS_RETURN_IF_ERROR(
      resident_row_blocks(kernel, layout.block, shared, 1, partial_rows, ceil_div(rows, layout.block.y), blocks));
  kernel<<<static_cast<unsigned>(blocks), layout.block, shared, stream>>>(
      static_cast<const T*>(a.dy.untyped_data()), a.dsum ? static_cast<const T*>(a.dsum->untyped_data()) : nullptr,
      static_cast<const T*>(a.s.untyped_data()), static_cast<const float*>(a.mean.untyped_data()),
      static_cast<const float*>(a.rstd.untyped_data()), static_cast<const P*>(a.gamma.untyped_data()),
      static_cast<T*>(a.ds.untyped_data()), a.dx ? static_cast<T*>(a.dx->untyped_data()) : nullptr, partials, rows,
      cols, layout.vectors_per_thread, a.dropout);
  LS_RETURN_IF_ERROR(launch_error("layer_norm_bwd_kernel"));
  P* dbias = a.dbias ? static_cast<P*>(a.dbias->untyped_data()) : nullptr;
  const PartialOutputs<P> outputs{
      {static_cast<P*>(a.dgamma.untyped_data()), static_cast<P*>(a.dbeta.untyped_data()), dbias}, dbias ? 3 : 2};
  return sum_partials<P>(stream, partials, blocks, cols, outputs);
}

ffi::Error backward(cudaStream_t stream, const BackwardArgs& a) {
  if (a.dbias) {
    LS_RETURN_IF_ERROR(check_row_buffers(a.s, {&a.dy, a.dsum, &a.ds, a.dx}, {&a.gamma, &a.dgamma, &a.dbeta, a.dbias},
                                         {&a.mean, &a.rstd}));
  } else if (a.dsum) {
    LS_RETURN_IF_ERROR(check_row_buffers(a.s, {&a.dy, a.dsum, &a.ds}, {&a.gamma, &a.dgamma, &a.dbeta},
                                         {&a.mean, &a.rstd}));
  } else {
    LS_RETURN_IF_ERROR(check_row_buffers(a.s, {&a.dy, &a.ds}, {&a.gamma, &a.dgamma, &a.dbeta}, {&a.mean, &a.rstd}));
  }
  const int64_t rows = leading_rows(a.s.dimensions());
  const int64_t cols = last_dim(a.s.dimensions());
  int64_t partial_rows = 0;
  LS_RETURN_IF_ERROR(require_partials(a.partials, a.dbias ? 3 : 2, cols, partial_rows));
  return dispatch_float(a.s.element_type(), "s", [&](auto act) {
    using T = decltype(act);
    return dispatch_param<T>(a.gamma.element_type(), "gamma", [&](auto param) {
      using P = decltype(param);
      const bool vector = vectorizable<T>(cols, {&a.dy, a.dsum, &a.s, &a.gamma, &a.ds, a.dx});
      if (a.dbias) {
        if (vector) return launch_backward<T, P, kVecWidth<T>, true>(stream, a, rows, cols, partial_rows);
        return launch_backward<T, P, 1, true>(stream, a, rows, cols, partial_rows);
      }
      if (vector) return launch_backward<T, P, kVecWidth<T>, false>(stream, a, rows, cols, partial_rows);
      return launch_backward<T, P, 1, false>(stream, a, rows, cols, partial_rows);
    });
  });
}

ffi::Error layer_norm_bwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer s, ffi::AnyBuffer mean,
                          ffi::AnyBuffer rstd, ffi::AnyBuffer gamma, ffi::Result<ffi::AnyBuffer> ds,
                          ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta,
                          ffi::Result<ffi::AnyBuffer> partials) {
  return backward(stream,
                  {dy, nullptr, s, mean, rstd, gamma, *ds, *dgamma, *dbeta, *partials, nullptr, nullptr, kNoDropout});
}

ffi::Error layer_norm_add_bwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer dsum, ffi::AnyBuffer s,
                              ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::AnyBuffer gamma,
                              ffi::Result<ffi::AnyBuffer> ds, ffi::Result<ffi::AnyBuffer> dgamma,
                              ffi::Result<ffi::AnyBuffer> dbeta, ffi::Result<ffi::AnyBuffer> partials) {
  return backward(stream,
                  {dy, &dsum, s, mean, rstd, gamma, *ds, *dgamma, *dbeta, *partials, nullptr, nullptr, kNoDropout});
}

ffi::Error bias_dropout_residual_layer_norm_bwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer dsum,
                                                ffi::AnyBuffer s, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                                                ffi::AnyBuffer gamma, ffi::Buffer<ffi::U32> seed,
                                                ffi::Result<ffi::AnyBuffer> ds, ffi::Result<ffi::AnyBuffer> dx,
                                                ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta,
                                                ffi::Result<ffi::AnyBuffer> dbias,
                                                ffi::Result<ffi::AnyBuffer> partials, uint32_t threshold,
                                                float scale) {
  const DropoutParams dropout{seed.typed_data(), threshold, scale};
  LS_RETURN_IF_ERROR(require_dropout_seed(seed, dropout, s.element_count()));
  return backward(stream, {dy, &dsum, s, mean, rstd, gamma, *ds, *dgamma, *dbeta, *partials, &*dx, &*dbias, dropout});
}

}  // namespace

LS_FFI_TARGET(ls_layer_norm_fwd, layer_norm_fwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<float>("eps"));

LS_FFI_TARGET(ls_layer_norm_add_fwd, layer_norm_add_fwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<float>("eps"));

LS_FFI_TARGET(ls_layer_norm_bwd, layer_norm_bwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>());

LS_FFI_TARGET(ls_layer_norm_add_bwd, layer_norm_add_bwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>());

LS_FFI_TARGET(ls_bias_dropout_residual_layer_norm_fwd, bias_dropout_residual_layer_norm_fwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<float>("eps")
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

LS_FFI_TARGET(ls_bias_dropout_residual_layer_norm_bwd, bias_dropout_residual_layer_norm_bwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::Buffer<ffi::U32>>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<uint32_t>("threshold")
                  .Attr<float>("scale"));

}  // namespace ls
