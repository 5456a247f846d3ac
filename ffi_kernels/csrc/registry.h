// The table of FFI targets this library exports: every translation unit adds its handlers at load time with
// LS_REGISTER_TARGET / LS_FFI_TARGET (common.cuh), and module.cc hands the whole table to Python.
#pragma once

#include <vector>

#include "xla/ffi/api/c_api.h"

namespace ls {

using Handler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

struct Target {
  const char* name;
  Handler* handler;                 // the execute stage
  Handler* initialize = nullptr;    // the initialize stage, for targets with one-time work before execution
};

// Every registered target, in registration order. Defined in module.cc; a function-local static, so it is
// constructed before the first static initializer of any translation unit appends to it.
std::vector<Target>& target_registry();

// Appends a target; returns true so that it can initialize a namespace-scope constant.
bool register_target(const char* name, Handler* handler);

// Appends a target with an initialize-stage handler besides its execute handler (XLA calls the initialize stage
// before each execution, with the operands' buffers assigned but not yet written, outside any command-buffer capture).
bool register_staged_target(const char* name, Handler* initialize, Handler* execute);

constexpr bool has_ls_prefix(const char* name) { return name[0] == 'l' && name[1] == 's' && name[2] == '_'; }

}  // namespace ls

// Registers an extern "C" FFI handler symbol (e.g. one made by XLA_FFI_DEFINE_HANDLER_SYMBOL) under its own
// name, which must start with "ls_".
#define LS_REGISTER_TARGET(symbol)                                                                 \
  static_assert(::ls::has_ls_prefix(#symbol), "ls-jax FFI target names start with ls_: " #symbol); \
  [[maybe_unused]] static const bool ls_registered_##symbol = ::ls::register_target(#symbol, symbol)

// Registers the extern "C" handler symbols `execute` (whose name is the target's) and `initialize` as one target.
#define LS_REGISTER_STAGED_TARGET(execute, initialize)                                              \
  static_assert(::ls::has_ls_prefix(#execute), "ls-jax FFI target names start with ls_: " #execute); \
  [[maybe_unused]] static const bool ls_registered_##execute =                                      \
      ::ls::register_staged_target(#execute, initialize, execute)
