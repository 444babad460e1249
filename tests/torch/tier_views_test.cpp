// Where a block's frozen tensors are off the device (src/torch/tier_views.hpp): views of the
// block's host copy, views of the model's file mapped for the blocks of the file tier, and what
// a caller's change to a tensor of the file tier comes to.
#include "tier_views.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "blockswap/core/error.hpp"
#include "file_weights.hpp"

namespace blockswap::torch_frontend {
namespace {

namespace fs = std::filesystem;

constexpr std::size_t kFileOffset = 64; // where the tensor is in the file (after a "header")

// A frozen tensor of 4 floats at `offset` in its block's packed bytes.
PackedTensor frozen_tensor(const std::string& name, std::size_t offset = 16) {
  PackedTensor t;
  t.name = name;
  t.role = Role::frozen;
  t.offset = offset;
  t.sizes = {4};
  t.dtype = c10::ScalarType::Float;
  t.file_offset = kFileOffset;
  return t;
}

const torch::Tensor kFileValues = torch::tensor({1.5F, 2.5F, 3.5F, 4.5F});
const torch::Tensor kHostValues = torch::tensor({-1.F, -2.F, -3.F, -4.F});

// A file holding kFileValues at kFileOffset, removed with it.
struct ModelFile {
  std::string path =
      (fs::temp_directory_path() / ("blockswap-tier-views-" + std::to_string(::getpid()) + ".bin"))
          .string();
  ModelFile() {
    std::vector<char> bytes(kFileOffset + kFileValues.nbytes() + 32, 'x');
    std::memcpy(bytes.data() + kFileOffset, kFileValues.data_ptr(), kFileValues.nbytes());
    std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
  }
  ~ModelFile() { fs::remove(path); }
  // Its tensor's bytes as the file has them now.
  torch::Tensor values() const {
    std::ifstream in(path, std::ios::binary);
    in.seekg(std::streamoff(kFileOffset));
    torch::Tensor read = torch::empty({4});
    in.read(static_cast<char*>(read.data_ptr()), std::streamsize(read.nbytes()));
    return read;
  }
};

// A block's host copy of 64 bytes holding kHostValues at offset 16.
std::shared_ptr<Buffer> host_copy() {
  auto memory = std::make_shared<std::vector<std::byte>>(64);
  std::memcpy(memory->data() + 16, kHostValues.data_ptr(), kHostValues.nbytes());
  return std::make_shared<Buffer>(memory->data(), memory->size(),
                                  [memory](std::byte*, std::size_t) mutable { memory.reset(); });
}

// Block 0 in the file, block 1 in host memory.
TierViews with_file_tier(const ModelFile& file) {
  TierViews views("blocks");
  views.use_file(map_files({file.path}, "blocks"), {true, false}, {}, file.path);
  views.use_host_copies({nullptr, host_copy()});
  return views;
}

TEST(TierViews, AHostCopyViewSharesTheHostCopy) {
  TierViews views("blocks");
  const std::shared_ptr<Buffer> host = host_copy();
  views.use_host_copies({host});
  const PackedTensor t = frozen_tensor("w");
  EXPECT_FALSE(views.read_only(0));
  EXPECT_TRUE(views.viewable(0));
  EXPECT_EQ(views.fill_host_copy(0), TierViews::Fill::everything);
  const torch::Tensor view = views.frozen(0, t);
  EXPECT_EQ(view.device(), torch::kCPU);
  EXPECT_TRUE(torch::equal(view, kHostValues));
  EXPECT_EQ(view.data_ptr(), static_cast<void*>(host->data() + 16)); // no copy
  EXPECT_FALSE(views.check_sources());
}

TEST(TierViews, AFileTierViewReadsTheMappedFileAndTheOthersTheirHostCopy) {
  const ModelFile file;
  TierViews views = with_file_tier(file);
  const PackedTensor t = frozen_tensor("w");
  EXPECT_TRUE(views.read_only(0));
  EXPECT_FALSE(views.read_only(1));
  EXPECT_TRUE(torch::equal(views.frozen(0, t), kFileValues));
  EXPECT_TRUE(torch::equal(views.frozen(1, t), kHostValues));
  // The file tier's block has no host copy to fill; the other's tensors fill theirs.
  EXPECT_EQ(views.fill_host_copy(0), TierViews::Fill::nothing);
  EXPECT_EQ(views.fill_host_copy(1), TierViews::Fill::everything);
  EXPECT_FALSE(views.check_sources());
}

TEST(TierViews, WeightsFromFileFillTheHostCopysFrozenBytes) {
  const ModelFile file;
  const std::shared_ptr<Buffer> host = host_copy();
  std::vector<int64_t> read;
  TierViews views("blocks");
  views.use_file(
      map_files({file.path}, "blocks"), {true, false},
      [&](int64_t block, std::byte* packed) {
        EXPECT_EQ(packed, host->data());
        read.push_back(block);
      },
      file.path);
  views.use_host_copies({nullptr, host});
  EXPECT_EQ(views.fill_host_copy(0), TierViews::Fill::nothing);
  EXPECT_EQ(views.fill_host_copy(1), TierViews::Fill::all_but_frozen);
  EXPECT_EQ(read, std::vector<int64_t>{1}); // the block in the file is read for each load
}

TEST(TierViews, ACallersWriteToTheFileTierIsRevertedAndRaised) {
  const ModelFile file;
  TierViews views = with_file_tier(file);
  const PackedTensor t = frozen_tensor("proj.weight");
  torch::Tensor tensor = views.frozen(0, t); // the module's tensor off the device
  tensor.fill_(7);                           // writes this process's pages of the mapping
  EXPECT_FALSE(views.matches_source(0, t, tensor));
  EXPECT_TRUE(torch::equal(tensor, kFileValues));        // the file's values again
  EXPECT_TRUE(torch::equal(file.values(), kFileValues)); // the file never changed
  EXPECT_FALSE(views.any_dropped());
  views.dropped(0, t);
  EXPECT_TRUE(views.any_dropped());
  try {
    views.raise_dropped();
    FAIL() << "a change that cannot be kept was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "[blocks] frozen tensors 'proj.weight' of block 0 were changed, but their blocks "
                 "are read from the model's file for each load (the file tier, "
                 "host_budget_bytes), so the changes cannot be kept: they hold the file's values "
                 "again. Change weights before building the offloader and give the file they are "
                 "saved in, or give the host budget room for these blocks");
  }
  EXPECT_FALSE(views.any_dropped()); // raised once
  EXPECT_NO_THROW(views.raise_dropped());
}

TEST(TierViews, TheFilesOwnValuesAreKept) {
  const ModelFile file;
  TierViews views = with_file_tier(file);
  const PackedTensor t = frozen_tensor("w");
  EXPECT_TRUE(views.matches_source(0, t, kFileValues.clone())); // a checkpoint resumed
  EXPECT_FALSE(views.matches_source(0, t, kHostValues.clone()));
}

TEST(TierViews, ManyDroppedChangesAreOneErrorNamingThreeOfThem) {
  const ModelFile file;
  TierViews views = with_file_tier(file);
  for (const char* name : {"a", "b", "c", "d", "e"}) views.dropped(0, frozen_tensor(name));
  try {
    views.raise_dropped();
    FAIL() << "dropped changes went unreported";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("frozen tensors 'a' of block 0, 'b' of block 0, 'c' of block 0 and 2 "
                        "more were changed"),
              std::string::npos)
        << what;
  }
}

TEST(TierViews, AFileThatShrinksIsNoLongerViewed) {
  const ModelFile file;
  TierViews views = with_file_tier(file);
  const PackedTensor t = frozen_tensor("w");
  fs::resize_file(file.path, kFileOffset / 2);
  EXPECT_TRUE(views.check_sources());  // with a warning
  EXPECT_FALSE(views.check_sources()); // once
  EXPECT_FALSE(views.viewable(0));
  EXPECT_TRUE(views.viewable(1));
  const torch::Tensor gone = views.frozen(0, t);
  EXPECT_EQ(gone.numel(), 0);
  EXPECT_EQ(gone.scalar_type(), c10::ScalarType::Float);
  EXPECT_TRUE(torch::equal(views.frozen(1, t), kHostValues));
  EXPECT_FALSE(views.matches_source(0, t, kFileValues.clone())); // nothing left to match
}

} // namespace
} // namespace blockswap::torch_frontend
