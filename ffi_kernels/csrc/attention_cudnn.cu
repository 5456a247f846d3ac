// Attention of any length through cuDNN's fused flash attention (SDPA), forward and backward, called from this
// library's own FFI handlers with cuDNN frontend graphs (math: ls_jax/ops/attention_cudnn.py).
//
//   logits = q k^T * logit_scale + mask_bias, -inf for keys at or past seq_len_kv and (causal) k > q + K - Q
//   stats  = log sum_k exp(logits)   (natural log, f32 (B, H, Q, 1))
//   out    = dropout(softmax(logits)) v
//
// cuDNN reads and writes every operand through strides, so nothing is copied: q is part 0 of query_source
// (B, Q, P, H, D) and k, v are parts P - 2 and P - 1 of key_value_source (B, K, P', H, D) (a packed
// self-attention qkv is passed as both), out is (B, Q, H, D), and the backward writes dq, dk and dv straight
// into the gradient of each source. Dropout is cuDNN's own Philox generator keyed by (seed, offset) read from
// device memory, so a new seed each step needs neither a new graph nor a host synchronization; its elements
// differ from this library's Philox kernels. Key masks come in two forms: right padding as sequence lengths
// (seq_len_q, seq_len_kv: cuDNN's padding mask, keys at or past seq_len_kv skipped, no bias tensor), and any other
// mask as those lengths (seq_len_kv = 1 + the last visible key) plus an additive (B, 1, 1, K) bias (0 or a large
// negative value) that masks the remaining keys, so every mask is exact and prefix masks skip their padding.
//
// Targets
//   ls_attention_cudnn_fwd(query_source, key_value_source, seed u32[2] [, seq_len_q s32 (B,), seq_len_kv s32 (B,)
//       [, mask_bias T (B, K_pad)]]) -> (out T (B, Q, H, D), stats f32 (B, H, Q, 1))
//   ls_attention_cudnn_bwd(dout, query_source, key_value_source, out, stats, seed [, seq_len_q, seq_len_kv
//       [, mask_bias]]) -> (d_query_source [, d_key_value_source]); without d_key_value_source the sources are one
//       packed qkv (P = 3) and d_query_source receives dq, dk and dv.
//   Attributes: causal (bool), dropout_rate (f32), logit_scale (f32). T is bf16 or f16; D a multiple of 8.
//   seed element 0 is cuDNN's Philox seed and element 1 its offset. seq_len_kv is in [1, K]. mask_bias rows are
//   padded to a multiple of 8 elements (16 bytes); only the first K of each row are read.
//
// Stages. Each target has an initialize-stage handler besides its execute handler. XLA calls the initialize stage
// before each execution of the executable, with the operands' buffers assigned (not yet written), the stream and the
// device; it checks the operands and builds this configuration's graph (heuristics, kernel compilation and loading:
// milliseconds to seconds) unless the cache already holds it, and then takes the workspace from the pool once, so the
// execute handler only looks the graph up and enqueues it. The instantiate stage, which XLA runs when it creates the
// executable, cannot build a graph: it has neither the operands nor a device (an executable may run on any device of
// the process, and a cuDNN graph is built for one). An execute handler that finds no graph (a path that skipped the
// initialize stage) builds it itself, counted by ls_attention_cudnn_graphs_built_in_execute.
// Graphs are cached per (direction, device, dtype, shape and layout, causal, dropout, logit scale, padding, bias);
// one cuDNN handle per device.
//
// Not declared command-buffer compatible: the workspace (and the widened dropout seed) is allocated and freed
// stream-ordered around each execution from this library's pool (see "workspace" below for why). Under stream
// capture those calls become graph memory-allocation and free nodes, and XLA records a custom call inside its command
// buffer by capturing it into a graph that it embeds as a cloned child graph, which CUDA refuses for graphs holding
// memory nodes (a child graph with them must be moved into its parent, and such graphs cannot be cloned).
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.cuh"

namespace ls {
namespace {

namespace fe = ::cudnn_frontend;
using GraphPtr = std::shared_ptr<fe::graph::Graph>;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// Tensor uids of the variant pack.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSeqLenQ, kSeqLenKV, kMaskBias, kSeed, kOffset,
};

// Bytes reserved at the start of each allocation for the int64 seed and offset (seed at byte 0, offset at byte
// kOffsetBytes); cuDNN's workspace follows at a 256-byte boundary, as the pool's allocations start at one.
constexpr size_t kSeedBytes = 256;
constexpr size_t kOffsetBytes = 16;

// ---- layout ------------------------------------------------------------------------------------------------

struct Layout {
  int64_t batch, queries, keys, heads, head_dim;
  int64_t query_parts, key_value_parts;  // P of query_source (1 or 3) and of key_value_source (2 or 3)
  int64_t bias_row;                      // elements per mask_bias row, 0 without a key mask
};

using Dims = std::vector<int64_t>;

// (b, h, s, d) dims and strides of one part of a (B, S, P, H, D) source.
Dims source_dims(const Layout& l, int64_t length) { return {l.batch, l.heads, length, l.head_dim}; }
Dims source_strides(const Layout& l, int64_t length, int64_t parts) {
  const int64_t row = parts * l.heads * l.head_dim;
  return {length * row, l.head_dim, row, 1};
}
Dims out_strides(const Layout& l) {
  return {l.queries * l.heads * l.head_dim, l.head_dim, l.heads * l.head_dim, 1};
}
Dims stats_dims(const Layout& l) { return {l.batch, l.heads, l.queries, 1}; }
Dims stats_strides(const Layout& l) { return {l.heads * l.queries, l.queries, 1, 1}; }

struct Options {
  bool causal;
  float dropout_rate;
  float logit_scale;
  bool padded;  // seq_len_q and seq_len_kv given: cuDNN's padding mask
  bool biased;  // mask_bias given (an arbitrary key mask; implies padded)
};

// ---- errors ------------------------------------------------------------------------------------------------

ffi::Error frontend_error(const char* step, fe::error_t status) {
  return ffi::Error::Internal(std::string("cuDNN attention: ") + step + " failed: " + status.get_message());
}

#define LS_RETURN_IF_FE_ERROR(step, expr)                     \
  do {                                                        \
    fe::error_t ls_status_ = (expr);                          \
    if (ls_status_.is_bad()) return frontend_error(step, ls_status_); \
  } while (0)

ffi::Error cudnn_status_error(const char* step, cudnnStatus_t status) {
  return ffi::Error::Internal(std::string("cuDNN attention: ") + step + " failed: " + cudnnGetErrorString(status));
}

ffi::Error cuda_status_error(const char* step, cudaError_t status) {
  return ffi::Error::Internal(std::string("cuDNN attention: ") + step + " failed: " + cudaGetErrorString(status));
}

// ---- device and handle -------------------------------------------------------------------------------------

// Makes `device` current for the scope (graph building queries the current device's architecture).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      status_ = cudaSetDevice(device);
      switched_ = status_ == cudaSuccess;
    }
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = 0;
  bool switched_ = false;
  cudaError_t status_ = cudaSuccess;
};

// ---- workspace ---------------------------------------------------------------------------------------------
//
// cuDNN's workspace (bytes: the built graph's get_workspace_size, known only after the graph is built on the device)
// comes from a CUDA memory pool of this library, allocated with cudaMallocFromPoolAsync and freed with
// cudaFreeAsync on the FFI stream right after the graph is enqueued. The options weighed:
//  - XLA's FFI ScratchAllocator: on the H100 (jax 0.11.2) it returned no memory for any request, 64 or 256-byte
//    aligned (ffi_kernels/NOTES.md), so no call could run.
//  - The workspace as an extra XLA output sized at trace time: the size depends on the execution plan cuDNN's
//    heuristics pick for this GPU and cuDNN version, so tracing would have to build the graph on a GPU (no lowering
//    for another platform or ahead of time), and a traced size that disagreed with the built graph would let cuDNN
//    write past the buffer.
//  - One cached per-device buffer grown on demand: growing may not free the old buffer while kernels enqueued
//    earlier still use it (a device synchronization, or a stream-ordered free, which is what a pool does), and two
//    streams sharing one buffer would race.
//  - Stream-ordered allocation (chosen): the free is ordered after the graph's kernels on the stream, so the memory
//    is handed out again only once they are done (to another stream, only after an event dependency the pool adds);
//    no host synchronization. The pool is this library's own, not the device's default pool (which XLA's
//    cuda_async allocator configures), and keeps what it once held (release threshold: unlimited), so after the
//    first step an allocation is a lookup in the pool rather than a cudaMalloc. Its memory lies outside XLA's
//    preallocated fraction (XLA_PYTHON_CLIENT_MEM_FRACTION), at most the largest workspace seen plus kSeedBytes.

struct DeviceState {
  std::mutex mutex;  // guards the handle's stream between cudnnSetStream and the enqueue
  cudnnHandle_t handle = nullptr;
  cudaMemPool_t pool = nullptr;
};

// A pool of device memory on `device` that keeps its memory between allocations.
ffi::Error create_pool(int device, cudaMemPool_t* pool) {
  int supported = 0;
  const cudaError_t query = cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device);
  if (query != cudaSuccess) return cuda_status_error("cudaDeviceGetAttribute(cudaDevAttrMemoryPoolsSupported)", query);
  if (!supported) {
    return ffi::Error::Internal("cuDNN attention: device " + std::to_string(device) +
                                " does not support CUDA memory pools (cudaMallocAsync), from which the workspace is "
                                "allocated; set LS_JAX_CUDNN_ATTENTION=0 to run the unfused attention instead");
  }
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  const cudaError_t created = cudaMemPoolCreate(pool, &props);
  if (created != cudaSuccess) return cuda_status_error("cudaMemPoolCreate", created);
  cuuint64_t keep_everything = ~cuuint64_t{0};
  const cudaError_t set = cudaMemPoolSetAttribute(*pool, cudaMemPoolAttrReleaseThreshold, &keep_everything);
  if (set != cudaSuccess) return cuda_status_error("cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)", set);
  return ffi::Error::Success();
}

struct Registry {
  std::mutex mutex;
  std::map<int, std::unique_ptr<DeviceState>> states;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

// The state of `device`, its handle and pool created on first use (both live as long as the process).
ffi::Error device_state(int device, DeviceState** state) {
  Registry& all = registry();
  std::lock_guard<std::mutex> lock(all.mutex);
  std::unique_ptr<DeviceState>& entry = all.states[device];
  if (!entry) {
    auto created = std::make_unique<DeviceState>();
    LS_RETURN_IF_ERROR(create_pool(device, &created->pool));
    const cudnnStatus_t status = cudnnCreate(&created->handle);
    if (status != CUDNN_STATUS_SUCCESS) {
      cudaMemPoolDestroy(created->pool);
      return cudnn_status_error("cudnnCreate", status);
    }
    entry = std::move(created);
  }
  *state = entry.get();
  return ffi::Error::Success();
}

// kSeedBytes for the widened seed followed by `workspace_bytes`, from the device's pool in the order of `stream`;
// freed (stream-ordered) when it goes out of scope.
class StreamAllocation {
 public:
  explicit StreamAllocation(cudaStream_t stream) : stream_(stream) {}
  StreamAllocation(const StreamAllocation&) = delete;
  StreamAllocation& operator=(const StreamAllocation&) = delete;
  ~StreamAllocation() {
    if (memory_ != nullptr) cudaFreeAsync(memory_, stream_);
  }

  ffi::Error allocate(cudaMemPool_t pool, int device, size_t workspace_bytes) {
    const size_t total = kSeedBytes + workspace_bytes;
    const cudaError_t status = cudaMallocFromPoolAsync(&memory_, total, pool, stream_);
    if (status == cudaSuccess) return ffi::Error::Success();
    memory_ = nullptr;
    cudaGetLastError();  // the failed allocation is not a fault of the next kernel launch
    return ffi::Error::Internal(
        "cuDNN attention: cannot allocate " + std::to_string(total) + " bytes of workspace on device " +
        std::to_string(device) + " (" + cudaGetErrorString(status) + "); it comes from the memory XLA did not "
        "preallocate: lower XLA_PYTHON_CLIENT_MEM_FRACTION, or the batch or length");
  }
  int64_t* seed() const { return static_cast<int64_t*>(memory_); }
  int64_t* offset() const { return reinterpret_cast<int64_t*>(static_cast<char*>(memory_) + kOffsetBytes); }
  void* workspace() const { return static_cast<char*>(memory_) + kSeedBytes; }

 private:
  cudaStream_t stream_;
  void* memory_ = nullptr;
};

// ---- graphs ------------------------------------------------------------------------------------------------

fe::DataType_t frontend_dtype(ffi::DataType dtype) {
  return dtype == ffi::DataType::BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
}

TensorPtr add_tensor(const GraphPtr& graph, int64_t uid, const char* name, const Dims& dims, const Dims& strides) {
  return graph->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims).set_stride(strides));
}

TensorPtr add_typed_tensor(const GraphPtr& graph, int64_t uid, const char* name, const Dims& dims,
                           const Dims& strides, fe::DataType_t dtype) {
  return graph->tensor(fe::graph::Tensor_attributes()
                           .set_name(name)
                           .set_uid(uid)
                           .set_dim(dims)
                           .set_stride(strides)
                           .set_data_type(dtype));
}

struct MaskTensors {
  TensorPtr seq_len_q, seq_len_kv, bias, seed, offset;
};

// The optional inputs every graph of `options` shares: sequence lengths and bias of the key mask, and the
// Philox seed and offset of the dropout.
MaskTensors add_mask_tensors(const GraphPtr& graph, const Layout& l, const Options& options) {
  MaskTensors t;
  if (options.padded) {
    const Dims lengths = {l.batch, 1, 1, 1}, unit = {1, 1, 1, 1};
    t.seq_len_q = add_typed_tensor(graph, kSeqLenQ, "seq_len_q", lengths, unit, fe::DataType_t::INT32);
    t.seq_len_kv = add_typed_tensor(graph, kSeqLenKV, "seq_len_kv", lengths, unit, fe::DataType_t::INT32);
  }
  if (options.biased) {
    // (B, 1, Q, K) broadcast over heads and queries with zero strides.
    t.bias = add_tensor(graph, kMaskBias, "mask_bias", {l.batch, 1, l.queries, l.keys}, {l.bias_row, l.bias_row, 0, 1});
  }
  if (options.dropout_rate > 0.0f) {
    const Dims unit = {1, 1, 1, 1};
    t.seed = add_typed_tensor(graph, kSeed, "seed", unit, unit, fe::DataType_t::INT64);
    t.offset = add_typed_tensor(graph, kOffset, "offset", unit, unit, fe::DataType_t::INT64);
  }
  return t;
}

// Masks and dropout on either direction's attributes (SDPA_attributes or SDPA_backward_attributes).
template <typename Attributes>
void apply_options(Attributes& attributes, const Layout& l, const Options& options, const MaskTensors& t) {
  attributes.set_attn_scale(options.logit_scale);
  if (options.causal) {
    // Q == K: the diagonal from the top left. Q < K (no key mask, no dropout): from the bottom right.
    if (l.queries == l.keys) {
      attributes.set_causal_mask(true);
    } else {
      attributes.set_causal_mask_bottom_right(true);
    }
  }
  if (options.padded) {
    attributes.set_padding_mask(true).set_seq_len_q(t.seq_len_q).set_seq_len_kv(t.seq_len_kv);
  }
  if (options.biased) attributes.set_bias(t.bias);
  if (options.dropout_rate > 0.0f) attributes.set_dropout(options.dropout_rate, t.seed, t.offset);
}

ffi::Error finish_graph(const GraphPtr& graph, cudnnHandle_t handle) {
  LS_RETURN_IF_FE_ERROR("validate", graph->validate());
  LS_RETURN_IF_FE_ERROR("build_operation_graph", graph->build_operation_graph(handle));
  LS_RETURN_IF_FE_ERROR("create_execution_plans",
                        graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}));
  LS_RETURN_IF_FE_ERROR("check_support", graph->check_support(handle));
  LS_RETURN_IF_FE_ERROR("build_plans", graph->build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE));
  return ffi::Error::Success();
}

ffi::Error build_forward(const Layout& l, const Options& options, ffi::DataType dtype, cudnnHandle_t handle,
                         GraphPtr* out) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(frontend_dtype(dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto q = add_tensor(graph, kQ, "q", source_dims(l, l.queries), source_strides(l, l.queries, l.query_parts));
  auto k = add_tensor(graph, kK, "k", source_dims(l, l.keys), source_strides(l, l.keys, l.key_value_parts));
  auto v = add_tensor(graph, kV, "v", source_dims(l, l.keys), source_strides(l, l.keys, l.key_value_parts));
  const MaskTensors masks = add_mask_tensors(graph, l, options);
  auto attributes = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true);
  apply_options(attributes, l, options, masks);
  auto [o, stats] = graph->sdpa(q, k, v, attributes);
  o->set_output(true).set_uid(kO).set_dim(source_dims(l, l.queries)).set_stride(out_strides(l));
  stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(stats_dims(l))
      .set_stride(stats_strides(l));
  LS_RETURN_IF_ERROR(finish_graph(graph, handle));
  *out = std::move(graph);
  return ffi::Error::Success();
}

ffi::Error build_backward(const Layout& l, const Options& options, ffi::DataType dtype, cudnnHandle_t handle,
                          GraphPtr* out) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(frontend_dtype(dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const Dims q_dims = source_dims(l, l.queries), q_strides = source_strides(l, l.queries, l.query_parts);
  const Dims kv_dims = source_dims(l, l.keys), kv_strides = source_strides(l, l.keys, l.key_value_parts);
  auto q = add_tensor(graph, kQ, "q", q_dims, q_strides);
  auto k = add_tensor(graph, kK, "k", kv_dims, kv_strides);
  auto v = add_tensor(graph, kV, "v", kv_dims, kv_strides);
  auto o = add_tensor(graph, kO, "o", q_dims, out_strides(l));
  auto d_o = add_tensor(graph, kDO, "dout", q_dims, out_strides(l));
  auto stats = add_typed_tensor(graph, kStats, "stats", stats_dims(l), stats_strides(l), fe::DataType_t::FLOAT);
  const MaskTensors masks = add_mask_tensors(graph, l, options);
  auto attributes = fe::graph::SDPA_backward_attributes().set_name("attention_backward");
  apply_options(attributes, l, options, masks);
  auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, d_o, stats, attributes);
  dq->set_output(true).set_uid(kDQ).set_dim(q_dims).set_stride(q_strides);
  dk->set_output(true).set_uid(kDK).set_dim(kv_dims).set_stride(kv_strides);
  dv->set_output(true).set_uid(kDV).set_dim(kv_dims).set_stride(kv_strides);
  LS_RETURN_IF_ERROR(finish_graph(graph, handle));
  *out = std::move(graph);
  return ffi::Error::Success();
}

using GraphKey = std::array<int64_t, 15>;

GraphKey graph_key(bool backward, int device, ffi::DataType dtype, const Layout& l, const Options& options) {
  int32_t rate_bits = 0, scale_bits = 0;
  std::memcpy(&rate_bits, &options.dropout_rate, sizeof rate_bits);
  std::memcpy(&scale_bits, &options.logit_scale, sizeof scale_bits);
  return {backward, device, static_cast<int64_t>(dtype), l.batch, l.queries, l.keys, l.heads, l.head_dim,
          l.query_parts, l.key_value_parts, l.bias_row, options.causal, rate_bits, scale_bits,
          (int64_t{options.padded} << 1) | options.biased};
}

// The cached graph for this configuration, built on first use (`*built` says whether this call built it). Building
// takes milliseconds to seconds (heuristics, kernel compilation and loading); a failed build is not cached, so its
// error repeats with every call.
ffi::Error cached_graph(bool backward, int device, ffi::DataType dtype, const Layout& l, const Options& options,
                        cudnnHandle_t handle, GraphPtr* graph, bool* built) {
  static std::mutex cache_mutex;
  static std::map<GraphKey, GraphPtr> cache;
  const GraphKey key = graph_key(backward, device, dtype, l, options);
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto found = cache.find(key);
  *built = found == cache.end();
  if (!*built) {
    *graph = found->second;
    return ffi::Error::Success();
  }
  GraphPtr fresh;
  LS_RETURN_IF_ERROR(backward ? build_backward(l, options, dtype, handle, &fresh)
                              : build_forward(l, options, dtype, handle, &fresh));
  cache.emplace(key, fresh);
  *graph = std::move(fresh);
  return ffi::Error::Success();
}

// ---- validation --------------------------------------------------------------------------------------------

ffi::Error check_source(std::string_view name, const ffi::AnyBuffer& source) {
  const auto dims = source.dimensions();
  LS_RETURN_IF_ERROR(require(dims.size() == 5, std::string(name) + " must have shape (batch, length, parts, heads, "
                                                   "head_dim), got " + shape_string(dims)));
  LS_RETURN_IF_ERROR(require(source.element_type() == ffi::DataType::BF16 || source.element_type() == ffi::DataType::F16,
                             std::string(name) + " must be bfloat16 or float16 for cuDNN attention, got " +
                                 dtype_name(source.element_type())));
  return ffi::Error::Success();
}

// The layout of (query_source, key_value_source) and of the optional mask operands, checked.
ffi::Error read_layout(const ffi::AnyBuffer& query_source, const ffi::AnyBuffer& key_value_source,
                       const std::optional<ffi::AnyBuffer>& mask_bias, Layout* layout) {
  LS_RETURN_IF_ERROR(check_source("query_source", query_source));
  LS_RETURN_IF_ERROR(check_source("key_value_source", key_value_source));
  const auto q = query_source.dimensions(), kv = key_value_source.dimensions();
  LS_RETURN_IF_ERROR(require(query_source.element_type() == key_value_source.element_type(),
                             "query_source and key_value_source must have the same dtype"));
  LS_RETURN_IF_ERROR(require(q[0] == kv[0] && q[3] == kv[3] && q[4] == kv[4],
                             "query_source " + shape_string(q) + " and key_value_source " + shape_string(kv) +
                                 " must agree in batch, heads and head_dim"));
  LS_RETURN_IF_ERROR(require((q[2] == 1 || q[2] == 3) && kv[2] >= 2,
                             "query_source must have 1 or 3 parts and key_value_source at least 2, got " +
                                 shape_string(q) + " and " + shape_string(kv)));
  LS_RETURN_IF_ERROR(require(q[4] % 8 == 0 && q[4] <= 256,
                             "cuDNN attention takes head_dim a multiple of 8 up to 256, got " + std::to_string(q[4])));
  LS_RETURN_IF_ERROR(require(q[1] >= 1 && kv[1] >= 1 && q[0] >= 1 && q[3] >= 1,
                             "cuDNN attention needs non-empty operands, got " + shape_string(q) + " and " +
                                 shape_string(kv)));
  *layout = Layout{q[0], q[1], kv[1], q[3], q[4], q[2], kv[2], 0};
  if (mask_bias.has_value()) {
    const auto b = mask_bias->dimensions();
    LS_RETURN_IF_ERROR(require(b.size() == 2 && b[0] == q[0] && b[1] >= kv[1] && b[1] % 8 == 0,
                               "mask_bias must have shape (batch, keys rounded up to a multiple of 8) = (" +
                                   std::to_string(q[0]) + ", >= " + std::to_string(kv[1]) + "), got " +
                                   shape_string(b)));
    LS_RETURN_IF_ERROR(require(mask_bias->element_type() == query_source.element_type(),
                               "mask_bias must have the sources' dtype"));
    layout->bias_row = b[1];
  }
  return ffi::Error::Success();
}

ffi::Error check_mask_operands(const Layout& l, const std::optional<ffi::AnyBuffer>& seq_len_q,
                               const std::optional<ffi::AnyBuffer>& seq_len_kv,
                               const std::optional<ffi::AnyBuffer>& mask_bias) {
  LS_RETURN_IF_ERROR(require(seq_len_q.has_value() == seq_len_kv.has_value(),
                             "seq_len_q and seq_len_kv come together (cuDNN's padding mask)"));
  LS_RETURN_IF_ERROR(require(!mask_bias.has_value() || seq_len_q.has_value(),
                             "mask_bias needs seq_len_q and seq_len_kv (the padding mask that skips the keys past the "
                             "last visible one)"));
  if (!seq_len_q.has_value()) return ffi::Error::Success();
  for (const ffi::AnyBuffer* lengths : {&*seq_len_q, &*seq_len_kv}) {
    LS_RETURN_IF_ERROR(require(lengths->element_type() == ffi::DataType::S32 && lengths->element_count() == l.batch,
                               "seq_len_q and seq_len_kv must be int32 (batch,) = (" + std::to_string(l.batch) +
                                   ",), got " + dtype_name(lengths->element_type()) +
                                   shape_string(lengths->dimensions())));
  }
  return ffi::Error::Success();
}

ffi::Error check_options(const Layout& l, const Options& options) {
  LS_RETURN_IF_ERROR(require(options.dropout_rate >= 0.0f && options.dropout_rate < 1.0f,
                             "dropout_rate must be in [0, 1), got " + std::to_string(options.dropout_rate)));
  if (options.causal && l.queries != l.keys) {
    LS_RETURN_IF_ERROR(require(l.queries < l.keys && !options.padded && options.dropout_rate == 0.0f,
                               "cuDNN's causal mask with queries != keys needs queries < keys, no key mask and no "
                               "dropout (its bottom-right diagonal); got " + std::to_string(l.queries) +
                                   " queries and " + std::to_string(l.keys) + " keys"));
  }
  return ffi::Error::Success();
}

ffi::Error check_seed(const ffi::Buffer<ffi::U32>& seed) {
  return require(seed.element_count() == 2, "seed must be uint32[2], got " + shape_string(seed.dimensions()));
}

// ---- execution ---------------------------------------------------------------------------------------------

// Widens the uint32 (seed, offset) pair into the int64 tensors cuDNN's generator reads.
__global__ void widen_seed_kernel(const uint32_t* __restrict__ seed, int64_t* __restrict__ seed_out,
                                  int64_t* __restrict__ offset_out) {
  *seed_out = static_cast<int64_t>(seed[0]);
  *offset_out = static_cast<int64_t>(seed[1]);
}

// Zeroes dk and dv at the keys k >= seq_len_kv[b], which cuDNN's backward skips and may leave unwritten: 16-byte
// vectors [first_vector, row_vectors) of row (b, k) of the (B, K, P', H, D) key-value gradient, parts P' - 2 and
// P' - 1. A block per (key, batch); the blocks of keys below the length return at once, so only padding is written
// (dq's part of a packed qkv gradient is cuDNN's to write and stays untouched).
__global__ void zero_padded_key_rows_kernel(uint4* __restrict__ gradient, const int32_t* __restrict__ seq_len_kv,
                                            int64_t keys, int64_t row_vectors, int64_t first_vector) {
  const int64_t key = blockIdx.x, batch = blockIdx.y;
  if (key < seq_len_kv[batch]) return;
  uint4* row = gradient + (batch * keys + key) * row_vectors;
  for (int64_t i = first_vector + threadIdx.x; i < row_vectors; i += blockDim.x) row[i] = make_uint4(0, 0, 0, 0);
}

void* element_offset(void* base, int64_t elements, int64_t element_bytes) {
  return static_cast<char*>(base) + elements * element_bytes;
}

using VariantPack = std::unordered_map<int64_t, void*>;

// The operands both directions read the same way.
struct Operands {
  const ffi::AnyBuffer& query_source;
  const ffi::AnyBuffer& key_value_source;
  const ffi::Buffer<ffi::U32>& seed;
  const std::optional<ffi::AnyBuffer>& seq_len_q;
  const std::optional<ffi::AnyBuffer>& seq_len_kv;
  const std::optional<ffi::AnyBuffer>& mask_bias;
};

// What both directions derive from the operands and attributes: the checked layout and options, the device's
// state and the graph of this configuration.
struct Prepared {
  Layout layout;
  Options options;
  ffi::DataType dtype;
  DeviceState* state = nullptr;
  GraphPtr graph;
};

// Checks the operands and finds this configuration's graph, building it when no earlier call did (`*built`).
ffi::Error prepare(bool backward, int device, const Operands& in, bool causal, float dropout_rate,
                   float logit_scale, Prepared* p, bool* built) {
  LS_RETURN_IF_ERROR(read_layout(in.query_source, in.key_value_source, in.mask_bias, &p->layout));
  LS_RETURN_IF_ERROR(check_mask_operands(p->layout, in.seq_len_q, in.seq_len_kv, in.mask_bias));
  LS_RETURN_IF_ERROR(check_seed(in.seed));
  p->options = Options{causal, dropout_rate, logit_scale, in.seq_len_kv.has_value(), in.mask_bias.has_value()};
  LS_RETURN_IF_ERROR(check_options(p->layout, p->options));
  p->dtype = in.query_source.element_type();
  LS_RETURN_IF_ERROR(device_state(device, &p->state));
  return cached_graph(backward, device, p->dtype, p->layout, p->options, p->state->handle, &p->graph, built);
}

// Element offsets of k and v in a (B, K, P', H, D) key-value source (or its gradient): parts P' - 2 and P' - 1.
int64_t key_offset(const Layout& l) { return (l.key_value_parts - 2) * l.heads * l.head_dim; }
int64_t value_offset(const Layout& l) { return (l.key_value_parts - 1) * l.heads * l.head_dim; }

// The entries both directions' variant packs share: q, k, v and the key mask's operands.
VariantPack shared_pack(const Layout& l, const Operands& in) {
  const int64_t bytes = 2;  // bf16 or f16
  void* key_value = in.key_value_source.untyped_data();
  VariantPack pack = {
      {kQ, in.query_source.untyped_data()},
      {kK, element_offset(key_value, key_offset(l), bytes)},
      {kV, element_offset(key_value, value_offset(l), bytes)},
  };
  if (in.seq_len_kv.has_value()) {
    pack[kSeqLenQ] = in.seq_len_q->untyped_data();
    pack[kSeqLenKV] = in.seq_len_kv->untyped_data();
  }
  if (in.mask_bias.has_value()) pack[kMaskBias] = in.mask_bias->untyped_data();
  return pack;
}

// Graphs the execute handlers had to build themselves: 0 while every configuration is built in the initialize stage.
std::atomic<int64_t> graphs_built_in_execute{0};

// The initialize stage, after prepare(): when it has just built the graph, it also takes the graph's workspace from
// the pool once and gives it back in the stream's order, so that the pool already holds that memory (it keeps what it
// once held) and the first execution's allocation is a lookup, not a cudaMalloc.
ffi::Error reserve_workspace(const Prepared& p, int device, cudaStream_t stream) {
  int64_t workspace_bytes = 0;
  LS_RETURN_IF_FE_ERROR("get_workspace_size", p.graph->get_workspace_size(workspace_bytes));
  StreamAllocation memory(stream);
  return memory.allocate(p.state->pool, device, static_cast<size_t>(workspace_bytes));
}

// Enqueues the prepared graph on `stream` with `pack`, to which the seed and offset are added; the workspace is
// allocated before and freed after it in the stream's order.
ffi::Error execute(const Prepared& p, int device, cudaStream_t stream, const ffi::Buffer<ffi::U32>& seed,
                   VariantPack& pack) {
  int64_t workspace_bytes = 0;
  LS_RETURN_IF_FE_ERROR("get_workspace_size", p.graph->get_workspace_size(workspace_bytes));
  StreamAllocation memory(stream);
  LS_RETURN_IF_ERROR(memory.allocate(p.state->pool, device, static_cast<size_t>(workspace_bytes)));
  if (p.options.dropout_rate > 0.0f) {
    widen_seed_kernel<<<1, 1, 0, stream>>>(seed.typed_data(), memory.seed(), memory.offset());
    LS_RETURN_IF_ERROR(launch_error("widen_seed_kernel"));
    pack[kSeed] = memory.seed();
    pack[kOffset] = memory.offset();
  }
  std::lock_guard<std::mutex> lock(p.state->mutex);
  const cudnnStatus_t status = cudnnSetStream(p.state->handle, stream);
  if (status != CUDNN_STATUS_SUCCESS) return cudnn_status_error("cudnnSetStream", status);
  LS_RETURN_IF_FE_ERROR("execute", p.graph->execute(p.state->handle, pack, memory.workspace()));
  return ffi::Error::Success();
}

// What a handler does once prepare() has found the graph: the initialize stage stops (reserving the workspace of a
// graph it built) and reports true; the execute stage counts a graph it had to build and goes on (false).
template <bool kInitialize>
bool initialize_stage_done(const Prepared& p, bool built, int device, cudaStream_t stream, ffi::Error* result) {
  if (kInitialize) {
    *result = built ? reserve_workspace(p, device, stream) : ffi::Error::Success();
    return true;
  }
  if (built) graphs_built_in_execute.fetch_add(1);
  return false;
}

// Frontend and cuDNN failures arrive as ffi::Error; anything thrown (allocation, the frontend's loader) too.
template <typename Body>
ffi::Error guarded(int device, Body&& body) {
  try {
    DeviceScope scope(device);
    if (scope.status() != cudaSuccess) return cuda_status_error("cudaSetDevice", scope.status());
    return body();
  } catch (const std::exception& err) {
    return ffi::Error::Internal(std::string("cuDNN attention: ") + err.what());
  } catch (...) {
    return ffi::Error::Internal("cuDNN attention: unknown exception");
  }
}

ffi::Error check_forward_results(const Layout& l, ffi::DataType dtype, const ffi::AnyBuffer& out,
                                 const ffi::AnyBuffer& stats) {
  LS_RETURN_IF_ERROR(require(out.element_type() == dtype &&
                                 out.element_count() == l.batch * l.queries * l.heads * l.head_dim,
                             "out must be (batch, queries, heads, head_dim) in the sources' dtype, got " +
                                 shape_string(out.dimensions())));
  return require(stats.element_type() == ffi::DataType::F32 && stats.element_count() == l.batch * l.heads * l.queries,
                 "stats must be float32 (batch, heads, queries, 1), got " + shape_string(stats.dimensions()));
}

// The forward in either stage: kInitialize checks the operands and builds the graph; the execute stage runs it.
template <bool kInitialize>
ffi::Error attention_cudnn_fwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer query_source,
                               ffi::AnyBuffer key_value_source, ffi::Buffer<ffi::U32> seed,
                               std::optional<ffi::AnyBuffer> seq_len_q, std::optional<ffi::AnyBuffer> seq_len_kv,
                               std::optional<ffi::AnyBuffer> mask_bias, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> stats, bool causal, float dropout_rate,
                               float logit_scale) {
  return guarded(device, [&]() -> ffi::Error {
    const Operands in{query_source, key_value_source, seed, seq_len_q, seq_len_kv, mask_bias};
    Prepared p;
    bool built = false;
    LS_RETURN_IF_ERROR(prepare(false, device, in, causal, dropout_rate, logit_scale, &p, &built));
    LS_RETURN_IF_ERROR(check_forward_results(p.layout, p.dtype, *out, *stats));
    ffi::Error result = ffi::Error::Success();
    if (initialize_stage_done<kInitialize>(p, built, device, stream, &result)) return result;
    VariantPack pack = shared_pack(p.layout, in);
    pack[kO] = out->untyped_data();
    pack[kStats] = stats->untyped_data();
    return execute(p, device, stream, seed, pack);
  });
}

ffi::Error check_backward_operands(const Layout& l, ffi::DataType dtype, const ffi::AnyBuffer& dout,
                                   const ffi::AnyBuffer& out, const ffi::Buffer<ffi::F32>& stats) {
  const int64_t out_elements = l.batch * l.queries * l.heads * l.head_dim;
  LS_RETURN_IF_ERROR(require(dout.element_type() == dtype && dout.element_count() == out_elements &&
                                 out.element_type() == dtype && out.element_count() == out_elements,
                             "dout and out must be (batch, queries, heads, head_dim) in the sources' dtype, got " +
                                 shape_string(dout.dimensions()) + " and " + shape_string(out.dimensions())));
  return require(stats.element_count() == l.batch * l.heads * l.queries,
                 "stats must be (batch, heads, queries, 1), got " + shape_string(stats.dimensions()));
}

// Where dk and dv go: d_key_value_source, or (a packed qkv, P = 3) d_query_source, which then receives dq, dk, dv.
ffi::Error key_value_gradient(const Layout& l, const Operands& in, ffi::AnyBuffer& d_query_source,
                              std::optional<ffi::Result<ffi::AnyBuffer>>& d_key_value_source, void** gradient) {
  if (d_key_value_source.has_value()) {
    LS_RETURN_IF_ERROR(
        require_same_shape("d_key_value_source", **d_key_value_source, "key_value_source", in.key_value_source));
    *gradient = (*d_key_value_source)->untyped_data();
    return ffi::Error::Success();
  }
  LS_RETURN_IF_ERROR(require(l.query_parts == 3 && in.query_source.untyped_data() == in.key_value_source.untyped_data(),
                             "without d_key_value_source the sources must be one packed (B, L, 3, H, D) qkv"));
  *gradient = d_query_source.untyped_data();
  return ffi::Error::Success();
}

// Zeroes the dk and dv rows of the keys past seq_len_kv (zero_padded_key_rows_kernel).
ffi::Error zero_padded_key_rows(const Layout& l, const ffi::AnyBuffer& seq_len_kv, void* d_key_value,
                                cudaStream_t stream) {
  LS_RETURN_IF_ERROR(require(l.batch <= 65535, "cuDNN attention with a key mask takes at most 65535 rows, got " +
                                                   std::to_string(l.batch)));
  const int64_t part_vectors = l.heads * l.head_dim / 8;  // 16-byte vectors of one (H, D) part; D % 8 == 0
  const dim3 grid(static_cast<unsigned>(l.keys), static_cast<unsigned>(l.batch));
  zero_padded_key_rows_kernel<<<grid, 128, 0, stream>>>(static_cast<uint4*>(d_key_value),
                                                        seq_len_kv.typed_data<int32_t>(), l.keys,
                                                        l.key_value_parts * part_vectors,
                                                        (l.key_value_parts - 2) * part_vectors);
  return launch_error("zero_padded_key_rows_kernel");
}

// The backward in either stage, as the forward.
template <bool kInitialize>
ffi::Error attention_cudnn_bwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer dout, ffi::AnyBuffer query_source,
                               ffi::AnyBuffer key_value_source, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> stats,
                               ffi::Buffer<ffi::U32> seed, std::optional<ffi::AnyBuffer> seq_len_q,
                               std::optional<ffi::AnyBuffer> seq_len_kv, std::optional<ffi::AnyBuffer> mask_bias,
                               ffi::Result<ffi::AnyBuffer> d_query_source,
                               std::optional<ffi::Result<ffi::AnyBuffer>> d_key_value_source, bool causal,
                               float dropout_rate, float logit_scale) {
  return guarded(device, [&]() -> ffi::Error {
    const Operands in{query_source, key_value_source, seed, seq_len_q, seq_len_kv, mask_bias};
    Prepared p;
    bool built = false;
    LS_RETURN_IF_ERROR(prepare(true, device, in, causal, dropout_rate, logit_scale, &p, &built));
    LS_RETURN_IF_ERROR(check_backward_operands(p.layout, p.dtype, dout, out, stats));
    LS_RETURN_IF_ERROR(require_same_shape("d_query_source", *d_query_source, "query_source", query_source));
    void* d_key_value = nullptr;
    LS_RETURN_IF_ERROR(key_value_gradient(p.layout, in, *d_query_source, d_key_value_source, &d_key_value));
    ffi::Error result = ffi::Error::Success();
    if (initialize_stage_done<kInitialize>(p, built, device, stream, &result)) return result;
    if (p.options.padded) LS_RETURN_IF_ERROR(zero_padded_key_rows(p.layout, *seq_len_kv, d_key_value, stream));
    const int64_t bytes = 2;  // bf16 or f16
    VariantPack pack = shared_pack(p.layout, in);
    pack[kO] = out.untyped_data();
    pack[kDO] = dout.untyped_data();
    pack[kStats] = stats.untyped_data();
    pack[kDQ] = d_query_source->untyped_data();
    pack[kDK] = element_offset(d_key_value, key_offset(p.layout), bytes);
    pack[kDV] = element_offset(d_key_value, value_offset(p.layout), bytes);
    return execute(p, device, stream, seed, pack);
  });
}

// ---- bindings ----------------------------------------------------------------------------------------------
// The pieces of the two targets' bindings they share, in the order of the handlers' parameters; the initialize and
// execute stages bind the same operands, results and attributes.

template <ffi::ExecutionStage stage>
auto bind_context() {
  return ffi::Ffi::Bind<stage>().template Ctx<ffi::PlatformStream<cudaStream_t>>().template Ctx<ffi::DeviceOrdinal>();
}

template <typename Binding>
auto bind_sources(Binding binding) {  // query_source, key_value_source
  return std::move(binding).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>();
}

template <typename Binding>
auto bind_seed_and_mask(Binding binding) {  // seed [, seq_len_q, seq_len_kv [, mask_bias]]
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::U32>>()
      .template OptionalArg<ffi::AnyBuffer>()
      .template OptionalArg<ffi::AnyBuffer>()
      .template OptionalArg<ffi::AnyBuffer>();
}

template <typename Binding>
auto bind_attributes(Binding binding) {
  return std::move(binding)
      .template Attr<bool>("causal")
      .template Attr<float>("dropout_rate")
      .template Attr<float>("logit_scale");
}

template <ffi::ExecutionStage stage>
auto forward_binding() {
  // -> out, stats
  return bind_attributes(bind_seed_and_mask(bind_sources(bind_context<stage>()))
                             .template Ret<ffi::AnyBuffer>()
                             .template Ret<ffi::AnyBuffer>());
}

template <ffi::ExecutionStage stage>
auto backward_binding() {
  // dout, sources, out, stats, seed, mask -> d_query_source [, d_key_value_source]
  // (Bindings cannot be moved into a named variable, only passed on as temporaries.)
  return bind_attributes(bind_seed_and_mask(bind_sources(bind_context<stage>().template Arg<ffi::AnyBuffer>())
                                                .template Arg<ffi::AnyBuffer>()
                                                .template Arg<ffi::Buffer<ffi::F32>>())
                             .template Ret<ffi::AnyBuffer>()
                             .template OptionalRet<ffi::AnyBuffer>());
}

constexpr auto kInitializeStage = ffi::ExecutionStage::kInitialize;
constexpr auto kExecuteStage = ffi::ExecutionStage::kExecute;

}  // namespace

// The most bytes the workspace pool of `device` had in use at once since the previous read, which resets the mark;
// -1 when no cuDNN attention ran on `device` or the pool cannot be read. For benchmarks (through ctypes): XLA's
// memory statistics do not see this memory.
extern "C" int64_t ls_attention_cudnn_workspace_peak(int device) {
  Registry& all = registry();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto found = all.states.find(device);
  if (found == all.states.end() || !found->second) return -1;
  cudaMemPool_t pool = found->second->pool;
  cuuint64_t peak = 0, zero = 0;
  if (cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &peak) != cudaSuccess) return -1;
  if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero) != cudaSuccess) return -1;
  return static_cast<int64_t>(peak);
}

// The count of graphs the execute handlers built themselves (graphs_built_in_execute), for tests (through ctypes):
// 0 while every configuration was built in the initialize stage.
extern "C" int64_t ls_attention_cudnn_graphs_built_in_execute() { return graphs_built_in_execute.load(); }

// Registered without the command-buffer trait (see the top of this file).
XLA_FFI_DEFINE_HANDLER_SYMBOL(ls_attention_cudnn_fwd_initialize, attention_cudnn_fwd<true>,
                              forward_binding<kInitializeStage>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ls_attention_cudnn_fwd, attention_cudnn_fwd<false>, forward_binding<kExecuteStage>());
LS_REGISTER_STAGED_TARGET(ls_attention_cudnn_fwd, ls_attention_cudnn_fwd_initialize);

XLA_FFI_DEFINE_HANDLER_SYMBOL(ls_attention_cudnn_bwd_initialize, attention_cudnn_bwd<true>,
                              backward_binding<kInitializeStage>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ls_attention_cudnn_bwd, attention_cudnn_bwd<false>, backward_binding<kExecuteStage>());
LS_REGISTER_STAGED_TARGET(ls_attention_cudnn_bwd, ls_attention_cudnn_bwd_initialize);

}  // namespace ls
