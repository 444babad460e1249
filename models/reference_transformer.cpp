#include "reference_transformer.hpp"

#include <torch/torch.h>

#include <charconv>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <system_error>
#include <utility>

#include "blockswap/core/error.hpp"
#include "blockswap/model_io/safetensors.hpp"

namespace blockswap::models {

LoraLinearImpl::LoraLinearImpl(int64_t in, int64_t out, int64_t rank) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  // torch::nn::init::uniform_ draws what Tensor::uniform_ draws; inlining the latter here makes
  // GCC warn (-Wmaybe-uninitialized, a false positive) in the sanitized build.
  weight = register_parameter(
      "weight", torch::nn::init::uniform_(torch::empty({out, in}), -bound, bound), false);
  bias = register_parameter("bias", torch::nn::init::uniform_(torch::empty({out}), -bound, bound),
                            false);
  if (rank > 0) {
    lora_a = register_parameter("lora_a", torch::randn({rank, in}) * bound);
    lora_b = register_parameter("lora_b", torch::randn({out, rank}) * 0.01);
  }
}

torch::Tensor LoraLinearImpl::forward(const torch::Tensor& x) {
  torch::Tensor y = torch::linear(x, weight, bias);
  if (lora_a.defined()) y = y + torch::linear(torch::linear(x, lora_a), lora_b);
  return y;
}

TransformerBlockImpl::TransformerBlockImpl(int64_t hidden, int64_t heads, int64_t lora_rank)
    : heads_(heads) {
  BLOCKSWAP_CHECK(heads > 0 && hidden % heads == 0, "hidden size ", hidden, " is not divisible by ",
                  heads, " heads");
  norm1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
  qkv_ = register_module("qkv", LoraLinear(hidden, 3 * hidden, lora_rank));
  proj_ = register_module("proj", LoraLinear(hidden, hidden, lora_rank));
  norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
  fc1_ = register_module("fc1", LoraLinear(hidden, 4 * hidden, lora_rank));
  fc2_ = register_module("fc2", LoraLinear(4 * hidden, hidden, lora_rank));
  for (auto& p : norm1_->parameters()) p.set_requires_grad(false);
  for (auto& p : norm2_->parameters()) p.set_requires_grad(false);
}

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x) {
  const int64_t batch = x.size(0), tokens = x.size(1), hidden = x.size(2);
  const int64_t head_dim = hidden / heads_;
  auto qkv = qkv_(norm1_(x)).view({batch, tokens, 3, heads_, head_dim}).permute({2, 0, 3, 1, 4});
  const torch::Tensor q = qkv[0], k = qkv[1], v = qkv[2]; // [batch, heads, tokens, head_dim]
  const torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(head_dim));
  const torch::Tensor attended = torch::matmul(torch::softmax(scores, -1), v);
  const torch::Tensor h = x + proj_(attended.transpose(1, 2).reshape({batch, tokens, hidden}));
  return h + fc2_(torch::gelu(fc1_(norm2_(h))));
}

ReferenceTransformer::ReferenceTransformer(TransformerConfig config)
    : ReferenceTransformer(config, false) {}

ReferenceTransformer::ReferenceTransformer(TransformerConfig config, bool frozen_empty)
    : config_(config) {
  BLOCKSWAP_CHECK(config.blocks >= 1, "the reference transformer needs at least one block");
  BLOCKSWAP_CHECK(config.hidden >= 1, "hidden size must be positive, got ", config.hidden);
  torch::manual_seed(config.seed);
  for (int64_t i = 0; i < config.blocks; ++i) {
    blocks_.emplace_back(config.hidden, config.heads, config.lora_rank);
    if (!frozen_empty) continue;
    for (auto& p : blocks_.back()->parameters()) { // the same random draws, then let go
      if (!p.requires_grad()) p.set_data(torch::empty(p.sizes(), p.options()));
    }
  }
}

std::vector<std::shared_ptr<torch::nn::Module>> ReferenceTransformer::modules() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& b : blocks_) out.push_back(b.ptr());
  return out;
}

std::vector<torch::Tensor> ReferenceTransformer::lora_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& b : blocks_) {
    for (const auto& p : b->parameters()) {
      if (p.requires_grad()) out.push_back(p);
    }
  }
  return out;
}

uint64_t ReferenceTransformer::frozen_bytes() const {
  uint64_t bytes = 0;
  for (const auto& b : blocks_) {
    for (const auto& p : b->parameters()) {
      if (!p.requires_grad()) bytes += p.nbytes();
    }
  }
  return bytes;
}

uint64_t ReferenceTransformer::weight_bytes() const {
  uint64_t bytes = 0;
  for (const auto& b : blocks_) {
    for (const auto& p : b->parameters()) bytes += p.nbytes();
  }
  return bytes;
}

torch::Tensor ReferenceTransformer::forward(torch::Tensor x) {
  for (auto& b : blocks_) x = b->forward(x);
  return x;
}

torch::Tensor ReferenceTransformer::example_input(int64_t batch, int64_t tokens) const {
  torch::manual_seed(config_.seed + 1);
  return torch::randn({batch, tokens, config_.hidden});
}

void ReferenceTransformer::save(const std::string& path) const {
  std::vector<TensorData> tensors;
  std::vector<torch::Tensor> keep;
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    for (const auto& item : blocks_[i]->named_parameters()) {
      keep.push_back(item.value().detach().to(torch::kCPU).contiguous());
      tensors.push_back({"blocks." + std::to_string(i) + "." + item.key(), "F32",
                         keep.back().sizes().vec(), keep.back().data_ptr()});
    }
  }
  write_safetensors(path, tensors,
                    {{"format", "blockswap-reference"}, {"heads", std::to_string(config_.heads)}});
}

namespace {

constexpr const char* kHiddenTensor = "blocks.0.norm1.weight";
constexpr const char* kRankTensor = "blocks.0.qkv.lora_a";

// A block's tensors: `blocks.{i}.{key}`, i written without leading zeros.
struct BlockTensorName {
  int64_t block = 0;
  std::string key;
};

BlockTensorName parse_name(const std::string& path, const std::string& name) {
  BLOCKSWAP_CHECK(name.rfind("blocks.", 0) == 0, path, ": tensor '", name,
                  "' is not a reference transformer weight (blocks.N.…)");
  const auto dot = name.find('.', 7);
  const std::string index = name.substr(7, dot == std::string::npos ? dot : dot - 7);
  int64_t block = -1;
  const char* end = index.data() + index.size();
  const auto [ptr, ec] = std::from_chars(index.data(), end, block);
  const bool ok = dot != std::string::npos && dot + 1 < name.size() && ec == std::errc() &&
                  ptr == end && block >= 0 && (index.size() == 1 || index[0] != '0');
  BLOCKSWAP_CHECK(ok, path, ": tensor '", name, "' has a malformed block index '", index,
                  "': expected blocks.N.<weight> with N = 0, 1, 2, …");
  return {block, name.substr(dot + 1)};
}

// Every tensor of a block, with its shape, for hidden size h and LoRA rank r (0: no adapters).
std::map<std::string, std::vector<int64_t>> block_shapes(int64_t h, int64_t r) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const char* norm : {"norm1", "norm2"}) {
    shapes[std::string(norm) + ".weight"] = {h};
    shapes[std::string(norm) + ".bias"] = {h};
  }
  const std::pair<const char*, std::pair<int64_t, int64_t>> linears[] = {
      {"qkv", {3 * h, h}}, {"proj", {h, h}}, {"fc1", {4 * h, h}}, {"fc2", {h, 4 * h}}};
  for (const auto& [name, out_in] : linears) {
    const auto [out, in] = out_in;
    const std::string prefix = std::string(name) + ".";
    shapes[prefix + "weight"] = {out, in};
    shapes[prefix + "bias"] = {out};
    if (r > 0) {
      shapes[prefix + "lora_a"] = {r, in};
      shapes[prefix + "lora_b"] = {out, r};
    }
  }
  return shapes;
}

const TensorInfo* find_tensor(const SafetensorsHeader& header, const std::string& name) {
  for (const TensorInfo& t : header.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// Reads the configuration from the header and checks every tensor's name, dtype and shape
// against it, so that nothing is allocated or read for a file that does not describe a model.
TransformerConfig checked_config(const std::string& path, const SafetensorsHeader& header) {
  for (const TensorInfo& t : header.tensors) parse_name(path, t.name);
  TransformerConfig config;
  const TensorInfo* norm = find_tensor(header, kHiddenTensor);
  BLOCKSWAP_CHECK(norm != nullptr, path, ": tensor '", kHiddenTensor,
                  "' is missing (it gives the hidden size)");
  BLOCKSWAP_CHECK(norm->shape.size() == 1 && norm->shape[0] >= 1, path, ": tensor '", kHiddenTensor,
                  "' has shape ", c10::IntArrayRef(norm->shape),
                  ", expected [hidden] (one dimension: the hidden size)");
  config.hidden = norm->shape[0];
  // The shapes below multiply it by itself: keep them far from overflowing.
  constexpr int64_t kMaxHidden = int64_t(1) << 20;
  BLOCKSWAP_CHECK(config.hidden <= kMaxHidden, path, ": tensor '", kHiddenTensor,
                  "' gives a hidden size of ", config.hidden, ", more than ", kMaxHidden);
  if (const TensorInfo* a = find_tensor(header, kRankTensor)) {
    BLOCKSWAP_CHECK(a->shape.size() == 2 && a->shape[0] >= 1 && a->shape[1] == config.hidden, path,
                    ": tensor '", kRankTensor, "' has shape ", c10::IntArrayRef(a->shape),
                    ", expected [rank, ", config.hidden, "]");
    config.lora_rank = a->shape[0];
  }

  const auto shapes = block_shapes(config.hidden, config.lora_rank);
  std::map<int64_t, std::set<std::string>> blocks;
  for (const TensorInfo& t : header.tensors) {
    const BlockTensorName name = parse_name(path, t.name);
    const auto expected = shapes.find(name.key);
    BLOCKSWAP_CHECK(expected != shapes.end(), path, ": unexpected tensor '", t.name,
                    "' for a reference transformer of hidden size ", config.hidden,
                    config.lora_rank > 0 ? " with LoRA adapters" : " without LoRA adapters");
    BLOCKSWAP_CHECK(t.dtype == "F32" && t.shape == expected->second, path, ": tensor '", t.name,
                    "' is ", t.dtype, " of shape ", c10::IntArrayRef(t.shape),
                    ", expected F32 of shape ", c10::IntArrayRef(expected->second));
    blocks[name.block].insert(name.key);
  }
  const int64_t last = blocks.rbegin()->first; // not empty: kHiddenTensor is there
  BLOCKSWAP_CHECK(last + 1 == int64_t(blocks.size()), path,
                  ": block indices must run from 0 without gaps, but the file has ", blocks.size(),
                  " blocks up to blocks.", last);
  for (const auto& [block, keys] : blocks) {
    for (const auto& [key, shape] : shapes) {
      BLOCKSWAP_CHECK(keys.count(key) == 1, path, ": tensor 'blocks.", block, ".", key,
                      "' is missing");
    }
  }
  config.blocks = last + 1;

  const auto heads = header.metadata.find("heads");
  if (heads != header.metadata.end()) {
    const std::string& text = heads->second;
    const char* end = text.data() + text.size();
    const auto [ptr, ec] = std::from_chars(text.data(), end, config.heads);
    BLOCKSWAP_CHECK(!text.empty() && ec == std::errc() && ptr == end && config.heads >= 1, path,
                    ": metadata 'heads' is '", text, "', expected a positive integer");
  }
  BLOCKSWAP_CHECK(config.hidden % config.heads == 0, path, ": ",
                  heads != header.metadata.end() ? "metadata 'heads' is " : "the default of ",
                  config.heads,
                  heads != header.metadata.end() ? "" : " heads (no 'heads' metadata)",
                  ", which does not divide the hidden size ", config.hidden);
  return config;
}

} // namespace

TransformerConfig ReferenceTransformer::config_of(const std::string& path) {
  return checked_config(path, read_safetensors_header(path));
}

ReferenceTransformer ReferenceTransformer::load(const std::string& path, int64_t adapter_rank) {
  return load(path, adapter_rank, false);
}

ReferenceTransformer ReferenceTransformer::load_frozen_empty(const std::string& path,
                                                             int64_t adapter_rank) {
  return load(path, adapter_rank, true);
}

ReferenceTransformer ReferenceTransformer::load(const std::string& path, int64_t adapter_rank,
                                                bool frozen_empty) {
  const SafetensorsHeader header = read_safetensors_header(path);
  TransformerConfig config = checked_config(path, header);
  if (config.lora_rank == 0 && adapter_rank > 0) config.lora_rank = adapter_rank; // fresh ones
  ReferenceTransformer model(config, frozen_empty);
  std::set<const void*> empty; // not read: the offloader reads them
  if (frozen_empty) {
    for (const auto& block : model.blocks_) {
      for (const auto& p : block->parameters()) {
        if (!p.requires_grad()) empty.insert(p.unsafeGetTensorImpl());
      }
    }
  }

  std::ifstream file(path, std::ios::binary);
  BLOCKSWAP_CHECK(file.is_open(), "cannot open '", path, "'");
  // named_parameters() returns a dict by value, and find() points into it: keep each alive.
  std::vector<torch::OrderedDict<std::string, torch::Tensor>> parameters;
  for (const auto& block : model.blocks_) parameters.push_back(block->named_parameters());
  torch::NoGradGuard no_grad;
  for (const TensorInfo& t : header.tensors) {
    const BlockTensorName name = parse_name(path, t.name);
    torch::Tensor* target = parameters.at(name.block).find(name.key);
    BLOCKSWAP_ASSERT(target != nullptr && target->sizes() == c10::IntArrayRef(t.shape) &&
                         target->nbytes() == t.bytes(),
                     t.name);
    if (empty.contains(target->unsafeGetTensorImpl())) continue;
    file.seekg(static_cast<std::streamoff>(header.data_offset() + t.begin));
    file.read(static_cast<char*>(target->data_ptr()), static_cast<std::streamsize>(t.bytes()));
    BLOCKSWAP_CHECK(file.good(), path, ": cannot read tensor '", t.name, "'");
  }
  return model;
}

} // namespace blockswap::models
