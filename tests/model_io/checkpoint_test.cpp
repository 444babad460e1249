// open_checkpoint: one file, a sharded set by its index or its folder, a folder with one file;
// every failure names the index, the shard and the tensor.
#include "blockswap/model_io/checkpoint.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

namespace fs = std::filesystem;

struct Folder {
  fs::path path;
  Folder() {
    path = fs::temp_directory_path() /
           ("blockswap_checkpoint_" +
            std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Folder() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

// Three shards; block 0's tensors in shards 1 and 2, block 1's in shards 2 and 3.
void write_shards(const Folder& folder) {
  const std::vector<float> a(6, 1.0f), b(4, 2.0f), c(8, 3.0f), d(2, 4.0f);
  write_safetensors(folder / "m-00001-of-00003.safetensors",
                    {{"blocks.0.w", "F32", {2, 3}, a.data()}, {"embed", "F32", {2}, d.data()}});
  write_safetensors(
      folder / "m-00002-of-00003.safetensors",
      {{"blocks.0.b", "F32", {4}, b.data()}, {"blocks.1.w", "F32", {2, 3}, a.data()}});
  write_safetensors(folder / "m-00003-of-00003.safetensors",
                    {{"blocks.1.b", "F32", {4}, b.data()}, {"blocks.1.c", "F32", {8}, c.data()}});
  write_text(folder / "m.safetensors.index.json",
             R"({"metadata": {"total_size": 120}, "weight_map": {
  "blocks.0.w": "m-00001-of-00003.safetensors", "embed": "m-00001-of-00003.safetensors",
  "blocks.0.b": "m-00002-of-00003.safetensors", "blocks.1.w": "m-00002-of-00003.safetensors",
  "blocks.1.b": "m-00003-of-00003.safetensors", "blocks.1.c": "m-00003-of-00003.safetensors"}})");
}

template <typename F> std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Checkpoint, OneFileIsOneShard) {
  Folder folder;
  const std::vector<float> a(6, 1.0f);
  write_safetensors(folder / "one.safetensors", {{"blocks.0.w", "F32", {2, 3}, a.data()}});
  for (const std::string& path : {folder / "one.safetensors", folder.path.string()}) {
    const Checkpoint c = open_checkpoint(path);
    ASSERT_EQ(c.files.size(), 1u);
    EXPECT_TRUE(c.index.empty());
    const CheckpointTensor& t = c.tensors.at("blocks.0.w");
    EXPECT_EQ(t.file, 0u);
    EXPECT_EQ(t.info.bytes(), 24u);
    EXPECT_EQ(t.offset % 8, 0u); // past the header, which write_safetensors pads
  }
}

TEST(Checkpoint, AShardedSetByItsIndexOrItsFolder) {
  Folder folder;
  write_shards(folder);
  for (const std::string& path : {folder / "m.safetensors.index.json", folder.path.string()}) {
    const Checkpoint c = open_checkpoint(path);
    EXPECT_EQ(c.index, folder / "m.safetensors.index.json");
    ASSERT_EQ(c.files.size(), 3u);
    EXPECT_EQ(c.tensors.size(), 6u);
    EXPECT_EQ(c.files[c.tensors.at("blocks.0.w").file], folder / "m-00001-of-00003.safetensors");
    EXPECT_EQ(c.files[c.tensors.at("blocks.0.b").file], folder / "m-00002-of-00003.safetensors");
    EXPECT_EQ(c.files[c.tensors.at("blocks.1.c").file], folder / "m-00003-of-00003.safetensors");
    // Each tensor's bytes where its shard has them.
    const CheckpointTensor& c1 = c.tensors.at("blocks.1.c");
    std::ifstream in(c.files[c1.file], std::ios::binary);
    in.seekg(static_cast<std::streamoff>(c1.offset));
    std::vector<float> values(8);
    in.read(reinterpret_cast<char*>(values.data()), 32);
    EXPECT_EQ(values, std::vector<float>(8, 3.0f));
    EXPECT_EQ(c.tensor_infos().size(), 6u);
    EXPECT_NE(c.where(1).find("of '" + c.index + "'"), std::string::npos);
  }
}

TEST(Checkpoint, AMissingShardIsNamed) {
  Folder folder;
  write_shards(folder);
  fs::remove(folder / "m-00002-of-00003.safetensors");
  const std::string e = error_of([&] { open_checkpoint(folder / "m.safetensors.index.json"); });
  EXPECT_NE(e.find("m-00002-of-00003.safetensors' that the index"), std::string::npos) << e;
  EXPECT_NE(e.find("m.safetensors.index.json"), std::string::npos) << e;
  EXPECT_NE(e.find("is missing"), std::string::npos) << e;
}

TEST(Checkpoint, ATensorTheShardLacksIsNamed) {
  Folder folder;
  write_shards(folder);
  const std::vector<float> b(4, 2.0f);
  write_safetensors(folder / "m-00003-of-00003.safetensors",
                    {{"blocks.1.b", "F32", {4}, b.data()}});
  const std::string e = error_of([&] { open_checkpoint(folder.path.string()); });
  EXPECT_NE(e.find("puts tensor 'blocks.1.c' in the shard"), std::string::npos) << e;
  EXPECT_NE(e.find("m-00003-of-00003.safetensors', which has no such tensor"), std::string::npos)
      << e;
}

TEST(Checkpoint, BadIndexesAndFoldersAreNamed) {
  Folder folder;
  write_text(folder / "x.safetensors.index.json", "{\"weight_map\": {");
  EXPECT_NE(error_of([&] {
              open_checkpoint(folder / "x.safetensors.index.json");
            }).find("x.safetensors.index.json' is not valid JSON"),
            std::string::npos);
  write_text(folder / "x.safetensors.index.json", R"({"metadata": {}})");
  EXPECT_NE(
      error_of([&] { open_checkpoint(folder.path.string()); }).find("has no \"weight_map\" object"),
      std::string::npos);
  write_text(folder / "x.safetensors.index.json", R"({"weight_map": {"w": 3}})");
  EXPECT_NE(error_of([&] {
              open_checkpoint(folder.path.string());
            }).find("gives tensor 'w' the shard 3, not a file name"),
            std::string::npos);
  fs::remove(folder / "x.safetensors.index.json");
  EXPECT_NE(
      error_of([&] { open_checkpoint(folder.path.string()); }).find("holds no .safetensors file"),
      std::string::npos);
  const std::vector<float> a(6, 1.0f);
  write_safetensors(folder / "a.safetensors", {{"w", "F32", {6}, a.data()}});
  write_safetensors(folder / "b.safetensors", {{"w", "F32", {6}, a.data()}});
  const std::string e = error_of([&] { open_checkpoint(folder.path.string()); });
  EXPECT_NE(e.find("holds 2 .safetensors files ('a.safetensors', 'b.safetensors')"),
            std::string::npos)
      << e;
  write_text(folder / "bad.safetensors", "not a safetensors file at all");
  fs::remove(folder / "a.safetensors");
  fs::remove(folder / "b.safetensors");
  write_text(folder / "y.safetensors.index.json", R"({"weight_map": {"w": "bad.safetensors"}})");
  const std::string bad = error_of([&] { open_checkpoint(folder.path.string()); });
  EXPECT_NE(bad.find("the shard '" + (folder / "bad.safetensors") + "' of the index"),
            std::string::npos)
      << bad;
}

} // namespace
} // namespace blockswap
