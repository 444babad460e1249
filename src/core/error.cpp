#include "blockswap/core/error.hpp"

namespace blockswap::detail {

void throw_block_index(std::string_view label, int64_t block, int64_t blocks) {
  throw Error(concat(label.empty() ? std::string() : concat("[", label, "] "), "block index ",
                     block, " is out of range for ", blocks, " blocks"));
}

void throw_internal(const char* condition, const char* file, int line, const std::string& message) {
  throw Error(concat("blockswap internal error: ", condition, " failed at ", file, ":", line,
                     message.empty() ? "" : ": ", message,
                     " (this is a bug in blockswap; please report it)"));
}

} // namespace blockswap::detail
