// Label-smoothed cross entropy over the vocabulary, one block per row (math: ls_jax/ops/cross_entropy.py).
//
// Forward, one read of the row: each thread keeps a running maximum m, the sum of exp(z - m) and the plain sum
// of z over its elements; the block combines them into lse = m + log(sum exp(z - m)) and sum(z), and
//   nll  = lse - z[clip(label, 0, V - 1)]
//   loss = on_label * nll + off_label * (V * lse - sum(z))
// Backward, one read and one write of the row, in place: dlogits may be the logits' buffer (the Python wrapper
// aliases them), which is safe because the thread that writes an element is the one that read it, and reads it
// first. The logits and dlogits pointers are therefore not __restrict__.
//   dz_j = (g_loss + g_nll) * exp(z_j - lse) - g_loss * target_j - g_nll * [j == label]
//   target_j = on_label * [j == label] + off_label
// with on_label = 1 - eps - eps / (V - 1) and off_label = eps / (V - 1) rounded to f32 by the Python wrapper
// as the XLA implementation rounds them, and g_loss, g_nll f32 scalars read from device memory. Pad rows
// (label == pad_id when ignore_pad) are never read: their loss, nll, lse and gradient are zero.
//
// The logits stay in their storage dtype. A row of V elements rarely starts on a 16-byte boundary (V is often
// odd), so each row is a head of scalars up to its first 16-byte boundary, a body of 16-byte vectors (kUnroll
// of them in flight per thread) and a tail of scalars.
//
// Targets
//   ls_cross_entropy_fwd(logits (..., V), labels int32 (...)) -> (loss, nll, lse) f32 (...)
//   ls_cross_entropy_bwd(g_loss f32 (), g_nll f32 (), logits, labels, lse) -> dlogits (logits' shape and dtype,
//     may alias logits)
//   attributes on_label: f32, off_label: f32, pad_id: i64, ignore_pad: bool
#include "common.cuh"

namespace ls {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kUnroll = 4;
constexpr int kVectorsPerThread = 8;  // a row gets about this many 16-byte vectors per thread, up to kMaxThreads

struct Smoothing {
  float on_label;
  float off_label;
  int64_t pad_id;
  bool ignore_pad;

  __device__ __forceinline__ bool is_pad(int32_t label) const { return ignore_pad && label == pad_id; }
};

// A row seen as head scalars, 16-byte vectors, tail scalars: elements [0, head) are scalars, then `vectors`
// W-wide vectors, then the scalars [head + vectors * W, V).
struct RowSplit {
  int head;
  int64_t vectors;
  int tail;
};

template <typename T, int W>
__device__ __forceinline__ RowSplit split_row(const T* row, int64_t vocab) {
  if constexpr (W == 1) {
    return {0, vocab, 0};
  } else {
    const int misalignment = static_cast<int>(reinterpret_cast<uintptr_t>(row) % 16);
    const int64_t to_boundary = misalignment == 0 ? 0 : (16 - misalignment) / static_cast<int>(sizeof(T));
    const int64_t head = to_boundary < vocab ? to_boundary : vocab;
    const int64_t vectors = (vocab - head) / W;
    return {static_cast<int>(head), vectors, static_cast<int>(vocab - head - vectors * W)};
  }
}

// Calls body(index, value) for every element of the row that this thread owns: the vectors threadIdx.x,
// threadIdx.x + blockDim.x, ... (kUnroll loads issued before any body runs), then one head and one tail
// scalar for the first threads.
template <typename T, int W, typename Body>
__device__ __forceinline__ void for_each_owned(const T* row, int64_t vocab, Body&& body) {
  const RowSplit split = split_row<T, W>(row, vocab);
  const int64_t step = static_cast<int64_t>(kUnroll) * blockDim.x;
  for (int64_t first = threadIdx.x; first < split.vectors; first += step) {
    float v[kUnroll][W];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vector = first + static_cast<int64_t>(u) * blockDim.x;
      if (vector < split.vectors) load_floats<W>(row + split.head + vector * W, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vector = first + static_cast<int64_t>(u) * blockDim.x;
      if (vector < split.vectors) body.template vector<W>(split.head + vector * W, v[u]);
    }
  }
  if (static_cast<int>(threadIdx.x) < split.head) {
    float v[1] = {to_float(row[threadIdx.x])};
    body.template vector<1>(threadIdx.x, v);
  }
  if (static_cast<int>(threadIdx.x) < split.tail) {
    const int64_t index = vocab - split.tail + threadIdx.x;
    float v[1] = {to_float(row[index])};
    body.template vector<1>(index, v);
  }
}

template <typename T, int W>
__device__ __forceinline__ void zero_row(T* __restrict__ row, int64_t vocab) {
  const RowSplit split = split_row<T, W>(row, vocab);
  const float zeros[W] = {};
  for (int64_t vector = threadIdx.x; vector < split.vectors; vector += blockDim.x)
    store_vector<W>(row + split.head + vector * W, zeros);
  if (static_cast<int>(threadIdx.x) < split.head) row[threadIdx.x] = from_float<T>(0.0f);
  if (static_cast<int>(threadIdx.x) < split.tail) row[vocab - split.tail + threadIdx.x] = from_float<T>(0.0f);
}

// ---- forward --------------------------------------------------------------------------------------------

// A thread's running statistics of the logits it has seen.
struct RowStats {
  float max = -INFINITY;  // of the logits
  float sum_exp = 0.0f;   // of exp(z - max)
  float sum = 0.0f;       // of the logits

  template <int N>
  __device__ __forceinline__ void vector(int64_t, const float (&z)[N]) {
    float chunk_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      chunk_max = fmaxf(chunk_max, z[i]);
      sum += z[i];
    }
    if (chunk_max > max) {
      sum_exp *= expf(max - chunk_max);
      max = chunk_max;
    }
    if (max == -INFINITY) return;  // every logit so far is -inf: exp(z - max) would be NaN
#pragma unroll
    for (int i = 0; i < N; ++i) sum_exp += expf(z[i] - max);
  }
};

template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_fwd_kernel(const T* __restrict__ logits, const int32_t* __restrict__ labels,
                             float* __restrict__ loss, float* __restrict__ nll, float* __restrict__ lse,
                             int64_t vocab, Smoothing smoothing) {
  __shared__ float scratch[kGroupReduceScratch<2>];
  const int64_t row = blockIdx.x;
  const int32_t label = labels[row];
  if (smoothing.is_pad(label)) {  // uniform over the block, so no thread is left waiting at a barrier
    if (threadIdx.x == 0) loss[row] = nll[row] = lse[row] = 0.0f;
    return;
  }
  const T* z = logits + row * vocab;
  RowStats stats;
  for_each_owned<T, W>(z, vocab, stats);

  // logsumexp as XLA computes it: a maximum that is not finite is replaced by 0.
  float row_max = group_reduce<MaxOp>(stats.max, scratch);
  row_max = isfinite(row_max) ? row_max : 0.0f;
  float sums[2] = {stats.max == -INFINITY ? 0.0f : stats.sum_exp * expf(stats.max - row_max), stats.sum};
  group_reduce<SumOp, 2>(sums, scratch);
  if (threadIdx.x != 0) return;
  const float row_lse = logf(sums[0]) + row_max;
  const int64_t target = label < 0 ? 0 : label >= vocab ? vocab - 1 : label;
  const float row_nll = row_lse - to_float(z[target]);
  loss[row] = smoothing.on_label * row_nll + smoothing.off_label * (static_cast<float>(vocab) * row_lse - sums[1]);
  nll[row] = row_nll;
  lse[row] = row_lse;
}

// ---- backward -------------------------------------------------------------------------------------------

// Writes the gradient of the elements a thread owns.
template <typename T>
struct RowGradient {
  T* out;
  float lse;
  float g_total;     // g_loss + g_nll
  float g_loss;
  float g_nll;
  int32_t label;
  Smoothing smoothing;

  template <int N>
  __device__ __forceinline__ void vector(int64_t first, float (&z)[N]) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const bool is_label = first + i == label;
      const float target = is_label ? smoothing.on_label + smoothing.off_label : smoothing.off_label;
      z[i] = g_total * expf(z[i] - lse) - g_loss * target;
      if (is_label) z[i] -= g_nll;
    }
    store_vector<N>(out + first, z);
  }
};

template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_bwd_kernel(const float* __restrict__ g_loss, const float* __restrict__ g_nll,
                             const T* logits, const int32_t* __restrict__ labels,
                             const float* __restrict__ lse, T* dlogits, int64_t vocab,
                             Smoothing smoothing) {
  const int64_t row = blockIdx.x;
  const int32_t label = labels[row];
  T* out = dlogits + row * vocab;
  if (smoothing.is_pad(label)) {
    zero_row<T, W>(out, vocab);
    return;
  }
  const float gl = __ldg(g_loss), gn = __ldg(g_nll);
  for_each_owned<T, W>(logits + row * vocab, vocab, RowGradient<T>{out, lse[row], gl + gn, gl, gn, label, smoothing});
}

// ---- handlers -------------------------------------------------------------------------------------------

// Threads per row: about kVectorsPerThread vectors each, a whole number of warps, at most kMaxThreads.
unsigned threads_for(int64_t vocab, int width) {
  const int64_t wanted = round_up(ceil_div(ceil_div(vocab, width), kVectorsPerThread), 32);
  return static_cast<unsigned>(wanted < kMaxThreads ? wanted : kMaxThreads);
}

// The 16-byte width of T when every buffer starts 16-byte aligned, so that a row's head is the same in all.
template <typename T>
int vector_width(std::initializer_list<const void*> buffers) {
  for (const void* buffer : buffers)
    if (!is_aligned(buffer, 16)) return 1;
  return kVecWidth<T>;
}

ffi::Error check_rows(const ffi::AnyBuffer& logits, const ffi::AnyBuffer& labels, int64_t& rows, int64_t& vocab) {
  const auto dims = logits.dimensions();
  LS_RETURN_IF_ERROR(require(dims.size() >= 1, "logits must have a vocabulary axis"));
  rows = leading_rows(dims);
  vocab = last_dim(dims);
  LS_RETURN_IF_ERROR(require(vocab >= 2, "the vocabulary must have at least 2 classes, got " + std::to_string(vocab)));
  LS_RETURN_IF_ERROR(require(labels.element_type() == ffi::DataType::S32,
                             std::string("labels must be int32, got ") + dtype_name(labels.element_type())));
  LS_RETURN_IF_ERROR(require(static_cast<int64_t>(labels.element_count()) == rows,
                             "labels have shape " + shape_string(labels.dimensions()) + " but logits have " +
                                 shape_string(dims) + "; expected one label per row"));
  return require(rows <= 0x7fffffff, "cross entropy takes at most 2**31 - 1 rows, got " + std::to_string(rows));
}

ffi::Error check_row_values(std::string_view name, const ffi::AnyBuffer& buffer, int64_t rows) {
  return require(buffer.element_type() == ffi::DataType::F32 && static_cast<int64_t>(buffer.element_count()) == rows,
                 std::string(name) + " must be float32 with one value per row (" + std::to_string(rows) + "), got " +
                     dtype_name(buffer.element_type()) + shape_string(buffer.dimensions()));
}

ffi::Error cross_entropy_fwd(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                             ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> nll,
                             ffi::Result<ffi::AnyBuffer> lse, float on_label, float off_label, int64_t pad_id,
                             bool ignore_pad) {
  int64_t rows = 0, vocab = 0;
  LS_RETURN_IF_ERROR(check_rows(logits, labels, rows, vocab));
  LS_RETURN_IF_ERROR(check_row_values("loss", *loss, rows));
  LS_RETURN_IF_ERROR(check_row_values("nll", *nll, rows));
  LS_RETURN_IF_ERROR(check_row_values("lse", *lse, rows));
  if (rows == 0) return ffi::Error::Success();
  const Smoothing smoothing{on_label, off_label, pad_id, ignore_pad};
  return dispatch_float(logits.element_type(), "logits", [&](auto tag) {
    using T = decltype(tag);
    const auto launch = [&](auto width) {
      constexpr int W = decltype(width)::value;
      cross_entropy_fwd_kernel<T, W><<<rows, threads_for(vocab, W), 0, stream>>>(
          static_cast<const T*>(logits.untyped_data()), static_cast<const int32_t*>(labels.untyped_data()),
          static_cast<float*>(loss->untyped_data()), static_cast<float*>(nll->untyped_data()),
          static_cast<float*>(lse->untyped_data()), vocab, smoothing);
      return launch_error("cross_entropy_fwd_kernel");
    };
    if (vector_width<T>({logits.untyped_data()}) == 1) return launch(std::integral_constant<int, 1>{});
    return launch(std::integral_constant<int, kVecWidth<T>>{});
  });
}

ffi::Error cross_entropy_bwd(cudaStream_t stream, ffi::AnyBuffer g_loss, ffi::AnyBuffer g_nll,
                             ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer lse,
                             ffi::Result<ffi::AnyBuffer> dlogits, float on_label, float off_label, int64_t pad_id,
                             bool ignore_pad) {
  int64_t rows = 0, vocab = 0;
  LS_RETURN_IF_ERROR(check_rows(logits, labels, rows, vocab));
  LS_RETURN_IF_ERROR(check_row_values("lse", lse, rows));
  LS_RETURN_IF_ERROR(check_row_values("g_loss", g_loss, 1));
  LS_RETURN_IF_ERROR(check_row_values("g_nll", g_nll, 1));
  LS_RETURN_IF_ERROR(require_same_shape("dlogits", *dlogits, "logits", logits));
  LS_RETURN_IF_ERROR(require(dlogits->element_type() == logits.element_type(), "dlogits must have the logits' dtype"));
  if (rows == 0) return ffi::Error::Success();
  const Smoothing smoothing{on_label, off_label, pad_id, ignore_pad};
  return dispatch_float(logits.element_type(), "logits", [&](auto tag) {
    using T = decltype(tag);
    const auto launch = [&](auto width) {
      constexpr int W = decltype(width)::value;
      cross_entropy_bwd_kernel<T, W><<<rows, threads_for(vocab, W), 0, stream>>>(
          static_cast<const float*>(g_loss.untyped_data()), static_cast<const float*>(g_nll.untyped_data()),
          static_cast<const T*>(logits.untyped_data()), static_cast<const int32_t*>(labels.untyped_data()),
          static_cast<const float*>(lse.untyped_data()), static_cast<T*>(dlogits->untyped_data()), vocab,
          smoothing);
      return launch_error("cross_entropy_bwd_kernel");
    };
    if (vector_width<T>({logits.untyped_data(), dlogits->untyped_data()}) == 1)
      return launch(std::integral_constant<int, 1>{});
    return launch(std::integral_constant<int, kVecWidth<T>>{});
  });
}

}  // namespace

LS_FFI_TARGET(ls_cross_entropy_fwd, cross_entropy_fwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<float>("on_label")
                  .Attr<float>("off_label")
                  .Attr<int64_t>("pad_id")
                  .Attr<bool>("ignore_pad"));

LS_FFI_TARGET(ls_cross_entropy_bwd, cross_entropy_bwd,
              ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Arg<ffi::AnyBuffer>()
                  .Ret<ffi::AnyBuffer>()
                  .Attr<float>("on_label")
                  .Attr<float>("off_label")
                  .Attr<int64_t>("pad_id")
                  .Attr<bool>("ignore_pad"));

}  // namespace ls
