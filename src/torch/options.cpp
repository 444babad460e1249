// Options::check: every check of a ModelOffloader's options, in one place, for C++ and Python
// (whose ModelOffloader binds Options field by field and calls it). A new option's range goes
// here.
#include <cmath>
#include <variant>

#include "blockswap/core/error.hpp"
#include "blockswap/core/schedule.hpp"
#include "blockswap/torch/options.hpp"
#include "fused_optimizers.hpp"

namespace blockswap {

void Options::check(const std::string& label, int64_t blocks) const {
  const std::string at = detail::concat("[", label, "] ");
  BLOCKSWAP_CHECK_ARGUMENT(blocks >= 1, at, "ModelOffloader needs at least one block");
  const Mode mode = supports_backward ? Mode::training : Mode::forward_only;
  BLOCKSWAP_CHECK_ARGUMENT(rotating_slots >= 0, at, "rotating_slots R=", rotating_slots,
                           " must be >= 0 (0: the default)");
  BLOCKSWAP_CHECK_ARGUMENT(training_rotating_slots >= 0, at,
                           "training_rotating_slots R=", training_rotating_slots,
                           " must be >= 0 (0: the seed's layout)");
  try {
    if (blocks_to_swap != -1) {
      Schedule::check(blocks, blocks_to_swap, mode);
      Schedule::check(
          ScheduleOptions{blocks, blocks_to_swap, Mode::forward_only, rotating_slots, algorithm});
      if (supports_backward) {
        Schedule::check(ScheduleOptions{blocks, blocks_to_swap, Mode::training,
                                        training_rotating_slots, algorithm});
      }
    }
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(at + e.what());
  }
  if (blocks_to_swap == -1) {
    const bool budget = shared_device ? shared_device->budget_bytes() > 0 : device_budget_bytes > 0;
    BLOCKSWAP_CHECK_ARGUMENT(budget, at,
                             "blocks_to_swap = -1 asks the planner to choose K, which needs a "
                             "budget: device_budget_bytes > 0, or a shared device opened with "
                             "a budget (DeviceOptions::budget_bytes)");
  }
  if (shared_device) {
    BLOCKSWAP_CHECK_ARGUMENT(
        device == c10::Device(c10::kCPU) || device.is_cuda() == shared_device->is_cuda(), at,
        "Options::device is ", device.str(), " but Options::shared_device is ",
        shared_device->name(), ": leave Options::device at its default when sharing a device");
    BLOCKSWAP_CHECK_ARGUMENT(
        device_budget_bytes == 0 && emulated_link_gbps == 0 && emulated_capacity_bytes == 0, at,
        "with Options::shared_device (Python: shared_device=), the budget, link and capacity are "
        "the device's: set them in DeviceOptions when opening it (Python: open_device(...)), "
        "not in Options");
  }
  BLOCKSWAP_CHECK_ARGUMENT(emulated_link_gbps == 0 ||
                               (std::isfinite(emulated_link_gbps) && emulated_link_gbps >= 0.001),
                           at, "emulated_link_gbps is ", emulated_link_gbps,
                           "; it must be 0 (unlimited) or finite and >= 0.001");

  // The model's file and the file tier.
  BLOCKSWAP_CHECK_ARGUMENT(!host_budget_bytes || !weights_file.empty(), at,
                           "host_budget_bytes needs weights_file: the blocks over the budget are "
                           "read from the model's file");
  BLOCKSWAP_CHECK_ARGUMENT(!weights_from_file || !weights_file.empty(), at,
                           "weights_from_file reads the blocks' weights from weights_file, which "
                           "is not set");
  BLOCKSWAP_CHECK_ARGUMENT(weights_prefix.empty() || !weights_file.empty(), at,
                           "weights_prefix names the blocks in weights_file, which is not set");
  BLOCKSWAP_CHECK_ARGUMENT((weights_layout.empty() && !weights_map) || !weights_file.empty(), at,
                           "weights_layout and weights_map say how the blocks are named in "
                           "weights_file, which is not set");
  BLOCKSWAP_CHECK_ARGUMENT(weights_layout.empty() || weights_layout == "auto" || !weights_map, at,
                           "weights_layout '", weights_layout,
                           "' and weights_map both say how the blocks are named: give one");
  try {
    parse_weights_layout(weights_layout);
  } catch (const Error& e) {
    throw InvalidArgument(detail::concat(at, e.what()));
  }
  BLOCKSWAP_CHECK_ARGUMENT(
      host_budget_bytes || (staging_buffers == 2 && file_reads == CacheBypass::direct), at,
      "staging_buffers and file_reads are the file tier's: set host_budget_bytes (and "
      "weights_file) too, or leave them at their defaults");
  BLOCKSWAP_CHECK_ARGUMENT(staging_buffers >= 1, at, "staging_buffers=", staging_buffers,
                           " must be >= 1");
  BLOCKSWAP_CHECK_ARGUMENT(weights_file.empty() || !node_sharing, at,
                           "weights_file with node_sharing: the ranks of a node read the file "
                           "each on their own, without node sharing (docs/guide.md, \"When the "
                           "model does not fit in host memory\")");
  BLOCKSWAP_CHECK_ARGUMENT(compress != Compress::on || algorithm != Algorithm::seed, at,
                           "the seed's replay copies every block back to host memory, which "
                           "compressed host copies (compress on) do not allow");
  BLOCKSWAP_CHECK_ARGUMENT(!host_budget_bytes || algorithm != Algorithm::seed, at,
                           "the seed's replay copies every block back to host memory, which the "
                           "file tier (host_budget_bytes) does not allow");

  // Full fine-tuning.
  BLOCKSWAP_CHECK_ARGUMENT(gradient_accumulation_steps >= 1, at,
                           "gradient_accumulation_steps must be an int >= 1, got ",
                           gradient_accumulation_steps);
  BLOCKSWAP_CHECK_ARGUMENT(std::isfinite(max_grad_norm_per_parameter) &&
                               max_grad_norm_per_parameter >= 0,
                           at, "max_grad_norm_per_parameter is ", max_grad_norm_per_parameter,
                           "; it must be finite and >= 0 (0: no clipping)");
  if (std::holds_alternative<std::monostate>(optimizer)) {
    BLOCKSWAP_CHECK_ARGUMENT(gradient_accumulation_steps == 1 && max_grad_norm_per_parameter == 0,
                             at,
                             "gradient_accumulation_steps and max_grad_norm_per_parameter "
                             "are for the fused step: set Options::optimizer too (Python: "
                             "pass optimizer= too), or leave them at 1 and 0");
    return;
  }
  torch_frontend::check_optimizer(label, optimizer);
  BLOCKSWAP_CHECK_ARGUMENT(supports_backward, at,
                           "Options::optimizer steps parameters during backward, which needs "
                           "supports_backward = true");
  BLOCKSWAP_CHECK_ARGUMENT(
      !node_sharing, at,
      "Options::optimizer trains the blocks' weights in their host copy, "
      "which Options::node_sharing (Python: process_group) shares with the "
      "node's other ranks read-only: with node sharing, train adapters (LoRA) and leave "
      "the optimizer unset");
}

} // namespace blockswap
