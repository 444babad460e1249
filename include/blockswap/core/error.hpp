// Errors raised by blockswap.
//
// Two tiers, as in c10: BLOCKSWAP_CHECK for bad input from the user (throws blockswap::Error
// with the values that were wrong), BLOCKSWAP_ASSERT for internal invariants (a failure is a
// blockswap bug). Options out of range or contradicting each other are
// blockswap::InvalidArgument (BLOCKSWAP_CHECK_ARGUMENT; Python's InvalidArgumentError, also a
// ValueError); device memory exhaustion is blockswap::OutOfMemory.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace blockswap {

class Error : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

// Device memory could not be allocated: over an emulated device's capacity, or a GPU's memory.
class OutOfMemory : public Error {
public:
  using Error::Error;
};

// An option or argument out of range, or options that contradict each other, found before
// anything runs (Options::check).
class InvalidArgument : public Error {
public:
  using Error::Error;
};

namespace detail {

template <typename... Args> std::string concat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

[[noreturn]] void throw_block_index(std::string_view label, int64_t block, int64_t blocks);

// Throws Error "[label] block index B is out of range for N blocks" unless 0 <= B < N (no
// prefix with an empty label): the one check of a block index, wherever one is given. Inline:
// the engine's verbs check on every call (bench/engine_bench.cpp measures them).
inline void check_block_index(std::string_view label, int64_t block, int64_t blocks) {
  if (block < 0 || block >= blocks) [[unlikely]] {
    throw_block_index(label, block, blocks);
  }
}

[[noreturn]] void throw_internal(const char* condition, const char* file, int line,
                                 const std::string& message);

} // namespace detail
} // namespace blockswap

// Throws blockswap::Error with the message when `cond` is false. Use for the user's input.
#define BLOCKSWAP_CHECK(cond, ...)                                                                 \
  do {                                                                                             \
    if (!(cond)) throw ::blockswap::Error(::blockswap::detail::concat(__VA_ARGS__));               \
  } while (false)

// Throws blockswap::InvalidArgument with the message when `cond` is false. Use for options.
#define BLOCKSWAP_CHECK_ARGUMENT(cond, ...)                                                        \
  do {                                                                                             \
    if (!(cond)) throw ::blockswap::InvalidArgument(::blockswap::detail::concat(__VA_ARGS__));     \
  } while (false)

// Throws blockswap::Error naming the file and line when an internal invariant is broken.
#define BLOCKSWAP_ASSERT(cond, ...)                                                                \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      ::blockswap::detail::throw_internal(                                                         \
          #cond, __FILE__, __LINE__, ::blockswap::detail::concat("" __VA_OPT__(, ) __VA_ARGS__));  \
  } while (false)
