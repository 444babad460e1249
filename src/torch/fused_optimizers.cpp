// The per-parameter optimizer steps, bitwise as torch.optim / torch::optim (Note [the steps]).
#include "fused_optimizers.hpp"

#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_addcdiv.h>
#include <ATen/ops/_foreach_addcmul.h>
#include <ATen/ops/_foreach_div.h>
#include <ATen/ops/_foreach_lerp.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_sqrt.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/stack.h>

#include <cmath>
#include <type_traits>

#include "blockswap/core/error.hpp"

namespace blockswap::torch_frontend {
namespace {

// Note [the steps]
// The same tensor operations, in the same order and with the same scalars, as the torch
// implementation each OptimizerKernel names, so that a parameter stepped here is bitwise the one
// that implementation makes on the same device: LibTorch's torch::optim (mul_/add_ for AdamW's
// first moment), torch.optim's single-tensor path (lerp_ since torch 2.1, the bias correction's
// square root as a power of 0.5), its foreach path (the _foreach_ ops, on one-tensor lists) and
// its fused path (the _fused_ kernels). Changing an expression (fusing two ops, reordering a
// product) changes the last bits: the tests against torch::optim and torch.optim catch it.
OptimizerKernel resolve(OptimizerKernel kernel, const at::Tensor& param) {
  if (kernel != OptimizerKernel::torch_optim) return kernel;
  return param.is_cuda() ? OptimizerKernel::foreach : OptimizerKernel::for_loop;
}

void sgd(const FusedSGD& o, const ParamStep& a) {
  const OptimizerKernel kernel = resolve(o.kernel, a.param);
  const std::vector<at::Tensor> param{a.param};
  if (kernel == OptimizerKernel::fused) {
    const std::vector<at::Tensor> buffers =
        o.momentum != 0 ? std::vector<at::Tensor>{a.state[0]} : std::vector<at::Tensor>{};
    at::_fused_sgd_(param, {a.grad}, buffers, o.weight_decay, o.momentum, o.lr, o.dampening,
                    o.nesterov, false, a.step == 1);
    return;
  }
  if (kernel == OptimizerKernel::foreach) {
    std::vector<at::Tensor> grads{a.grad};
    if (o.weight_decay != 0) grads = at::_foreach_add(grads, param, o.weight_decay);
    if (o.momentum != 0) {
      const std::vector<at::Tensor> buffers{a.state[0]};
      if (a.step == 1) {
        a.state[0].copy_(grads[0]);
      } else {
        at::_foreach_mul_(buffers, o.momentum);
        at::_foreach_add_(buffers, grads, 1 - o.dampening);
      }
      if (o.nesterov) {
        grads = {grads[0].clone()}; // Python adds into the gradient list in place
        at::_foreach_add_(grads, buffers, o.momentum);
      } else {
        grads = buffers;
      }
    }
    at::_foreach_add_(param, grads, -o.lr);
    return;
  }
  at::Tensor d_p = a.grad;
  if (o.weight_decay != 0) d_p = d_p.add(a.param, o.weight_decay);
  if (o.momentum != 0) {
    const at::Tensor& buffer = a.state[0];
    if (a.step == 1) {
      buffer.copy_(d_p);
    } else {
      buffer.mul_(o.momentum).add_(d_p, 1 - o.dampening);
    }
    d_p = o.nesterov ? d_p.add(buffer, o.momentum) : buffer;
  }
  a.param.add_(d_p, -1 * o.lr);
}

void adamw(const FusedAdamW& o, const ParamStep& a) {
  const OptimizerKernel kernel = resolve(o.kernel, a.param);
  const at::Tensor& exp_avg = a.state[0];
  const at::Tensor& exp_avg_sq = a.state[1];
  if (kernel == OptimizerKernel::fused) {
    // torch.optim keeps a fused step's count as a float32 tensor on the parameter's device.
    const at::Tensor step =
        at::full({}, static_cast<double>(a.step), a.param.options().dtype(at::kFloat));
    at::_fused_adamw_({a.param}, {a.grad}, {exp_avg}, {exp_avg_sq}, {}, {step}, o.lr, o.beta1,
                      o.beta2, o.weight_decay, o.eps, false, false);
    return;
  }
  const double bias_correction1 = 1 - std::pow(o.beta1, static_cast<double>(a.step));
  const double bias_correction2 = 1 - std::pow(o.beta2, static_cast<double>(a.step));
  const double step_size = o.lr / bias_correction1;
  if (kernel == OptimizerKernel::foreach) {
    const std::vector<at::Tensor> param{a.param}, grads{a.grad}, avgs{exp_avg}, sqs{exp_avg_sq};
    if (o.weight_decay != 0) at::_foreach_mul_(param, 1 - o.lr * o.weight_decay);
    at::_foreach_lerp_(avgs, grads, 1 - o.beta1);
    at::_foreach_mul_(sqs, o.beta2);
    at::_foreach_addcmul_(sqs, grads, grads, 1 - o.beta2);
    const std::vector<at::Tensor> denom = at::_foreach_sqrt(sqs);
    at::_foreach_div_(denom, std::pow(bias_correction2, 0.5));
    at::_foreach_add_(denom, o.eps);
    at::_foreach_addcdiv_(param, avgs, denom, step_size * -1);
    return;
  }
  if (o.weight_decay != 0) a.param.mul_(1 - o.lr * o.weight_decay);
  if (kernel == OptimizerKernel::libtorch) {
    exp_avg.mul_(o.beta1).add_(a.grad, 1 - o.beta1);
  } else {
    exp_avg.lerp_(a.grad, 1 - o.beta1);
  }
  exp_avg_sq.mul_(o.beta2).addcmul_(a.grad, a.grad, 1 - o.beta2);
  const double bias_correction2_sqrt = kernel == OptimizerKernel::libtorch
                                           ? std::sqrt(bias_correction2)
                                           : std::pow(bias_correction2, 0.5);
  const at::Tensor denom = exp_avg_sq.sqrt().div(bias_correction2_sqrt).add_(o.eps);
  a.param.addcdiv_(exp_avg, denom, -step_size);
}

bool finite_at_least(double value, double least) {
  return std::isfinite(value) && value >= least;
}

} // namespace

// torch::nn::utils::clip_grad_norm_({p}, max_norm) for one parameter's gradient, or with
// `as_python` torch.nn.utils.clip_grad_norm_([p], max_norm).
void clip_gradient(const at::Tensor& grad, double max_norm, bool as_python) {
  const at::Tensor norm = grad.norm(2);
  // Python divides a float by a tensor as the tensor's reciprocal times the float; LibTorch's
  // max_norm / (norm + 1e-6) fills a tensor with the float and divides it. Written as the bodies
  // of at::operator+, * and / (ATen/TensorOperators.h, whose include pulls in every operator's
  // header), so the results are bitwise those of the operators.
  const at::Tensor coefficient =
      as_python ? at::stack({norm}).norm(2).add(1e-6).reciprocal().mul(max_norm)
                : at::full_like(norm, max_norm).div_(norm.add(1e-6));
  grad.mul_(at::clamp(coefficient, std::nullopt, 1.0));
}

std::vector<std::string> state_names(const FusedOptimizer& optimizer) {
  return std::visit(Overloaded{[](std::monostate) { return std::vector<std::string>{}; },
                               [](const FusedSGD& o) {
                                 return o.momentum != 0
                                            ? std::vector<std::string>{"momentum_buffer"}
                                            : std::vector<std::string>{};
                               },
                               [](const FusedAdamW&) {
                                 return std::vector<std::string>{"exp_avg", "exp_avg_sq"};
                               },
                               [](const FusedCustom& o) {
                                 std::vector<std::string> names;
                                 for (int64_t i = 0; i < o.state_tensors; ++i) {
                                   names.push_back(detail::concat("state", i));
                                 }
                                 return names;
                               }},
                    optimizer);
}

void check_optimizer(const std::string& label, const FusedOptimizer& optimizer) {
  const std::string where = detail::concat("[", label, "] Options::optimizer: ");
  std::visit(Overloaded{[](std::monostate) {},
                        [&](const FusedSGD& o) {
                          BLOCKSWAP_CHECK_ARGUMENT(finite_at_least(o.lr, 0), where, "SGD's lr ",
                                                   o.lr, " must be finite and >= 0");
                          BLOCKSWAP_CHECK_ARGUMENT(
                              finite_at_least(o.momentum, 0) && finite_at_least(o.dampening, 0) &&
                                  finite_at_least(o.weight_decay, 0),
                              where,
                              "SGD's momentum, dampening and weight_decay must be finite and "
                              ">= 0");
                          BLOCKSWAP_CHECK_ARGUMENT(
                              !o.nesterov || (o.momentum > 0 && o.dampening == 0), where,
                              "Nesterov momentum needs momentum > 0 and dampening 0");
                        },
                        [&](const FusedAdamW& o) {
                          BLOCKSWAP_CHECK_ARGUMENT(finite_at_least(o.lr, 0), where, "AdamW's lr ",
                                                   o.lr, " must be finite and >= 0");
                          BLOCKSWAP_CHECK_ARGUMENT(finite_at_least(o.beta1, 0) && o.beta1 < 1 &&
                                                       finite_at_least(o.beta2, 0) && o.beta2 < 1,
                                                   where, "AdamW's betas (", o.beta1, ", ", o.beta2,
                                                   ") must be in [0, 1)");
                          BLOCKSWAP_CHECK_ARGUMENT(
                              finite_at_least(o.eps, 0) && finite_at_least(o.weight_decay, 0),
                              where, "AdamW's eps and weight_decay must be finite and >= 0");
                        },
                        [&](const FusedCustom& o) {
                          BLOCKSWAP_CHECK_ARGUMENT(static_cast<bool>(o.step), where,
                                                   "FusedCustom needs a step function");
                          BLOCKSWAP_CHECK_ARGUMENT(o.state_tensors >= 0 && o.state_tensors <= 64,
                                                   where, "FusedCustom::state_tensors ",
                                                   o.state_tensors, " must be in [0, 64]");
                        }},
             optimizer);
}

void set_learning_rate(const std::string& label, FusedOptimizer& optimizer, double lr) {
  std::visit(Overloaded{[](std::monostate) {}, [&](FusedSGD& o) { o.lr = lr; },
                        [&](FusedAdamW& o) { o.lr = lr; },
                        [&](FusedCustom&) {
                          throw Error(detail::concat("[", label,
                                                     "] set_learning_rate: a FusedCustom step "
                                                     "keeps its own learning rate"));
                        }},
             optimizer);
}

void step_parameter(const FusedOptimizer& optimizer, const ParamStep& args) {
  std::visit(Overloaded{[](std::monostate) {}, [&](const FusedSGD& o) { sgd(o, args); },
                        [&](const FusedAdamW& o) { adamw(o, args); },
                        [&](const FusedCustom& o) { o.step(args); }},
             optimizer);
}

} // namespace blockswap::torch_frontend
