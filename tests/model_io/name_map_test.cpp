// locate_tensor through the name maps: the same names, Black Forest Labs' FLUX layout (its fused
// qkv and linear1 read as row slices), ComfyUI's prefix, fp8 scales either way, a user's map;
// every name that cannot be matched, and every transform that is not a slice, named.
#include "blockswap/model_io/name_map.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kH = 4; // hidden size: qkv is [3H, H], linear1 [7H, H]

struct File {
  fs::path path;
  Checkpoint checkpoint;
  explicit File(const std::string& prefix) {
    path = fs::temp_directory_path() /
           ("blockswap_name_map_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) +
            ".safetensors");
    std::vector<float> qkv(3 * kH * kH), bias(3 * kH), lin1(7 * kH * kH), scale(kH),
        modulation(2 * kH);
    std::iota(qkv.begin(), qkv.end(), 0.0f);
    std::iota(bias.begin(), bias.end(), 1000.0f);
    std::iota(lin1.begin(), lin1.end(), 2000.0f);
    const float one = 1.5f;
    const std::vector<uint8_t> fp8(kH * kH, 0x38);
    write_safetensors(
        path.string(),
        {{prefix + "double_blocks.0.img_attn.qkv.weight", "F32", {3 * kH, kH}, qkv.data()},
         {prefix + "double_blocks.0.img_attn.qkv.bias", "F32", {3 * kH}, bias.data()},
         {prefix + "double_blocks.0.img_attn.norm.query_norm.scale", "F32", {kH}, scale.data()},
         {prefix + "double_blocks.0.img_mlp.2.weight", "F8_E4M3", {kH, kH}, fp8.data()},
         {prefix + "double_blocks.0.img_mlp.2.weight_scale", "F32", {}, &one},
         {prefix + "single_blocks.1.linear1.weight", "F32", {7 * kH, kH}, lin1.data()},
         {prefix + "final_layer.adaLN_modulation.1.weight", "F32", {2 * kH}, modulation.data()}});
    checkpoint = open_checkpoint(path.string());
  }
  ~File() { fs::remove(path); }
  uint64_t at(const std::string& name) const { return checkpoint.tensors.at(name).offset; }
};

const NameMap kFlux = layout_map(WeightsLayout::flux);

TEST(NameMap, FluxsFusedQkvIsThreeRowSlices) {
  const File file("");
  EXPECT_TRUE(in_flux_layout(file.checkpoint));
  const uint64_t row = kH * 4;
  const char* parts[] = {"to_q", "to_k", "to_v"};
  for (int p = 0; p < 3; ++p) {
    const Located w = locate_tensor(
        file.checkpoint, kFlux, std::string("transformer_blocks.0.attn.") + parts[p] + ".weight",
        "F32", {kH, kH});
    ASSERT_TRUE(w.tensor) << w.why;
    EXPECT_EQ(w.tensor->offset, file.at("double_blocks.0.img_attn.qkv.weight") + p * kH * row);
    EXPECT_EQ(w.tensor->bytes, kH * row);
    EXPECT_EQ(w.tensor->source, "'double_blocks.0.img_attn.qkv.weight' rows [" +
                                    std::to_string(p * kH) + ", " + std::to_string(p * kH + kH) +
                                    ")");
    const Located b =
        locate_tensor(file.checkpoint, kFlux,
                      std::string("transformer_blocks.0.attn.") + parts[p] + ".bias", "F32", {kH});
    ASSERT_TRUE(b.tensor) << b.why;
    EXPECT_EQ(b.tensor->offset, file.at("double_blocks.0.img_attn.qkv.bias") + p * kH * 4);
  }
  const Located norm =
      locate_tensor(file.checkpoint, kFlux, "transformer_blocks.0.attn.norm_q.weight", "F32", {kH});
  ASSERT_TRUE(norm.tensor) << norm.why;
  EXPECT_EQ(norm.tensor->offset, file.at("double_blocks.0.img_attn.norm.query_norm.scale"));
}

TEST(NameMap, FluxsLinear1GivesQkvAndTheMlpInTheRatio1114) {
  const File file("");
  const uint64_t row = kH * 4, base = file.at("single_blocks.1.linear1.weight");
  const Located v = locate_tensor(file.checkpoint, kFlux,
                                  "single_transformer_blocks.1.attn.to_v.weight", "F32", {kH, kH});
  ASSERT_TRUE(v.tensor) << v.why;
  EXPECT_EQ(v.tensor->offset, base + 2 * kH * row);
  const Located mlp = locate_tensor(
      file.checkpoint, kFlux, "single_transformer_blocks.1.proj_mlp.weight", "F32", {4 * kH, kH});
  ASSERT_TRUE(mlp.tensor) << mlp.why;
  EXPECT_EQ(mlp.tensor->offset, base + 3 * kH * row);
  EXPECT_EQ(mlp.tensor->bytes, 4 * kH * row);
}

TEST(NameMap, ComfyUIsPrefixAndFp8ScalesAreFound) {
  const File file("model.diffusion_model.");
  const Located w = locate_tensor(file.checkpoint, kFlux, "transformer_blocks.0.ff.net.2.weight",
                                  "F8_E4M3", {kH, kH});
  ASSERT_TRUE(w.tensor) << w.why;
  EXPECT_EQ(w.tensor->offset, file.at("model.diffusion_model.double_blocks.0.img_mlp.2.weight"));
  // The module's "scale_weight" is the file's "weight_scale".
  const Located s = locate_tensor(file.checkpoint, kFlux,
                                  "transformer_blocks.0.ff.net.2.scale_weight", "F32", {});
  ASSERT_TRUE(s.tensor) << s.why;
  EXPECT_EQ(s.tensor->bytes, 4u);
  // The identity map finds the BFL names under ComfyUI's prefix too.
  const Located same = locate_tensor(file.checkpoint, nullptr, "single_blocks.1.linear1.weight",
                                     "F32", {7 * kH, kH});
  ASSERT_TRUE(same.tensor) << same.why;
}

TEST(NameMap, WhatCannotBeMatchedIsNamed) {
  const File file("");
  const Located missing = locate_tensor(file.checkpoint, kFlux,
                                        "transformer_blocks.1.attn.to_q.weight", "F32", {kH, kH});
  EXPECT_FALSE(missing.tensor);
  EXPECT_NE(missing.why.find("has no tensor 'double_blocks.1.img_attn.qkv.weight' (looked for "
                             "'double_blocks.1.img_attn.qkv.weight', 'model.diffusion_model."),
            std::string::npos)
      << missing.why;
  const Located unknown =
      locate_tensor(file.checkpoint, kFlux, "transformer_blocks.0.attn.extra.weight", "F32", {kH});
  EXPECT_NE(unknown.why.find("has no tensor for 'transformer_blocks.0.attn.extra.weight' (the name "
                             "map gives none)"),
            std::string::npos)
      << unknown.why;
  const Located shape = locate_tensor(file.checkpoint, kFlux,
                                      "transformer_blocks.0.attn.to_k.weight", "F32", {kH, 2 * kH});
  EXPECT_NE(
      shape.why.find("has 'double_blocks.0.img_attn.qkv.weight' rows [4, 8) as F32 [4, 4], but "
                     "the module's tensor 'transformer_blocks.0.attn.to_k.weight' is F32 [4, 8]"),
      std::string::npos)
      << shape.why;
  const Located dtype = locate_tensor(file.checkpoint, kFlux,
                                      "transformer_blocks.0.attn.to_k.weight", "BF16", {kH, kH});
  EXPECT_NE(dtype.why.find("is BF16 [4, 4]"), std::string::npos) << dtype.why;
  const Located swapped =
      locate_tensor(file.checkpoint, kFlux, "norm_out.linear.weight", "F32", {2 * kH});
  EXPECT_NE(swapped.why.find("as 'final_layer.adaLN_modulation.1.weight' with its shift and scale "
                             "halves swapped"),
            std::string::npos)
      << swapped.why;
  EXPECT_NE(swapped.why.find("not a row slice"), std::string::npos);
}

TEST(NameMap, AUsersMapGivesRows) {
  const File file("");
  const NameMap rows = [](const std::string& name) -> std::optional<FileSlice> {
    if (name == "0.q") return FileSlice{"double_blocks.0.img_attn.qkv.weight", 2, 6};
    if (name == "0.too_far") return FileSlice{"double_blocks.0.img_attn.qkv.weight", 10, 13};
    return std::nullopt;
  };
  const Located q = locate_tensor(file.checkpoint, rows, "0.q", "F32", {4, kH});
  ASSERT_TRUE(q.tensor) << q.why;
  EXPECT_EQ(q.tensor->offset, file.at("double_blocks.0.img_attn.qkv.weight") + 2 * kH * 4);
  const Located far = locate_tensor(file.checkpoint, rows, "0.too_far", "F32", {3, kH});
  EXPECT_NE(far.why.find("which has no rows [10, 13)"), std::string::npos) << far.why;
}

TEST(NameMap, LayoutsAreParsedAndNamed) {
  EXPECT_EQ(parse_weights_layout(""), WeightsLayout::automatic);
  EXPECT_EQ(parse_weights_layout("auto"), WeightsLayout::automatic);
  EXPECT_EQ(parse_weights_layout("flux"), WeightsLayout::flux);
  EXPECT_EQ(parse_weights_layout("diffusers"), WeightsLayout::diffusers);
  EXPECT_THROW(parse_weights_layout("comfy"), Error);
  EXPECT_EQ(layout_prefixes(WeightsLayout::flux).size(), 2u);
  EXPECT_EQ(layout_map(WeightsLayout::diffusers)("a.0.b")->name, "a.0.b");
}

} // namespace
} // namespace blockswap
