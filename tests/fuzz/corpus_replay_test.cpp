// Replays the fuzzer's corpus (tests/fuzz/corpus) through the fuzz target: every input must be
// accepted or rejected with blockswap::Error, never crash or trip an assertion.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "fuzz_target.hpp"

namespace {

TEST(FuzzCorpus, EveryInputIsAcceptedOrRejectedCleanly) {
  const std::filesystem::path corpus = BLOCKSWAP_FUZZ_CORPUS;
  std::size_t inputs = 0;
  for (const auto& entry : std::filesystem::directory_iterator(corpus)) {
    std::ifstream file(entry.path(), std::ios::binary);
    const std::vector<char> bytes(std::istreambuf_iterator<char>(file), {});
    EXPECT_NO_THROW(
        blockswap::fuzz::fuzz_one(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()))
        << entry.path();
    ++inputs;
  }
  EXPECT_GE(inputs, 10u) << "the corpus is missing";
}

} // namespace
