// Can a Hopper GEMM carry the feed-forward's bias + relu + dropout in its epilogue, and relu's backward in the
// backward GEMM's, at cuBLAS's rate? Times h = X W (R x N times N x F, bf16, f32 accumulation) as
//   cublas                  cuBLASLt, no epilogue (what the step runs today, then its bias_relu_dropout kernel)
//   cutlass <config>        CUTLASS's sm90 warp-specialized GEMMs (TMA), no epilogue, three tile configurations
//   bias+relu               D = relu(acc + b)
//   bias+relu+dropout       D = relu(z), z = keep ? s (acc + b) : -1, s = 1 / (1 - rate), the keep mask drawn
//                           beforehand, read as bits (CUTLASS's sub-byte load) or bytes (TMA)
//   backward (h read)       D = where(h > 0, s acc, 0), h the forward's output read by the epilogue: the backward
//                           needs no mask of its own (h > 0 exactly where the element was kept and positive)
//   stock relu bit mask     CUTLASS's LinCombPerColBiasEltActAux with a uint1b_t aux: relu(acc + b) and its mask
// and checks the dropout and backward epilogues against a host reference on 64 rows. Median of 50 timed calls.
//
// CUTLASS: the headers of the nvidia-cutlass wheel (4.2: cutlass_library/source).
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -I CUTLASS/include -I CUTLASS/tools/util/include \
//     -o /tmp/cutlass_ffn_epilogue_probe scripts/cutlass_ffn_epilogue_probe.cu -lcublasLt
//   /tmp/cutlass_ffn_epilogue_probe R N F        (default 8192 1024 4096: Transformer-big at 8192 tokens)
#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

#define CHECK(x)                                                                       \
  do {                                                                                 \
    auto status_ = (x);                                                                \
    if (int(status_) != 0) {                                                           \
      std::printf("error %s:%d: %s -> %d\n", __FILE__, __LINE__, #x, int(status_));   \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

using Bf16 = cutlass::bfloat16_t;
using Bits = cutlass::uint1b_t;
using RowMajorMN = Stride<int64_t, _1, int64_t>;  // (M, N, L), N contiguous
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// Tile, cluster and schedules of one kernel configuration.
template <class Tile_, class Cluster_, class KernelSchedule_, class EpilogueSchedule_>
struct Config {
  using Tile = Tile_;
  using Cluster = Cluster_;
  using KernelSchedule = KernelSchedule_;
  using EpilogueSchedule = EpilogueSchedule_;
  using EpilogueShape = cutlass::epilogue::collective::detail::EpilogueDescriptor<
      Tile, cutlass::epilogue::collective::EpilogueTileAuto, Bf16, Bf16, EpilogueSchedule>;
};
using Cooperative128x256 = Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                  cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Cooperative256x128 = Config<Shape<_256, _128, _64>, Shape<_1, _2, _1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                  cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Pingpong128x128 = Config<Shape<_128, _128, _64>, Shape<_1, _2, _1>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                               cutlass::epilogue::TmaWarpSpecialized>;

// z = keep ? x : -1: a dropped element becomes negative, so relu zeroes it.
template <class T>
struct KeepOrNegative {
  CUTLASS_HOST_DEVICE T operator()(T x, T keep) const { return keep != T(0) ? x : T(-1); }
};
template <class T, int N>
struct KeepOrNegative<cutlass::Array<T, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& x,
                                                      cutlass::Array<T, N> const& keep) const {
    cutlass::Array<T, N> z;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) z[i] = keep[i] != T(0) ? x[i] : T(-1);
    return z;
  }
};

// g where h > 0, else 0: relu's (and dropout's) backward read from the forward's output h itself.
template <class T>
struct WhereOutputPositive {
  CUTLASS_HOST_DEVICE T operator()(T g, T h) const { return h > T(0) ? g : T(0); }
};
template <class T, int N>
struct WhereOutputPositive<cutlass::Array<T, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& g,
                                                      cutlass::Array<T, N> const& h) const {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = h[i] > T(0) ? g[i] : T(0);
    return out;
  }
};

template <template <class> class Fn, class Output, class... Inputs>
using Node = fusion::Sm90EVT<fusion::Sm90Compute<Fn, Output, float, kRound>, Inputs...>;

template <class C>
struct Epilogues {
  using EpilogueTile = typename C::EpilogueShape::EpilogueTile;
  using Bias = fusion::Sm90RowBroadcast<0, typename C::Tile, Bf16, float, Stride<_0, _1, int64_t>, 8>;
  using Scale = fusion::Sm90ScalarBroadcast<float>;
  using KeepBits = fusion::Sm90AuxLoad<1, EpilogueTile, Bits, RowMajorMN, void, void, 128, false>;
  using KeepByteDescriptor =
      cutlass::epilogue::collective::detail::AuxLoadDescriptor<typename C::EpilogueShape, RowMajorMN, uint8_t>;
  using KeepBytes = fusion::Sm90AuxLoad<KeepByteDescriptor::Stages, EpilogueTile, uint8_t, RowMajorMN,
                                        typename KeepByteDescriptor::SmemLayoutAtom,
                                        typename KeepByteDescriptor::CopyOpS2R, 16, false>;
  using OutputDescriptor = cutlass::epilogue::collective::detail::AuxLoadDescriptor<typename C::EpilogueShape, RowMajorMN, Bf16>;
  using Output = fusion::Sm90AuxLoad<OutputDescriptor::Stages, EpilogueTile, Bf16, RowMajorMN,
                                     typename OutputDescriptor::SmemLayoutAtom, typename OutputDescriptor::CopyOpS2R, 8,
                                     false>;
  using Pre = Node<cutlass::plus, float, fusion::Sm90AccFetch, Bias>;
  // D = relu(acc + b)
  using Relu = Node<cutlass::epilogue::thread::ReLu, Bf16, Pre>;
  // D = relu(z), z = keep ? s (acc + b) : -1: bias, relu and dropout (keep bits drawn beforehand, s = 1 / (1 - rate))
  template <class Keep>
  using Dropout = Node<cutlass::epilogue::thread::ReLu, Bf16,
                       Node<KeepOrNegative, float, Node<cutlass::multiplies, float, Pre, Scale>, Keep>>;
  // D = where(h > 0, s acc, 0): the backward GEMM's epilogue, h the forward's output
  using Backward = Node<WhereOutputPositive, Bf16, Node<cutlass::multiplies, float, fusion::Sm90AccFetch, Scale>, Output>;
};

using PlainEpilogue = fusion::LinearCombination<Bf16, float, Bf16, float, kRound>;

template <class C, class Fusion>
struct Gemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename C::Tile, typename C::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 8, Bf16,
      cutlass::layout::RowMajor, 8, typename C::EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, cutlass::layout::RowMajor, 8, Bf16,
      cutlass::layout::RowMajor, 8, float, typename C::Tile, typename C::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename C::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  Device op;
  void* workspace = nullptr;

  // X (R x N) row-major, W (N x F) row-major, D (R x F) row-major.
  typename Device::Arguments arguments(int R, int N, int F, Bf16 const* x, Bf16 const* w, Bf16* d) {
    auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(R, N, 1));
    auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(F, N, 1));
    auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(R, F, 1));
    return {cutlass::gemm::GemmUniversalMode::kGemm,
            {R, F, N, 1},
            {x, stride_a, w, stride_b},
            {{}, nullptr, stride_d, d, stride_d}};
  }

  void prepare(typename Device::Arguments const& args) {
    CHECK(op.can_implement(args));
    size_t bytes = Device::get_workspace_size(args);
    if (bytes) CHECK(cudaMalloc(&workspace, bytes));
    CHECK(op.initialize(args, workspace));
  }
  void run() { CHECK(op.run()); }
};

template <class Launch>
float median_ms(Launch&& launch) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 10; ++i) launch();
  std::vector<float> times;
  for (int i = 0; i < 50; ++i) {
    cudaEventRecord(start);
    launch();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  CHECK(cudaGetLastError());
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

float bf16_value(Bf16 v) { return float(v); }

struct Problem {
  int R, N, F;
  float scale;
  Bf16 *x = nullptr, *w = nullptr, *b = nullptr, *h = nullptr, *d = nullptr;
  uint8_t *keep = nullptr, *keep_bytes = nullptr, *mask = nullptr;
};

template <class Run>
void report(Problem const& p, const char* name, Run&& run) {
  float ms = median_ms(run);
  std::printf("%-40s %8.4f ms  %6.1f TFLOP/s\n", name, ms, 2.0 * p.R * p.N * p.F / ms / 1e9);
}

template <class C>
void plain(Problem const& p, const char* name) {
  Gemm<C, PlainEpilogue> gemm;
  auto args = gemm.arguments(p.R, p.N, p.F, p.x, p.w, p.d);
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  gemm.prepare(args);
  report(p, name, [&] { gemm.run(); });
}

// Bias + relu, bias + relu + dropout into p.h, and the backward's epilogue reading p.h, in configuration C.
template <class C>
void fused(Problem const& p, const char* name) {
  using E = Epilogues<C>;
  char label[64];
  RowMajorMN stride = cutlass::make_cute_packed_stride(RowMajorMN{}, make_shape(p.R, p.F, 1));
  {
    Gemm<C, typename E::Relu> gemm;
    auto args = gemm.arguments(p.R, p.N, p.F, p.x, p.w, p.d);
    args.epilogue.thread = {{{}, {p.b, Bf16(0), {}}, {}}, {}};
    gemm.prepare(args);
    std::snprintf(label, sizeof(label), "%s bias+relu", name);
    report(p, label, [&] { gemm.run(); });
  }
  {
    Gemm<C, typename E::template Dropout<typename E::KeepBits>> gemm;
    auto args = gemm.arguments(p.R, p.N, p.F, p.x, p.w, p.d);
    args.epilogue.thread = {
        {{{{}, {p.b, Bf16(0), {}}, {}}, {{p.scale}}, {}}, {reinterpret_cast<Bits const*>(p.keep), Bits(0), stride}, {}},
        {}};
    gemm.prepare(args);
    std::snprintf(label, sizeof(label), "%s bias+relu+dropout, keep bits", name);
    report(p, label, [&] { gemm.run(); });
  }
  {
    Gemm<C, typename E::template Dropout<typename E::KeepBytes>> gemm;
    auto args = gemm.arguments(p.R, p.N, p.F, p.x, p.w, p.h);
    args.epilogue.thread = {{{{{}, {p.b, Bf16(0), {}}, {}}, {{p.scale}}, {}}, {p.keep_bytes, uint8_t(0), stride}, {}}, {}};
    gemm.prepare(args);
    std::snprintf(label, sizeof(label), "%s bias+relu+dropout, keep bytes", name);
    report(p, label, [&] { gemm.run(); });
  }
  {
    Gemm<C, typename E::Backward> gemm;
    auto args = gemm.arguments(p.R, p.N, p.F, p.x, p.w, p.d);
    args.epilogue.thread = {{{}, {{p.scale}}, {}}, {p.h, Bf16(0), stride}, {}};
    gemm.prepare(args);
    std::snprintf(label, sizeof(label), "%s backward (h read)", name);
    report(p, label, [&] { gemm.run(); });
  }
}

template <class C>
void stock_relu_mask(Problem const& p, const char* name) {
  using ReluMask = fusion::LinCombPerColBiasEltActAux<cutlass::layout::RowMajor, cutlass::epilogue::thread::ReLu, Bf16,
                                                      float, Bits, Bf16>;
  Gemm<C, ReluMask> gemm;
  auto args = gemm.arguments(p.R, p.N, p.F, p.x, p.w, p.d);
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.thread.bias_ptr = p.b;
  args.epilogue.thread.aux_ptr = reinterpret_cast<Bits*>(p.mask);
  args.epilogue.thread.dAux = cutlass::make_cute_packed_stride(RowMajorMN{}, make_shape(p.R, p.F, 1));
  gemm.prepare(args);
  report(p, name, [&] { gemm.run(); });
}

int main(int argc, char** argv) {
  Problem p;
  p.R = 8192, p.N = 1024, p.F = 4096, p.scale = 1.0f / 0.9f;
  if (argc > 3) p.R = std::atoi(argv[1]), p.N = std::atoi(argv[2]), p.F = std::atoi(argv[3]);
  const int R = p.R, N = p.N, F = p.F;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::bernoulli_distribution kept(0.9);
  std::vector<Bf16> x(size_t(R) * N), w(size_t(N) * F), b(F);
  for (auto& v : x) v = Bf16(normal(rng));
  for (auto& v : w) v = Bf16(normal(rng) / std::sqrt(float(N)));
  for (auto& v : b) v = Bf16(0.1f * normal(rng));
  std::vector<uint8_t> keep(size_t(R) * F / 8, 0);
  for (size_t i = 0; i < keep.size() * 8; ++i)
    if (kept(rng)) keep[i / 8] |= uint8_t(1u << (i % 8));
  CHECK(cudaMalloc(&p.x, x.size() * 2));
  CHECK(cudaMalloc(&p.w, w.size() * 2));
  CHECK(cudaMalloc(&p.b, b.size() * 2));
  CHECK(cudaMalloc(&p.h, size_t(R) * F * 2));
  CHECK(cudaMalloc(&p.d, size_t(R) * F * 2));
  CHECK(cudaMalloc(&p.keep, keep.size()));
  CHECK(cudaMalloc(&p.mask, keep.size()));
  std::vector<uint8_t> keep_bytes(keep.size() * 8);
  for (size_t i = 0; i < keep_bytes.size(); ++i) keep_bytes[i] = keep[i / 8] >> (i % 8) & 1;
  CHECK(cudaMalloc(&p.keep_bytes, keep_bytes.size()));
  CHECK(cudaMemcpy(p.keep_bytes, keep_bytes.data(), keep_bytes.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(p.x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(p.w, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(p.b, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(p.keep, keep.data(), keep.size(), cudaMemcpyHostToDevice));
  std::printf("R %d, N %d, F %d, bf16 (the backward row multiplies the same operands)\n", R, N, F);

  {  // cuBLASLt: column-major D^T (F x R) = W^T (F x N) X^T (N x R), no transposes.
    cublasLtHandle_t handle;
    CHECK(cublasLtCreate(&handle));
    cublasLtMatmulDesc_t desc;
    CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasLtMatrixLayout_t la, lb, ld;
    CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, F, N, F));
    CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, N, R, N));
    CHECK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, F, R, F));
    size_t workspace_bytes = 32 << 20;
    void* workspace;
    CHECK(cudaMalloc(&workspace, workspace_bytes));
    cublasLtMatmulPreference_t pref;
    CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                               sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t heuristic;
    int found = 0;
    CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, 1, &heuristic, &found));
    const float one = 1.0f, zero = 0.0f;
    report(p, "cublas", [&] {
      cublasLtMatmul(handle, desc, &one, p.w, la, p.x, lb, &zero, p.d, ld, p.d, ld, &heuristic.algo, workspace,
                     workspace_bytes, 0);
    });
  }
  plain<Pingpong128x128>(p, "cutlass pingpong 128x128");
  plain<Cooperative256x128>(p, "cutlass cooperative 256x128");
  plain<Cooperative128x256>(p, "cutlass cooperative 128x256");
  stock_relu_mask<Cooperative128x256>(p, "  128x256 stock relu bit mask");
  fused<Cooperative256x128>(p, "  256x128");
  fused<Cooperative128x256>(p, "  128x256");

  // The last two runs against the host on the first 64 rows: h from the dropout epilogue (keep bytes), d from the
  // backward's.
  const int rows = 64;
  std::vector<Bf16> h(size_t(rows) * F), d(size_t(rows) * F);
  CHECK(cudaMemcpy(h.data(), p.h, h.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(d.data(), p.d, d.size() * 2, cudaMemcpyDeviceToHost));
  double worst_h = 0, worst_d = 0;
  long near_zero = 0;
  for (int r = 0; r < rows; ++r) {
    for (int f = 0; f < F; ++f) {
      double acc = 0;
      for (int n = 0; n < N; ++n) acc += double(bf16_value(x[size_t(r) * N + n])) * bf16_value(w[size_t(n) * F + f]);
      size_t i = size_t(r) * F + f;
      double pre = acc + bf16_value(b[f]);
      bool keep_bit = keep[i / 8] >> (i % 8) & 1;
      if (std::abs(pre) < 1e-3) {
        ++near_zero;
        continue;
      }
      double expected_h = keep_bit && pre > 0 ? pre * p.scale : 0.0;
      double expected_d = bf16_value(h[i]) > 0 ? acc * p.scale : 0.0;
      worst_h = std::max(worst_h, std::abs(bf16_value(h[i]) - expected_h) / (1.0 + std::abs(expected_h)));
      worst_d = std::max(worst_d, std::abs(bf16_value(d[i]) - expected_d) / (1.0 + std::abs(expected_d)));
    }
  }
  std::printf("check (%d rows, %ld near 0 not judged): largest error h %.2e, backward %.2e (bf16 rounding ~4e-3)\n",
              rows, near_zero, worst_h, worst_d);
  return worst_h < 1.6e-2 && worst_d < 1.6e-2 ? 0 : 1;
}
