// The reference transformer used by the tool, the benchmarks and the tests: a DiT-style stack
// of pre-norm blocks (LayerNorm, multi-head self-attention with qkv and output projections,
// LayerNorm, 4x MLP with GELU, residuals), optional LoRA adapters on every linear layer,
// deterministic initialisation from a seed, and weights in safetensors files named
// `blocks.{i}.{norm1,qkv,proj,norm2,fc1,fc2}.{weight,bias,lora_a,lora_b}`.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace blockswap::models {

struct TransformerConfig {
  int64_t blocks = 8;
  int64_t hidden = 512;
  int64_t heads = 8;
  int64_t lora_rank = 0; // 0: no adapters
  uint64_t seed = 0;
};

// y = x W^T + b + (x A^T) B^T. W and b are frozen; A and B (the adapter) are trained. B starts
// small rather than zero so that every adapter has a gradient from the first step.
class LoraLinearImpl : public torch::nn::Module {
public:
  LoraLinearImpl(int64_t in, int64_t out, int64_t rank);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias, lora_a, lora_b;
};
TORCH_MODULE(LoraLinear);

class TransformerBlockImpl : public torch::nn::Module {
public:
  TransformerBlockImpl(int64_t hidden, int64_t heads, int64_t lora_rank);
  torch::Tensor forward(const torch::Tensor& x); // [batch, tokens, hidden]

private:
  int64_t heads_;
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  LoraLinear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(TransformerBlock);

class ReferenceTransformer {
public:
  explicit ReferenceTransformer(TransformerConfig config);
  // Reads blocks, hidden size, heads and LoRA rank from the file and loads every weight. Every
  // tensor's name, dtype and shape is checked before anything is allocated or read: throws
  // blockswap::Error naming a missing, unexpected, misshaped or non-F32 tensor, a malformed
  // block index or a malformed `heads` metadata value. A file without adapters gets fresh
  // (deterministic) adapters of rank `adapter_rank` when it is positive, for training.
  static ReferenceTransformer load(const std::string& path, int64_t adapter_rank = 0);
  // The same model with its frozen weights built empty (torch::empty: memory never touched, so
  // never resident): for an offloader that reads them from the file (Options::weights_file and
  // weights_from_file). Adapters are read, or made as load() makes them. Host memory peaks at
  // one block.
  static ReferenceTransformer load_frozen_empty(const std::string& path, int64_t adapter_rank = 0);
  // The configuration a file holds (blocks, hidden, heads, adapter rank), from its header alone.
  static TransformerConfig config_of(const std::string& path);
  void save(const std::string& path) const;

  const TransformerConfig& config() const { return config_; }
  std::vector<TransformerBlock>& blocks() { return blocks_; }
  std::vector<std::shared_ptr<torch::nn::Module>> modules() const;
  std::vector<torch::Tensor> lora_parameters() const;
  // Bytes of the frozen weights of all blocks: what a device holds without swapping.
  uint64_t frozen_bytes() const;
  // Bytes of every weight of all blocks, frozen or trainable.
  uint64_t weight_bytes() const;
  torch::Tensor forward(torch::Tensor x);
  // A deterministic input of `tokens` tokens.
  torch::Tensor example_input(int64_t batch, int64_t tokens) const;

private:
  ReferenceTransformer(TransformerConfig config, bool frozen_empty);
  static ReferenceTransformer load(const std::string& path, int64_t adapter_rank,
                                   bool frozen_empty);

  TransformerConfig config_;
  std::vector<TransformerBlock> blocks_;
};

} // namespace blockswap::models
