// The work `blockswap run` and `blockswap bench` time: steps of the reference transformer,
// with or without a ModelOffloader.
#pragma once

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "blockswap/torch.hpp"
#include "reference_transformer.hpp"

namespace blockswap::tool {

struct Phase {
  double step_seconds = 0; // the median of the measured steps
  std::vector<torch::Tensor> results;
};

// One step of the reference transformer, through `offloader` when it is not null.
class StepRunner {
public:
  StepRunner(models::ReferenceTransformer& model, ModelOffloader* offloader, torch::Tensor input,
             bool train);
  // Runs a step and returns its seconds. Training: the loss and every adapter gradient go to
  // `results` (when not null) and the adapters take an SGD step; inference: the output.
  double step(std::vector<torch::Tensor>* results);

private:
  torch::Tensor forward();
  models::ReferenceTransformer& model_;
  ModelOffloader* offloader_;
  torch::Tensor input_;
  bool train_;
  std::vector<torch::Tensor> adapters_;
};

double median(std::vector<double> values);

// The model without swapping and a copy of it through `offloader`, step by step in turn (one
// warm-up step each, then `steps` measured), so that both see the same machine conditions.
std::pair<Phase, Phase> run_side_by_side(models::ReferenceTransformer& plain,
                                         models::ReferenceTransformer& swapped,
                                         ModelOffloader& offloader, const torch::Tensor& input,
                                         bool train, int steps);

double max_abs_diff(const Phase& a, const Phase& b);
std::string milliseconds(double seconds);

} // namespace blockswap::tool
