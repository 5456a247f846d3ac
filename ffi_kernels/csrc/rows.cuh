// Thread layouts for kernels over (rows, cols) tensors and the deterministic second stage of column sums.
#pragma once

#include <algorithm>

#include "common.cuh"

namespace ls {

// ---- whole rows in registers (LayerNorm) ----------------------------------------------------------------

// Elements of one row a thread keeps in registers; with up to 1024 threads per row this bounds rows at 8192.
inline constexpr int kMaxRowElements = 8;
inline constexpr int64_t kMaxRowLength = 1024 * kMaxRowElements;

// A row group of block.x threads (a multiple of 32) holds one row: thread t owns the W-wide column vectors
// t, t + block.x, ... (vectors_per_thread of them, at most kMaxRowElements / W); block.y row groups per block.
struct RowLayout {
  int vectors_per_thread;
  dim3 block;
};

inline RowLayout row_layout(int64_t cols, int width, int block_threads) {
  const int64_t vectors = cols / width;
  const int64_t per_thread = ceil_div(vectors, 1024);
  const int64_t group = round_up(ceil_div(vectors, per_thread), 32);
  const int64_t groups = group < block_threads ? block_threads / group : 1;
  return {static_cast<int>(per_thread), dim3(static_cast<unsigned>(group), static_cast<unsigned>(groups))};
}

// ---- one vector per thread per row (elementwise, bias gradients, embeddings) ----------------------------

// Thread (x, y) of block (bx, by) owns column vector by * block.x + x (a W-wide vector) and visits rows
// block.y * bx + y, stepping by block.y * grid.x. grid.y covers the column chunks; grid.x is the caller's.
inline ffi::Error strip_layout(int64_t vectors, int block_threads, dim3& block, unsigned& column_chunks) {
  const int64_t width = vectors < block_threads ? round_up(vectors, 32) : block_threads;
  const int64_t chunks = ceil_div(vectors, width);
  LS_RETURN_IF_ERROR(require(chunks <= 65535, "rows of " + std::to_string(vectors) + " vectors are too long"));
  block = dim3(static_cast<unsigned>(width), static_cast<unsigned>(block_threads / width));
  column_chunks = static_cast<unsigned>(chunks);
  return ffi::Error::Success();
}

// ---- column sums: per-block partial rows, then one fixed-order reduction -------------------------------

// Adds up the blockDim.y row groups' column sums and writes them, from row group 0, to `partial_row`.
// acc[k][i] is the calling thread's sum for column (first_vector + k * blockDim.x) * W + i, for k < vpt and
// column vectors below `vectors`. Every thread of the block must call it. `shared`: blockDim.x * blockDim.y *
// kVpt * W floats (at most kPartialSharedBytes per thread).
template <int kVpt, int W>
__device__ __forceinline__ void write_block_partial(const float (&acc)[kVpt][W], int64_t first_vector,
                                                    int64_t vectors, int vpt, float* shared,
                                                    float* __restrict__ partial_row) {
  constexpr int kSlot = kVpt * W;
  if (blockDim.y > 1) {
    float* mine = shared + (threadIdx.y * blockDim.x + threadIdx.x) * kSlot;
    __syncthreads();  // shared may still hold values of an earlier use
#pragma unroll
    for (int k = 0; k < kVpt; ++k) {
#pragma unroll
      for (int i = 0; i < W; ++i) mine[k * W + i] = acc[k][i];
    }
    __syncthreads();
  }
  if (threadIdx.y != 0) return;
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    const int64_t vector = first_vector + static_cast<int64_t>(k) * blockDim.x;
    if (k >= vpt || vector >= vectors) continue;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      float total = acc[k][i];
      for (unsigned y = 1; y < blockDim.y; ++y) total += shared[(y * blockDim.x + threadIdx.x) * kSlot + k * W + i];
      partial_row[vector * W + i] = total;
    }
  }
}

// Shared memory per thread that write_block_partial needs at most (kVpt * W <= kMaxRowElements).
inline constexpr int kPartialSharedBytes = kMaxRowElements * sizeof(float);

constexpr int kSumPartialsCols = 32;
constexpr int kSumPartialsLanes = 32;
constexpr int kMaxPartialOutputs = 3;

// The (cols,) outputs of sum_partials: outputs j < count receive partial rows j.
template <typename OutT>
struct PartialOutputs {
  OutT* out[kMaxPartialOutputs];
  int count;
};

// out_j[c] = sum over p of partials[p, j, c] (j < outputs.count, p < num_partials), in a fixed order.
template <typename OutT>
__global__ void __launch_bounds__(kSumPartialsCols* kSumPartialsLanes)
    sum_partials_kernel(const float* __restrict__ partials, int64_t num_partials, int64_t cols,
                        PartialOutputs<OutT> outputs) {
  __shared__ float lanes[kSumPartialsLanes][kSumPartialsCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kSumPartialsCols + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.y) * cols;
  const float* column = partials + blockIdx.y * cols + col;
  float total = 0.0f;
  if (col < cols) {
    for (int64_t p = threadIdx.y; p < num_partials; p += kSumPartialsLanes) total += column[p * stride];
  }
  lanes[threadIdx.y][threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.y != 0 || col >= cols) return;
  for (int lane = 1; lane < kSumPartialsLanes; ++lane) total += lanes[lane][threadIdx.x];
  outputs.out[blockIdx.y][col] = from_float<OutT>(total);
}

// Reduces partials [num_partials, outputs.count, cols] into the outputs.
template <typename OutT>
ffi::Error sum_partials(cudaStream_t stream, const float* partials, int64_t num_partials, int64_t cols,
                        PartialOutputs<OutT> outputs) {
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, kSumPartialsCols)), static_cast<unsigned>(outputs.count));
  sum_partials_kernel<OutT>
      <<<grid, dim3(kSumPartialsCols, kSumPartialsLanes), 0, stream>>>(partials, num_partials, cols, outputs);
  return launch_error("sum_partials_kernel");
}

// Row blocks of a column-reducing backward: as many as the GPU runs at once (CUDA's occupancy calculator for
// `kernel` at this block size and shared memory, shared by the `column_chunks` blocks of a row block), but no more
// than the scratch's `partial_rows` nor than the `row_groups` of block.y rows there are to visit. One full wave: a
// grid past it leaves a partial second wave that holds every SM up for its few blocks (the bias_act_dropout
// backward at 8192 x 4096 ran 1.33 waves), and a grid below it leaves threads idle.
template <typename Kernel>
ffi::Error resident_row_blocks(Kernel kernel, dim3 block, size_t shared, unsigned column_chunks,
                               int64_t partial_rows, int64_t row_groups, int64_t& blocks) {
  int sms = 0;
  LS_RETURN_IF_ERROR(sm_count(sms));
  int per_sm = 0;
  const int threads = static_cast<int>(block.x * block.y);
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared) != cudaSuccess)
    return ffi::Error::Internal("cannot query the occupancy of a column-reducing kernel");
  const int64_t resident = static_cast<int64_t>(per_sm) * sms / column_chunks;
  blocks = std::max<int64_t>(1, std::min({resident, partial_rows, row_groups}));
  return ffi::Error::Success();
}

// The f32 scratch output of a column-reducing kernel: [blocks, outputs, cols] with blocks >= 1.
inline ffi::Error require_partials(const ffi::AnyBuffer& partials, int outputs, int64_t cols, int64_t& blocks) {
  const auto dims = partials.dimensions();
  const bool ok = partials.element_type() == ffi::DataType::F32 && dims.size() == 3 && dims[0] >= 1 &&
                  dims[0] <= 0x7fffffff && dims[1] == outputs && dims[2] == cols;
  blocks = ok ? dims[0] : 0;
  return require(ok, "scratch partials must be float32 (blocks, " + std::to_string(outputs) + ", " +
                         std::to_string(cols) + "), got " + dtype_name(partials.element_type()) +
                         shape_string(dims));
}

}  // namespace ls
