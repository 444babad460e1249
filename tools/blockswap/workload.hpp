// The work `blockswap run` and `blockswap bench` time: steps of the reference transformer,
// with or without a ModelOffloader.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "blockswap/torch.hpp"
#include "commands.hpp"
#include "reference_transformer.hpp"

namespace blockswap::tool {

struct Phase {
  double step_seconds = 0; // the median of the measured steps
  std::vector<torch::Tensor> results;
  // With activations counted: the device bytes saved activations held at their peak, over the
  // steps (ActivationStats::peak_device_bytes).
  uint64_t peak_activation_bytes = 0;
};

// What a step does: inference, LoRA training (frozen base weights, adapters stepped by SGD),
// or full fine-tuning (every block weight trains with AdamW: LibTorch's own without
// blockswap, the fused step with it).
enum class Work { infer, train, finetune };

// Work from --mode: "infer", "train", "finetune".
Work work_of(const std::string& mode);
// Where the fused step runs, from --step-on: "auto", "device", "host".
StepOn step_on_of(const std::string& where);
// The AdamW of `--mode finetune`, both ways.
FusedAdamW finetune_adamw();
// Makes every block weight of `model` trainable (before an offloader is built over it).
void make_trainable(models::ReferenceTransformer& model);

// Data-parallel training: what happens to the adapters' gradients between backward and the
// SGD step (an all-reduce over the ranks).
using GradientReducer = std::function<void(std::vector<torch::Tensor>& grads)>;

// One step of the reference transformer, through `offloader` when it is not null.
class StepRunner {
public:
  StepRunner(models::ReferenceTransformer& model, ModelOffloader* offloader, torch::Tensor input,
             Work work, GradientReducer reduce = {});
  // Counts the device bytes saved activations hold in each step (the offloader's own scopes
  // with Options::offload_activations; without an offloader, a counting ActivationScope around
  // each block).
  void count_activations() { count_activations_ = true; }
  uint64_t peak_activation_bytes() const { return peak_activation_bytes_; }
  // Runs a step and returns its seconds. Training: the loss and every adapter gradient go to
  // `results` (when not null) and the adapters take an SGD step; fine-tuning: the loss, and
  // the weights take an AdamW step; inference: the output.
  double step(std::vector<torch::Tensor>* results);
  // Fine-tuning: every block weight, to compare after the last step.
  void add_weights(std::vector<torch::Tensor>& results) const;

private:
  double timed_step(std::vector<torch::Tensor>* results);
  torch::Tensor forward();
  models::ReferenceTransformer& model_;
  ModelOffloader* offloader_;
  torch::Tensor input_;
  Work work_;
  std::vector<torch::Tensor> adapters_;
  GradientReducer reduce_;
  std::unique_ptr<torch::optim::AdamW> adamw_; // fine-tuning without blockswap
  bool count_activations_ = false;
  uint64_t peak_activation_bytes_ = 0;
};

double median(std::vector<double> values);

// The model without swapping and a copy of it through `offloader`, step by step in turn (one
// warm-up step each, then `steps` measured), so that both see the same machine conditions.
std::pair<Phase, Phase> run_side_by_side(models::ReferenceTransformer& plain,
                                         models::ReferenceTransformer& swapped,
                                         ModelOffloader& offloader, const torch::Tensor& input,
                                         Work work, int steps, const GradientReducer& reduce = {},
                                         bool count_activations = false);

// One model alone (through `offloader` when it is not null): one warm-up step, then `steps`
// measured; the offloader's stats count the measured steps only.
Phase run_alone(models::ReferenceTransformer& model, ModelOffloader* offloader,
                const torch::Tensor& input, Work work, int steps);

double max_abs_diff(const Phase& a, const Phase& b);

// `blockswap run --host-budget` (run_from_file.cpp): the baseline, then the three tiers.
int run_from_file(const RunArgs& args, c10::Device device, int64_t blocks_to_swap);
// The offloader's device, in `options`: with --pinnable-bytes, an emulated device that pins at
// most that much host memory (shared_device), else one of the offloader's own.
void use_device(const RunArgs& args, c10::Device device, Options& options);
std::string milliseconds(double seconds);

} // namespace blockswap::tool
