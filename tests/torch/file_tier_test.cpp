// The file tier through ModelOffloader: the reference transformer's frozen weights read from its
// safetensors file (Options::weights_file, host_budget_bytes), at several K and host budgets,
// built with its weights in memory or on the meta device; inference and LoRA training bitwise
// the model run without blockswap; every failure an Error that loses nothing. Compiled with
// BLOCKSWAP_TEST_CUDA (label gpu) the same runs on a GPU (test_model.hpp's kDevice): the model
// without blockswap wholly on the GPU, the file tier's staging ring copied on the copy stream.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/model_io/checkpoint.hpp"
#include "blockswap/torch.hpp"
#include "reference_transformer.hpp"
#include "test_model.hpp"

namespace blockswap {
namespace {

namespace fs = std::filesystem;
using models::ReferenceTransformer;
using models::TransformerConfig;

constexpr TransformerConfig kConfig{6, 32, 4, 4, 0}; // blocks, hidden, heads, LoRA rank, seed

struct Scratch {
  fs::path dir = fs::temp_directory_path() / ("blockswap-file-tier-" + std::to_string(::getpid()));
  Scratch() { fs::create_directories(dir); }
  ~Scratch() { fs::remove_all(dir); }
  std::string file(const std::string& name) const { return (dir / name).string(); }
};

// The model without blockswap, built from kConfig, wholly on the test's device.
ReferenceTransformer plain_model() {
  ReferenceTransformer model(kConfig);
  for (auto& block : model.blocks()) block->to(kDevice);
  return model;
}

// The model saved, and the path of its file.
std::string saved(const Scratch& scratch) {
  const std::string path = scratch.file("model.safetensors");
  if (!fs::exists(path)) ReferenceTransformer(kConfig).save(path);
  return path;
}

// Every block in turn, through the offloader when there is one.
torch::Tensor forward(ReferenceTransformer& model, ModelOffloader* offloader, torch::Tensor x) {
  for (int64_t i = 0; i < int64_t(model.blocks().size()); ++i) {
    x = offloader ? offloader->run_block(i, {x},
                                         [&, i](const torch::autograd::variable_list& in) {
                                           return torch::autograd::variable_list{
                                               model.blocks()[i]->forward(in[0])};
                                         })[0]
                  : model.blocks()[i]->forward(x);
  }
  return x;
}

std::vector<torch::Tensor> infer(ReferenceTransformer& model, ModelOffloader* offloader,
                                 int passes) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> out;
  const torch::Tensor input = model.example_input(2, 5).to(kDevice);
  for (int pass = 0; pass < passes; ++pass) {
    torch::Tensor x = input;
    if (offloader) offloader->prepare_block_devices_before_forward();
    x = forward(model, offloader, x);
    out.push_back(x);
  }
  return out;
}

// Three SGD steps on the adapters: each step's loss, then the adapters.
std::vector<torch::Tensor> train(ReferenceTransformer& model, ModelOffloader* offloader) {
  torch::optim::SGD sgd(model.lora_parameters(), torch::optim::SGDOptions(0.1));
  const torch::Tensor input = model.example_input(2, 5).to(kDevice);
  std::vector<torch::Tensor> out;
  for (int step = 0; step < 3; ++step) {
    torch::Tensor x = input;
    if (offloader) offloader->prepare_block_devices_before_forward();
    x = forward(model, offloader, x);
    const torch::Tensor loss = x.pow(2).mean();
    sgd.zero_grad();
    loss.backward();
    sgd.step();
    out.push_back(loss.detach().clone());
  }
  for (const auto& p : model.lora_parameters()) out.push_back(p.detach().clone());
  return out;
}

void expect_bitwise(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].device(), b[i].device()) << "result " << i;
    EXPECT_TRUE(torch::equal(a[i].cpu(), b[i].cpu())) << "result " << i;
  }
}

Options file_tier(const std::string& path, int64_t k, std::size_t host_budget, bool train,
                  bool empty = true) {
  Options options;
  options.weights_from_file = empty;
  options.blocks_to_swap = k;
  options.supports_backward = train;
  options.weights_file = path;
  options.host_budget_bytes = host_budget;
  options.device = kDevice;
  return options;
}

std::size_t block_bytes(const ReferenceTransformer& model) {
  return packed_block_bytes(model.modules())[0]; // every block's is the same
}

TEST(FileTier, InferenceIsBitwiseAtEveryKAndHostBudget) {
  const Scratch scratch;
  const std::string path = saved(scratch);
  ReferenceTransformer plain = plain_model();
  const auto expected = infer(plain, nullptr, 3);
  for (int64_t k : {1, 3, 5}) {
    for (std::size_t budget_blocks : {0, 1, 6}) {
      for (bool empty : {false, true}) {
        SCOPED_TRACE(detail::concat("K ", k, ", host budget ", budget_blocks,
                                    " blocks, built empty ", empty));
        ReferenceTransformer model =
            empty ? ReferenceTransformer::load_frozen_empty(path) : ReferenceTransformer(kConfig);
        ModelOffloader offloader(
            "blocks", model.modules(),
            file_tier(path, k, budget_blocks * block_bytes(model) + 1, false, empty));
        expect_bitwise(infer(model, &offloader, 3), expected);
        if (budget_blocks == 0) {
          EXPECT_GT(offloader.stats().disk_bytes, 0u);
        } else if (budget_blocks == 6) {
          EXPECT_EQ(offloader.stats().disk_bytes, 0u);
        }
        // Off the device, a block's weights read their true values (views of the file).
        torch::NoGradGuard no_grad;
        for (int64_t b = 0; b < kConfig.blocks; ++b) {
          if (offloader.is_resident(b)) continue;
          const auto params = model.blocks()[b]->named_parameters();
          const auto plains = plain.blocks()[b]->named_parameters();
          for (const auto& item : params) {
            EXPECT_TRUE(torch::equal(item.value().cpu(), plains[item.key()].cpu())) << item.key();
          }
        }
      }
    }
  }
}

// A sharded checkpoint under other names: the saved file's block tensors renamed
// ("model.diffusion_model.layers.N.…", found through Options::weights_map and ComfyUI's prefix)
// and dealt into three shards, so that every block lies in all three; read from the shards
// for each load (opened by the index, or by its folder), bitwise; a missing shard named.
TEST(FileTier, AShardedCheckpointUnderOtherNamesIsBitwise) {
  const Scratch scratch;
  const std::string path = saved(scratch);
  ReferenceTransformer plain = plain_model();
  const auto expected = infer(plain, nullptr, 2);
  const blockswap::Checkpoint one = open_checkpoint(path);
  std::vector<std::vector<std::byte>> bytes;
  std::vector<std::vector<TensorData>> shards(3);
  std::string weight_map;
  std::size_t next = 0;
  for (const auto& [name, t] : one.tensors) {
    if (name.rfind("blocks.", 0) != 0) continue;
    std::ifstream in(path, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(t.offset));
    bytes.emplace_back(t.info.bytes());
    in.read(reinterpret_cast<char*>(bytes.back().data()),
            static_cast<std::streamsize>(t.info.bytes()));
    const std::string renamed = "model.diffusion_model.layers." + name.substr(7);
    shards[next % 3].push_back(
        TensorData{renamed, t.info.dtype, t.info.shape, bytes.back().data()});
    weight_map += detail::concat(weight_map.empty() ? "" : ", ", "\"", renamed, "\": \"s", next % 3,
                                 ".safetensors\"");
    ++next;
  }
  const fs::path folder = scratch.dir / "sharded";
  fs::create_directories(folder);
  for (std::size_t s = 0; s < 3; ++s) {
    write_safetensors((folder / detail::concat("s", s, ".safetensors")).string(), shards[s]);
  }
  const std::string index = (folder / "model.safetensors.index.json").string();
  std::ofstream(index) << "{\"metadata\": {}, \"weight_map\": {" << weight_map << "}}";
  for (const std::string& source : {index, folder.string()}) {
    for (bool empty : {false, true}) {
      SCOPED_TRACE(detail::concat(source, ", built empty ", empty));
      ReferenceTransformer model =
          empty ? ReferenceTransformer::load_frozen_empty(path) : ReferenceTransformer(kConfig);
      Options options = file_tier(source, 3, 0, false, empty);
      options.weights_map = [](const std::string& name) -> std::optional<FileSlice> {
        return FileSlice{"layers." + name}; // "N.<name>": weights_prefix is empty
      };
      ModelOffloader offloader("blocks", model.modules(), options);
      expect_bitwise(infer(model, &offloader, 2), expected);
      EXPECT_GT(offloader.stats().disk_bytes, 0u);
      for (int64_t b = 0; b < kConfig.blocks; ++b) EXPECT_TRUE(offloader.is_in_file(b)) << b;
    }
  }
  fs::remove(folder / "s1.safetensors");
  ReferenceTransformer model(kConfig);
  try {
    ModelOffloader offloader("blocks", model.modules(), file_tier(index, 3, 0, false, false));
    FAIL() << "a missing shard was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("s1.safetensors' that the index '" + index),
              std::string::npos)
        << e.what();
  }
}

TEST(FileTier, LoraTrainingIsBitwiseAtEveryKAndHostBudget) {
  const Scratch scratch;
  const std::string path = saved(scratch);
  ReferenceTransformer plain = plain_model();
  const auto expected = train(plain, nullptr);
  for (int64_t k : {1, 2, 4}) {
    for (std::size_t budget_blocks : {0, 2}) {
      SCOPED_TRACE(detail::concat("K ", k, ", host budget ", budget_blocks, " blocks"));
      ReferenceTransformer model = ReferenceTransformer::load_frozen_empty(path);
      ModelOffloader offloader("blocks", model.modules(),
                               file_tier(path, k, budget_blocks * block_bytes(model), true));
      expect_bitwise(train(model, &offloader), expected);
    }
  }
}

TEST(FileTier, WeightsFileAloneFillsEmptyBlocksInHostMemory) {
  const Scratch scratch;
  const std::string path = saved(scratch);
  ReferenceTransformer plain = plain_model();
  ReferenceTransformer model = ReferenceTransformer::load_frozen_empty(path);
  Options options;
  options.blocks_to_swap = 3;
  options.device = kDevice;
  options.weights_file = path; // no host budget: every block in host memory, read once
  options.weights_from_file = true;
  ModelOffloader offloader("blocks", model.modules(), options);
  expect_bitwise(infer(model, &offloader, 2), infer(plain, nullptr, 2));
  EXPECT_EQ(offloader.stats().disk_bytes, 0u);
}

TEST(FileTier, WeightsThatDifferFromTheFileAreRefused) {
  const Scratch scratch;
  const std::string path = saved(scratch);
  ReferenceTransformer model(kConfig);
  {
    torch::NoGradGuard no_grad;
    model.blocks()[4]->named_parameters()["fc1.weight"][0][0] += 1; // merged, fine-tuned, ...
  }
  const torch::Tensor before = model.blocks()[4]->named_parameters()["fc1.weight"].clone();
  try {
    ModelOffloader offloader("blocks", model.modules(), file_tier(path, 3, 0, false, false));
    FAIL() << "weights that differ from the file were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fc1.weight' of block 4 differs"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(torch::equal(model.blocks()[4]->named_parameters()["fc1.weight"], before));
}

TEST(FileTier, AFileWithoutTheBlocksOrOfAnotherDtypeIsNamed) {
  const Scratch scratch;
  const std::string path = saved(scratch);
  ReferenceTransformer other(TransformerConfig{6, 64, 4, 4, 0}); // hidden 64: other shapes
  try {
    ModelOffloader offloader("blocks", other.modules(), file_tier(path, 3, 0, false));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  ReferenceTransformer model(kConfig);
  Options prefixed = file_tier(path, 3, 0, false);
  prefixed.weights_prefix = "transformer_blocks.";
  try {
    ModelOffloader offloader("blocks", model.modules(), prefixed);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no tensor 'transformer_blocks.0."), std::string::npos)
        << e.what();
  }
  Options no_file;
  no_file.blocks_to_swap = 3;
  no_file.device = kDevice;
  no_file.host_budget_bytes = 0;
  EXPECT_THROW(ModelOffloader("blocks", model.modules(), no_file), InvalidArgument);
  Options from_nothing;
  from_nothing.blocks_to_swap = 3;
  from_nothing.device = kDevice;
  from_nothing.weights_from_file = true;
  EXPECT_THROW(ModelOffloader("blocks", model.modules(), from_nothing), InvalidArgument);
}

// Writes `value` into block `block`'s proj.weight, read from the file: the next pass raises,
// naming it, the tensor holds the file's values again, and the offloader goes on, exactly.
void expect_write_refused(ReferenceTransformer& model, ReferenceTransformer& plain,
                          ModelOffloader& offloader, int64_t block, double value) {
  {
    torch::NoGradGuard no_grad;
    model.blocks()[block]->named_parameters()["proj.weight"].fill_(value);
  }
  try {
    infer(model, &offloader, 1);
    FAIL() << "a change that cannot be kept was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cannot be kept"), std::string::npos) << what;
    EXPECT_NE(what.find(detail::concat("'proj.weight' of block ", block)), std::string::npos)
        << what;
  }
  EXPECT_TRUE(torch::equal(model.blocks()[block]->named_parameters()["proj.weight"].cpu(),
                           plain.blocks()[block]->named_parameters()["proj.weight"].cpu()));
  expect_bitwise(infer(model, &offloader, 2), infer(plain, nullptr, 2));
}

TEST(FileTier, ChangingAWeightReadFromTheFileRaisesAndKeepsTheFile) {
  const Scratch scratch;
  const std::string path = saved(scratch);
  ReferenceTransformer plain = plain_model();
  ReferenceTransformer model = ReferenceTransformer::load_frozen_empty(path);
  ModelOffloader offloader("blocks", model.modules(), file_tier(path, 3, 0, false));
  infer(model, &offloader, 1);
  int64_t away = 0;
  while (offloader.is_resident(away)) ++away;
  expect_write_refused(model, plain, offloader, away, 0); // a checkpoint loaded into it
  // The file is as it was: a new offloader over a fresh model computes the true result.
  ReferenceTransformer again = ReferenceTransformer::load_frozen_empty(path);
  ModelOffloader fresh("blocks", again.modules(), file_tier(path, 3, 0, false));
  expect_bitwise(infer(again, &fresh, 1), infer(plain, nullptr, 1));
}

// K = 0: every block stays on the device for good, so no move would ever see the write, and
// close() would drop it; the next pass raises instead, as for a block that moves.
TEST(FileTier, ChangingAWeightOfABlockThatNeverMovesRaisesAtTheNextPass) {
  const Scratch scratch;
  const std::string path = saved(scratch);
  ReferenceTransformer plain = plain_model();
  ReferenceTransformer model = ReferenceTransformer::load_frozen_empty(path);
  ModelOffloader offloader("blocks", model.modules(), file_tier(path, 0, 0, false));
  infer(model, &offloader, 1);
  expect_write_refused(model, plain, offloader, 1, 2);
}

TEST(FileTier, AFileTruncatedUnderTheRunIsAnError) {
  const Scratch scratch;
  const std::string path = saved(scratch);
  const std::string copy = scratch.file("copy.safetensors");
  fs::copy_file(path, copy);
  ReferenceTransformer model = ReferenceTransformer::load_frozen_empty(copy);
  ModelOffloader offloader("blocks", model.modules(), file_tier(copy, 3, 0, false));
  infer(model, &offloader, 1);
  fs::resize_file(copy, fs::file_size(copy) / 2);
  try {
    infer(model, &offloader, 2);
    FAIL() << "a truncated file went unnoticed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(copy), std::string::npos) << e.what();
  }
  // Reading the model (a checkpoint saved after the error) must not crash the process: the
  // blocks off the device no longer view the file past its new end.
  torch::NoGradGuard no_grad;
  for (auto& block : model.blocks()) {
    for (const auto& p : block->parameters()) (void)p.sum().item<float>();
  }
}

} // namespace
} // namespace blockswap
