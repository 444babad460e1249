// The fused optimizers' arithmetic: one parameter's step as torch::optim or torch.optim takes
// it (OptimizerKernel), gradient clipping, the state each optimizer keeps, and the checks of
// its hyper-parameters. A new optimizer (or a new torch.optim kernel) goes here and in the
// FusedOptimizer variant of blockswap/torch/options.hpp. Implementer-only (src/torch).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <variant>
#include <vector>

#include "blockswap/torch/options.hpp"

namespace blockswap::torch_frontend {

// Helper for std::visit over FusedOptimizer.
template <class... Fs> struct Overloaded : Fs... { using Fs::operator()...; };
template <class... Fs> Overloaded(Fs...) -> Overloaded<Fs...>;

// One parameter's step by `optimizer`, bitwise as the torch implementation its kernel names
// (Note [the steps] in the .cpp). `args.state` are the tensors of state_names(optimizer).
void step_parameter(const FusedOptimizer& optimizer, const ParamStep& args);

// Scales one parameter's gradient in place as torch::nn::utils::clip_grad_norm_({p}, max_norm),
// or with `as_python` as torch.nn.utils.clip_grad_norm_([p], max_norm).
void clip_gradient(const at::Tensor& grad, double max_norm, bool as_python);

// The state tensors each parameter keeps ("exp_avg", ...), in the order step_parameter reads.
std::vector<std::string> state_names(const FusedOptimizer& optimizer);

// Throws InvalidArgument naming the hyper-parameter out of range; `label` prefixes the message.
void check_optimizer(const std::string& label, const FusedOptimizer& optimizer);

// Sets the learning rate; throws Error for FusedCustom, which keeps its own.
void set_learning_rate(const std::string& label, FusedOptimizer& optimizer, double lr);

} // namespace blockswap::torch_frontend
