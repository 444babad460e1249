#include "reference_transformer.hpp"

#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <set>

#include "blockswap/error.hpp"
#include "blockswap/safetensors.hpp"

namespace blockswap::models {

LoraLinearImpl::LoraLinearImpl(int64_t in, int64_t out, int64_t rank) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  weight = register_parameter("weight", torch::empty({out, in}).uniform_(-bound, bound), false);
  bias = register_parameter("bias", torch::empty({out}).uniform_(-bound, bound), false);
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

ReferenceTransformer::ReferenceTransformer(TransformerConfig config) : config_(config) {
  BLOCKSWAP_CHECK(config.blocks >= 1, "the reference transformer needs at least one block");
  BLOCKSWAP_CHECK(config.hidden >= 1, "hidden size must be positive, got ", config.hidden);
  torch::manual_seed(config.seed);
  for (int64_t i = 0; i < config.blocks; ++i) {
    blocks_.emplace_back(config.hidden, config.heads, config.lora_rank);
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

ReferenceTransformer ReferenceTransformer::load(const std::string& path) {
  const SafetensorsHeader header = read_safetensors_header(path);
  TransformerConfig config;
  std::set<int64_t> indices;
  for (const TensorInfo& t : header.tensors) {
    BLOCKSWAP_CHECK(t.name.rfind("blocks.", 0) == 0, path, ": tensor '", t.name,
                    "' is not a reference transformer weight (blocks.N.…)");
    indices.insert(std::stoll(t.name.substr(7)));
    if (t.name == "blocks.0.norm1.weight") config.hidden = t.shape.at(0);
    if (t.name == "blocks.0.qkv.lora_a") config.lora_rank = t.shape.at(0);
  }
  BLOCKSWAP_CHECK(!indices.empty() && *indices.rbegin() + 1 == int64_t(indices.size()), path,
                  ": block indices must run from 0 without gaps");
  config.blocks = static_cast<int64_t>(indices.size());
  if (header.metadata.contains("heads")) config.heads = std::stoll(header.metadata.at("heads"));
  ReferenceTransformer model(config);

  std::ifstream file(path, std::ios::binary);
  BLOCKSWAP_CHECK(file.is_open(), "cannot open '", path, "'");
  std::size_t loaded = 0;
  for (const TensorInfo& t : header.tensors) {
    const auto dot = t.name.find('.', 7);
    const int64_t i = std::stoll(t.name.substr(7, dot - 7));
    const std::string key = t.name.substr(dot + 1);
    torch::Tensor* target = model.blocks_[i]->named_parameters().find(key);
    BLOCKSWAP_CHECK(target != nullptr, path, ": unexpected tensor '", t.name, "'");
    BLOCKSWAP_CHECK(t.dtype == "F32" && t.shape == target->sizes().vec(), path, ": tensor '",
                    t.name, "' is ", t.dtype, " of shape ", c10::IntArrayRef(t.shape),
                    ", expected F32 of shape ", target->sizes());
    torch::NoGradGuard no_grad;
    file.seekg(static_cast<std::streamoff>(header.data_offset() + t.begin));
    file.read(static_cast<char*>(target->data_ptr()), static_cast<std::streamsize>(t.bytes()));
    BLOCKSWAP_CHECK(file.good(), path, ": cannot read tensor '", t.name, "'");
    ++loaded;
  }
  BLOCKSWAP_CHECK(loaded == model.modules().size() * model.blocks_[0]->parameters().size(), path,
                  ": ", loaded, " tensors, but the model has ",
                  model.modules().size() * model.blocks_[0]->parameters().size());
  return model;
}

} // namespace blockswap::models
