// libFuzzer target (clang): tests/fuzz/README.md says how to build and run it.
#include "fuzz_target.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  blockswap::fuzz::fuzz_one(data, size);
  return 0;
}
