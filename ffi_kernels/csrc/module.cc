// The Python extension module: hands every registered FFI target to Python as a PyCapsule.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "registry.h"

namespace ls {

std::vector<Target>& target_registry() {
  static std::vector<Target> targets;
  return targets;
}

bool register_target(const char* name, Handler* handler) {
  target_registry().push_back({name, handler});
  return true;
}

bool register_staged_target(const char* name, Handler* initialize, Handler* execute) {
  target_registry().push_back({name, execute, initialize});
  return true;
}

}  // namespace ls

namespace py = pybind11;

PYBIND11_MODULE(_ls_kernels, m) {
  m.doc() = "ls-jax CUDA kernels as XLA FFI handlers";
  m.def(
      "targets",
      [] {
        py::dict capsules;
        for (const ls::Target& target : ls::target_registry()) {
          if (capsules.contains(target.name))
            throw std::runtime_error(std::string("FFI target ") + target.name + " is registered twice");
          py::capsule execute(reinterpret_cast<void*>(target.handler));
          if (target.initialize == nullptr) {
            capsules[target.name] = execute;
            continue;
          }
          py::dict stages;  // the form jax.ffi.register_ffi_target takes for handlers of several stages
          stages["initialize"] = py::capsule(reinterpret_cast<void*>(target.initialize));
          stages["execute"] = execute;
          capsules[target.name] = stages;
        }
        return capsules;
      },
      "Every FFI target of the library: {name: PyCapsule of its XLA_FFI_Handler, or {stage: PyCapsule} for a "
      "target with an initialize-stage handler}.");
  m.def(
      "multiprocessor_count",
      [](int device) {
        int count = 0;
        const cudaError_t status = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
        if (status != cudaSuccess)
          throw std::runtime_error(std::string("cannot query CUDA device ") + std::to_string(device) + ": " +
                                   cudaGetErrorString(status));
        return count;
      },
      py::arg("device"), "Number of streaming multiprocessors of CUDA device `device`.");
}
