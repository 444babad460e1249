// blockswap._C: the LibTorch front end (blockswap/torch.hpp) for Python, on LibTorch's own
// extension headers and pybind11. The Python class ModelOffloader (python/blockswap) is the
// seed-compatible face; this module is what it calls.
#include <pybind11/functional.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "blockswap/core/error.hpp"
#include "blockswap/core/node_memory.hpp"
#include "blockswap/torch.hpp"

namespace py = pybind11;

namespace blockswap {
namespace {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

py::dict to_dict(const Stats& s) {
  py::dict d;
  d["h2d_bytes"] = s.h2d_bytes;
  d["d2h_bytes"] = s.d2h_bytes;
  d["moves"] = s.moves;
  d["stall_seconds"] = s.stall_seconds;
  d["device_bytes"] = s.device_bytes;
  d["peak_device_bytes"] = s.peak_device_bytes;
  return d;
}

py::dict to_dict(const MemoryStats& s) {
  py::dict d;
  d["device_bytes"] = s.device_bytes;
  d["peak_device_bytes"] = s.peak_device_bytes;
  d["device_capacity"] = s.device_capacity;
  d["pinned_host"] = s.pinned_host;
  return d;
}

// The offloader and the trace it records into, written when the Python side asks.
struct Offloader {
  std::shared_ptr<Trace> trace;
  std::unique_ptr<ModelOffloader> impl;

  ModelOffloader& get() {
    BLOCKSWAP_CHECK(impl != nullptr, "this ModelOffloader was closed");
    return *impl;
  }
};

// The Python optimizer's kind and hyper-parameters (blockswap.FusedSGD, FusedAdamW).
FusedOptimizer fused_optimizer(const std::string& kind, const std::map<std::string, double>& h) {
  if (kind.empty()) return std::monostate{};
  // torch.optim's implementations (blockswap/_optim.py's kernel numbers); unset: its default.
  const auto found = h.find("kernel");
  const int code = found == h.end() ? 0 : static_cast<int>(found->second);
  BLOCKSWAP_CHECK(code >= 0 && code <= 3, "unknown optimizer kernel ", code);
  const OptimizerKernel kernel =
      std::array{OptimizerKernel::torch_optim, OptimizerKernel::for_loop, OptimizerKernel::foreach,
                 OptimizerKernel::fused}[code];
  if (kind == "sgd") {
    return FusedSGD{h.at("lr"), h.at("momentum"), h.at("dampening"), h.at("weight_decay"),
                    h.at("nesterov") != 0, kernel};
  }
  BLOCKSWAP_CHECK(kind == "adamw", "unknown optimizer kind '", kind, "'");
  return FusedAdamW{h.at("lr"),  h.at("beta1"),        h.at("beta2"),
                    h.at("eps"), h.at("weight_decay"), kernel};
}

std::unique_ptr<Offloader> make_offloader(std::string block_type,
                                          const std::vector<std::pair<NamedTensors, NamedTensors>>& blocks,
                                          int64_t blocks_to_swap, bool supports_backward,
                                          const std::string& device, bool reentrant, bool debug,
                                          int64_t rotating_slots, std::size_t budget_bytes,
                                          std::shared_ptr<Device> shared_device, bool trace,
                                          double link_gbps, std::size_t capacity_bytes,
                                          const std::string& optimizer,
                                          const std::map<std::string, double>& hyper,
                                          int64_t accumulation, double max_norm,
                                          const std::string& step_on,
                                          const std::function<void(const std::string&,
                                                                   const std::string&)>& node_set,
                                          const std::function<std::string(const std::string&)>&
                                              node_get,
                                          int64_t local_rank, int64_t local_world_size,
                                          const std::string& group) {
  std::vector<TensorBlock> tensor_blocks;
  for (const auto& [parameters, buffers] : blocks) tensor_blocks.push_back({parameters, buffers});
  Options options;
  options.blocks_to_swap = blocks_to_swap;
  options.supports_backward = supports_backward;
  options.reentrant_activation_checkpointing = reentrant;
  options.debug = debug;
  options.rotating_slots = rotating_slots;
  options.device_budget_bytes = budget_bytes;
  options.emulated_link_gbps = link_gbps;
  options.emulated_capacity_bytes = capacity_bytes;
  if (shared_device) {
    options.shared_device = std::move(shared_device);
  } else {
    options.device = c10::Device(device);
  }
  options.optimizer = fused_optimizer(optimizer, hyper);
  options.gradient_accumulation_steps = accumulation;
  options.max_grad_norm_per_parameter = max_norm;
  options.clip_as_python = true;
  BLOCKSWAP_CHECK(step_on == "auto" || step_on == "device" || step_on == "host",
                  "step_on must be 'auto', 'device' or 'host', got '", step_on, "'");
  options.step_on = step_on == "host"     ? StepOn::host
                    : step_on == "device" ? StepOn::device
                                          : StepOn::automatic;
  if (node_set) {
    options.node_sharing = NodeSharing{node_set, node_get, local_rank, local_world_size, group};
  }
  auto offloader = std::make_unique<Offloader>();
  if (trace) offloader->trace = options.trace = std::make_shared<Trace>();
  py::gil_scoped_release release; // packing copies every block
  offloader->impl =
      std::make_unique<ModelOffloader>(std::move(block_type), std::move(tensor_blocks), options);
  return offloader;
}

} // namespace
} // namespace blockswap

PYBIND11_MODULE(_C, m) {
  using namespace blockswap;
  m.doc() = "blockswap's C++ core for Python; use blockswap.ModelOffloader";
  // The torch this module was compiled against (blockswap/_compat.py refuses another).
  m.attr("torch_version") = TORCH_VERSION;
  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  static py::exception<OutOfMemory> out_of_memory(m, "OutOfMemoryError", error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfMemory& e) {
      py::set_error(out_of_memory, e.what());
    } catch (const Error& e) {
      py::set_error(error, e.what());
    }
  });

  py::class_<Device, std::shared_ptr<Device>>(m, "Device")
      .def_property_readonly("name", &Device::name)
      .def_property_readonly("budget_bytes", &Device::budget_bytes)
      .def("available_bytes", &Device::available_bytes)
      .def("memory", [](const Device& d) { return to_dict(d.memory()); })
      .def("__repr__", [](const Device& d) { return "<blockswap.Device " + d.name() + ">"; });

  m.def(
      "open_device",
      [](const std::string& device, std::size_t budget_bytes, double link_gbps,
         std::size_t capacity_bytes) {
        DeviceOptions options;
        options.budget_bytes = budget_bytes;
        options.emulated_link_gbps = link_gbps;
        options.emulated_capacity_bytes = capacity_bytes;
        return open_device(c10::Device(device), options);
      },
      py::arg("device"), py::arg("budget_bytes") = 0, py::arg("link_gbps") = 0.0,
      py::arg("capacity_bytes") = 0);
  m.def("node_memory_use", [] {
    const NodeMemoryUse use = NodeMemory::use();
    return std::map<std::string, std::size_t>{{"private_bytes", use.private_bytes},
                                              {"shared_bytes", use.shared_bytes},
                                              {"proportional_bytes", use.proportional_bytes}};
  });
  m.def("cuda_available", &cuda_available);
  m.def("max_blocks_to_swap", [](int64_t n, bool training) {
    return Schedule::max_blocks_to_swap(n, training ? Mode::training : Mode::forward_only);
  });

  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<Offloader>(m, "Offloader")
      .def(py::init(&make_offloader), py::arg("block_type"), py::arg("blocks"),
           py::arg("blocks_to_swap"), py::arg("supports_backward"), py::arg("device"),
           py::arg("reentrant"), py::arg("debug"), py::arg("rotating_slots"),
           py::arg("budget_bytes"), py::arg("shared_device"), py::arg("trace"),
           py::arg("link_gbps"), py::arg("capacity_bytes"), py::arg("optimizer"),
           py::arg("hyper"), py::arg("accumulation"), py::arg("max_norm"), py::arg("step_on"),
           py::arg("node_set"), py::arg("node_get"), py::arg("local_rank"),
           py::arg("local_world_size"), py::arg("group"))
      .def("prepare", [](Offloader& o) { o.get().prepare_block_devices_before_forward(); },
           Release())
      .def("wait_for_block", [](Offloader& o, int64_t i) { o.get().wait_for_block(i); },
           Release())
      .def("submit", [](Offloader& o, int64_t i) { o.get().submit_move_blocks_forward(i); },
           Release())
      .def("bracket_outputs",
           [](Offloader& o, int64_t i, const std::vector<at::Tensor>& outputs) {
             return o.get().bracket_outputs(i, outputs);
           },
           Release())
      .def("disable", [](Offloader& o) { o.get().disable_block_swap(); })
      .def("enable", [](Offloader& o) { o.get().enable_block_swap(); })
      .def("set_forward_only", [](Offloader& o, bool f) { o.get().set_forward_only(f); })
      .def("is_resident", [](Offloader& o, int64_t i) { return o.get().is_resident(i); })
      .def("synchronize", [](Offloader& o) { o.get().synchronize(); }, Release())
      .def("blocks_to_swap", [](Offloader& o) { return o.get().blocks_to_swap(); })
      .def("stats", [](Offloader& o) { return to_dict(o.get().stats()); })
      .def("reset_stats", [](Offloader& o) { o.get().reset_stats(); })
      .def("set_learning_rate", [](Offloader& o, double lr) { o.get().set_learning_rate(lr); })
      .def("set_optimizer",
           [](Offloader& o, const std::string& kind, const std::map<std::string, double>& hyper) {
             o.get().set_optimizer(fused_optimizer(kind, hyper));
           })
      .def("optimizer_state", [](Offloader& o, int64_t i) { return o.get().optimizer_state(i); })
      .def("optimizer_steps", [](Offloader& o, int64_t i) { return o.get().optimizer_steps(i); })
      .def("accumulated_backwards",
           [](Offloader& o) { return o.get().accumulated_backwards(); })
      .def("completed_steps", [](Offloader& o) { return o.get().completed_steps(); })
      .def("discard_accumulated_gradients",
           [](Offloader& o) { o.get().discard_accumulated_gradients(); }, Release())
      .def("step_on",
           [](Offloader& o) {
             return std::string(o.get().step_on() == StepOn::host ? "host" : "device");
           })
      .def("set_optimizer_steps",
           [](Offloader& o, int64_t i, const std::string& name, int64_t steps) {
             o.get().set_optimizer_steps(i, name, steps);
           })
      .def("write_trace",
           [](Offloader& o, const std::string& path) {
             BLOCKSWAP_CHECK(o.trace != nullptr, "this ModelOffloader records no trace");
             o.trace->write_chrome_json(path);
           })
      .def("close",
           [](Offloader& o) {
             py::gil_scoped_release release; // waits for copies in flight
             o.impl.reset();
           });
}
