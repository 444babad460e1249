// blockswap._C's planner (blockswap/core/planner.hpp) for Python: the packed size of each block
// of a model's block lists, and the K of each list that fits one device budget.
// python/blockswap/_offload.py (blockswap.offload) is what calls it.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/core/planner.hpp"
#include "blockswap/core/schedule.hpp"
#include "blockswap/torch.hpp"

namespace py = pybind11;

namespace blockswap {

namespace {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
using Sizes = std::vector<std::vector<std::size_t>>;

Mode mode_of(bool training) {
  return training ? Mode::training : Mode::forward_only;
}

py::dict to_dict(const SwapPlan& plan) {
  py::list lists;
  for (const ListPlan& list : plan.lists) {
    py::dict d;
    d["blocks_to_swap"] = list.blocks_to_swap;
    d["device_bytes"] = list.device_bytes;
    d["moved_bytes"] = list.moved_bytes;
    lists.append(d);
  }
  py::dict d;
  d["lists"] = lists;
  d["device_bytes"] = plan.device_bytes;
  d["moved_bytes"] = plan.moved_bytes;
  return d;
}

} // namespace

void bind_planner(py::module_& m) {
  m.def(
      "packed_block_bytes",
      [](const std::vector<std::pair<NamedTensors, NamedTensors>>& blocks, c10::Device device) {
        std::vector<TensorBlock> tensor_blocks;
        for (const auto& [parameters, buffers] : blocks) {
          tensor_blocks.push_back({parameters, buffers});
        }
        return packed_block_bytes(tensor_blocks, device);
      },
      py::arg("blocks"), py::arg("device"));
  m.def(
      "smallest_budget",
      [](const Sizes& lists, bool training, std::size_t fixed_bytes) {
        return smallest_budget(lists, mode_of(training), fixed_bytes);
      },
      py::arg("lists"), py::arg("training"), py::arg("fixed_bytes"));
  m.def(
      "plan_swaps",
      [](const Sizes& lists, std::size_t budget_bytes, bool training, std::size_t fixed_bytes) {
        return to_dict(plan_swaps(lists, budget_bytes, mode_of(training), fixed_bytes));
      },
      py::arg("lists"), py::arg("budget_bytes"), py::arg("training"), py::arg("fixed_bytes"));
  m.def(
      "plan_for",
      [](const Sizes& lists, const std::vector<int64_t>& blocks_to_swap, bool training,
         std::size_t fixed_bytes) {
        return to_dict(plan_for(lists, blocks_to_swap, mode_of(training), fixed_bytes));
      },
      py::arg("lists"), py::arg("blocks_to_swap"), py::arg("training"), py::arg("fixed_bytes"));
  m.def(
      "stage_loads",
      [](const std::string& schedule, int64_t stages, int64_t stage, int64_t micro_batches,
         int64_t blocks, int64_t blocks_to_swap, int64_t training_rotating_slots) {
        BLOCKSWAP_CHECK_ARGUMENT(schedule == "gpipe" || schedule == "1f1b",
                                 "schedule must be 'gpipe' or '1f1b', got '", schedule, "'");
        const PipelineSchedule kind =
            schedule == "gpipe" ? PipelineSchedule::gpipe : PipelineSchedule::one_f_one_b;
        const Schedule s(
            ScheduleOptions{blocks, blocks_to_swap, Mode::training, training_rotating_slots});
        return s.loads(pipeline_halves(kind, stages, stage, micro_batches));
      },
      py::arg("schedule"), py::arg("stages"), py::arg("stage"), py::arg("micro_batches"),
      py::arg("blocks"), py::arg("blocks_to_swap"), py::arg("training_rotating_slots"));
}

} // namespace blockswap
