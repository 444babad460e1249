#include "workload.hpp"

#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "blockswap/error.hpp"
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

Phase run_phase(const std::string& label, ReferenceTransformer& model, ModelOffloader* offloader,
                const torch::Tensor& input, bool train, int steps) {
  // GPU work is asynchronous: a step ends when the device is done with it.
  auto finish_step = [&] {
    if (input.is_cuda()) torch::cuda::synchronize();
  };
  Phase phase;
  Progress progress;
  std::vector<torch::Tensor> adapters = model.lora_parameters();
  auto forward = [&] {
    if (offloader == nullptr) return model.forward(input);
    offloader->prepare_block_devices_before_forward();
    torch::Tensor x = input;
    auto& blocks = model.blocks();
    for (int64_t i = 0; i < int64_t(blocks.size()); ++i) {
      x = offloader->run_block(i, {x}, [block = blocks[i]](const variable_list& in) mutable {
        return variable_list{block->forward(in[0])};
      })[0];
    }
    return x;
  };
  std::vector<double> times;
  for (int step = 0; step <= steps; ++step) {
    if (step == 1 && offloader != nullptr) offloader->reset_stats();
    progress.update(label + " step", step, steps);
    const auto start = Clock::now();
    if (train) {
      const torch::Tensor loss = forward().pow(2).mean();
      loss.backward();
      phase.results.push_back(loss.detach());
      torch::NoGradGuard no_grad;
      for (auto& p : adapters) {
        phase.results.push_back(p.grad().clone());
        p.sub_(p.grad() * 0.1);
        p.mutable_grad().zero_();
      }
    } else {
      torch::NoGradGuard no_grad;
      phase.results.push_back(forward());
    }
    finish_step();
    if (step > 0) times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  phase.step_seconds = times[times.size() / 2];
  return phase;
}

double max_abs_diff(const Phase& a, const Phase& b) {
  BLOCKSWAP_ASSERT(a.results.size() == b.results.size());
  double diff = 0;
  for (std::size_t i = 0; i < a.results.size(); ++i) {
    diff = std::max(diff, (a.results[i] - b.results[i]).abs().max().item<double>());
  }
  return diff;
}

} // namespace blockswap::tool
