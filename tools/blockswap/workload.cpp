#include "workload.hpp"

#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "blockswap/core/error.hpp"
#include "blockswap/model_io/size.hpp"
#include "progress.hpp"

namespace blockswap::tool {

using Clock = std::chrono::steady_clock;
using models::ReferenceTransformer;
using torch::autograd::variable_list;

std::string milliseconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f ms", seconds * 1e3);
  return text;
}

Work work_of(const std::string& mode) {
  if (mode == "infer") return Work::infer;
  if (mode == "train") return Work::train;
  BLOCKSWAP_CHECK(mode == "finetune", "--mode must be infer, train or finetune, got '", mode, "'");
  return Work::finetune;
}

StepOn step_on_of(const std::string& where) {
  if (where == "auto") return StepOn::automatic;
  if (where == "device") return StepOn::device;
  BLOCKSWAP_CHECK(where == "host", "--step-on must be auto, device or host, got '", where, "'");
  return StepOn::host;
}

FusedAdamW finetune_adamw() {
  FusedAdamW adamw;
  adamw.lr = 1e-4;
  adamw.weight_decay = 0.01;
  return adamw;
}

void make_trainable(ReferenceTransformer& model) {
  for (const auto& block : model.modules()) {
    for (auto& p : block->parameters()) p.set_requires_grad(true);
  }
}

namespace {
std::vector<torch::Tensor> block_weights(const ReferenceTransformer& model) {
  std::vector<torch::Tensor> out;
  for (const auto& block : model.modules()) {
    for (const auto& p : block->parameters()) out.push_back(p);
  }
  return out;
}
} // namespace

StepRunner::StepRunner(ReferenceTransformer& model, ModelOffloader* offloader, torch::Tensor input,
                       Work work, GradientReducer reduce)
    : model_(model), offloader_(offloader), input_(std::move(input)), work_(work),
      adapters_(model.lora_parameters()), reduce_(std::move(reduce)) {
  if (work_ == Work::finetune && offloader_ == nullptr) {
    const FusedAdamW o = finetune_adamw();
    adamw_ = std::make_unique<torch::optim::AdamW>(block_weights(model_),
                                                   torch::optim::AdamWOptions(o.lr)
                                                       .betas({o.beta1, o.beta2})
                                                       .eps(o.eps)
                                                       .weight_decay(o.weight_decay));
  }
}

void StepRunner::add_weights(std::vector<torch::Tensor>& results) const {
  for (const auto& p : block_weights(model_)) results.push_back(p.detach().clone());
}

torch::Tensor StepRunner::forward() {
  if (offloader_ == nullptr && count_activations_) {
    torch::Tensor x = input_;
    int64_t i = 0;
    for (auto& block : model_.blocks()) {
      std::vector<at::Tensor> weights = block->parameters();
      for (const auto& b : block->buffers()) weights.push_back(b);
      const ActivationScope count(input_.device(), detail::concat("baseline.", i++), weights);
      x = block->forward(x);
    }
    return x;
  }
  if (offloader_ == nullptr) return model_.forward(input_);
  offloader_->prepare_block_devices_before_forward();
  torch::Tensor x = input_;
  auto& blocks = model_.blocks();
  for (int64_t i = 0; i < int64_t(blocks.size()); ++i) {
    x = offloader_->run_block(i, {x}, [block = blocks[i]](const variable_list& in) mutable {
      return variable_list{block->forward(in[0])};
    })[0];
  }
  return x;
}

double StepRunner::step(std::vector<torch::Tensor>* results) {
  if (count_activations_) reset_activation_stats(input_.device());
  const double seconds = timed_step(results);
  if (count_activations_) {
    peak_activation_bytes_ =
        std::max(peak_activation_bytes_, activation_stats(input_.device()).peak_device_bytes);
  }
  return seconds;
}

double StepRunner::timed_step(std::vector<torch::Tensor>* results) {
  const auto start = Clock::now();
  if (work_ == Work::finetune) {
    const torch::Tensor loss = forward().pow(2).mean();
    loss.backward(); // with blockswap, the blocks step in here
    if (adamw_) {
      adamw_->step();
      for (auto& p : block_weights(model_)) p.mutable_grad().reset();
    }
    if (results != nullptr) results->push_back(loss.detach());
  } else if (work_ == Work::train) {
    const torch::Tensor loss = forward().pow(2).mean();
    loss.backward();
    if (results != nullptr) results->push_back(loss.detach());
    torch::NoGradGuard no_grad;
    if (reduce_) {
      std::vector<torch::Tensor> grads;
      for (auto& p : adapters_) grads.push_back(p.grad());
      reduce_(grads);
    }
    for (auto& p : adapters_) {
      if (results != nullptr) results->push_back(p.grad().clone());
      p.sub_(p.grad() * 0.1);
      p.mutable_grad().zero_();
    }
  } else {
    torch::NoGradGuard no_grad;
    torch::Tensor out = forward();
    if (results != nullptr) results->push_back(out);
  }
  // A step ends when all its work is done: its computations (asynchronous on a GPU) and its
  // copies (on the copy stream, whatever the device).
  if (input_.is_cuda()) torch::cuda::synchronize();
  if (offloader_ != nullptr) offloader_->synchronize();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  BLOCKSWAP_ASSERT(!values.empty());
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

std::pair<Phase, Phase> run_side_by_side(ReferenceTransformer& plain, ReferenceTransformer& swapped,
                                         ModelOffloader& offloader, const torch::Tensor& input,
                                         Work work, int steps, const GradientReducer& reduce,
                                         bool count_activations) {
  Progress progress;
  Phase phases[2];
  StepRunner runners[] = {{plain, nullptr, input, work, reduce},
                          {swapped, &offloader, input, work, reduce}};
  if (count_activations) {
    for (auto& runner : runners) runner.count_activations();
  }
  std::vector<double> times[2];
  for (int step = 0; step <= steps; ++step) {
    if (step == 1) offloader.reset_stats();
    progress.update("step", step, steps);
    for (int v = 0; v < 2; ++v) {
      const double seconds = runners[v].step(&phases[v].results);
      if (step > 0) times[v].push_back(seconds);
    }
  }
  for (int v = 0; v < 2; ++v) {
    phases[v].step_seconds = median(times[v]);
    phases[v].peak_activation_bytes = runners[v].peak_activation_bytes();
    if (work == Work::finetune) runners[v].add_weights(phases[v].results);
  }
  return {std::move(phases[0]), std::move(phases[1])};
}

Phase run_alone(ReferenceTransformer& model, ModelOffloader* offloader, const torch::Tensor& input,
                Work work, int steps) {
  Progress progress;
  Phase phase;
  StepRunner runner(model, offloader, input, work);
  std::vector<double> times;
  for (int step = 0; step <= steps; ++step) {
    if (step == 1 && offloader) offloader->reset_stats();
    progress.update("step", step, steps);
    const double seconds = runner.step(&phase.results);
    if (step > 0) times.push_back(seconds);
  }
  phase.step_seconds = median(times);
  if (work == Work::finetune) runner.add_weights(phase.results);
  return phase;
}

double max_abs_diff(const Phase& a, const Phase& b) {
  BLOCKSWAP_ASSERT(a.results.size() == b.results.size());
  double diff = 0;
  for (std::size_t i = 0; i < a.results.size(); ++i) {
    // On the host: a swapped block's weights are host tensors once the offloader is gone.
    diff = std::max(diff, (a.results[i].cpu() - b.results[i].cpu()).abs().max().item<double>());
  }
  return diff;
}

void use_device(const RunArgs& args, c10::Device device, Options& options) {
  options.device = device;
  if (args.pinnable_bytes.empty()) {
    options.emulated_link_gbps = args.link_gbps;
    return;
  }
  BLOCKSWAP_CHECK(device.is_cpu(), "--pinnable-bytes caps pinning on the emulated device "
                                   "(--device cpu); a GPU's cap is the system's");
  DeviceOptions emulated;
  emulated.emulated_link_gbps = args.link_gbps;
  emulated.emulated_pinnable_bytes = parse_size(args.pinnable_bytes);
  options.shared_device = open_device(device, emulated);
}

} // namespace blockswap::tool
