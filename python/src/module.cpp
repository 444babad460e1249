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

void bind_activations(py::module_& m); // activations.cpp
void bind_planner(py::module_& m);     // planner.cpp

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
  d["disk_bytes"] = s.disk_bytes;
  d["staged_bytes"] = s.staged_bytes;
  d["decoded_bytes"] = s.decoded_bytes;
  d["compressed_bytes"] = s.compressed_bytes;
  return d;
}

py::dict to_dict(const CompressionStats& s) {
  py::dict d;
  d["blocks"] = s.blocks;
  d["raw_bytes"] = s.raw_bytes;
  d["compressed_bytes"] = s.compressed_bytes;
  d["ratio"] = s.ratio();
  d["decode_buffer_bytes"] = s.decode_buffer_bytes;
  d["encoded_again"] = s.encoded_again;
  d["on"] = s.on;
  d["reason"] = s.reason;
  return d;
}

py::dict to_dict(const HostMemoryStats& s) {
  py::dict d;
  d["pinned_host_bytes"] = s.pinned_bytes;
  d["peak_pinned_host_bytes"] = s.peak_pinned_bytes;
  d["kept_host_bytes"] = s.kept_bytes;
  d["peak_kept_host_bytes"] = s.peak_kept_bytes;
  d["pageable_host_bytes"] = s.pageable_bytes;
  d["pinned_per_kept"] = s.pinned_per_kept();
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

// The offloader, until close().
struct Offloader {
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
  const OptimizerKernel kernel = std::array{OptimizerKernel::torch_optim, OptimizerKernel::for_loop,
                                            OptimizerKernel::foreach, OptimizerKernel::fused}[code];
  if (kind == "sgd") {
    return FusedSGD{h.at("lr"),           h.at("momentum"),      h.at("dampening"),
                    h.at("weight_decay"), h.at("nesterov") != 0, kernel};
  }
  BLOCKSWAP_CHECK(kind == "adamw", "unknown optimizer kind '", kind, "'");
  return FusedAdamW{h.at("lr"),  h.at("beta1"),        h.at("beta2"),
                    h.at("eps"), h.at("weight_decay"), kernel};
}

std::unique_ptr<Offloader>
make_offloader(std::string block_type,
               const std::vector<std::pair<NamedTensors, NamedTensors>>& blocks,
               const Options& options) {
  std::vector<TensorBlock> tensor_blocks;
  for (const auto& [parameters, buffers] : blocks) tensor_blocks.push_back({parameters, buffers});
  auto offloader = std::make_unique<Offloader>();
  py::gil_scoped_release release; // packing copies every block
  offloader->impl =
      std::make_unique<ModelOffloader>(std::move(block_type), std::move(tensor_blocks), options);
  return offloader;
}

// A Python name map (Options::weights_map): a callable from the module's tensor name to the
// file's name, (name, (first row, end row)), or None. It is called while the offloader is built,
// with the GIL released there: taken again for each call, and for the callable's last release
// (the offloader drops its map once built).
NameMap weights_map_from(const py::object& map) {
  if (map.is_none()) return {};
  BLOCKSWAP_CHECK_ARGUMENT(PyCallable_Check(map.ptr()),
                           "weights_map must be a dict or a callable, got ",
                           py::repr(map).cast<std::string>());
  const std::shared_ptr<py::object> held(new py::object(map), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
  return [held](const std::string& name) -> std::optional<FileSlice> {
    py::gil_scoped_acquire gil;
    const py::object got = (*held)(name);
    if (got.is_none()) return std::nullopt;
    if (py::isinstance<py::str>(got)) return FileSlice{got.cast<std::string>()};
    if (py::isinstance<py::tuple>(got) && py::len(got) == 2 &&
        py::isinstance<py::str>(got[py::int_(0)])) {
      const py::object rows = got[py::int_(1)];
      if ((py::isinstance<py::tuple>(rows) || py::isinstance<py::list>(rows)) &&
          py::len(rows) == 2) {
        try {
          return FileSlice{got[py::int_(0)].cast<std::string>(), rows[py::int_(0)].cast<int64_t>(),
                           rows[py::int_(1)].cast<int64_t>()};
        } catch (const py::cast_error&) {
        }
      }
    }
    throw InvalidArgument(detail::concat(
        "weights_map gave ", py::repr(got).cast<std::string>(), " for '", name,
        "': give the file's tensor name, (name, (first row, end row)) for rows of it, or None"));
  };
}

StepOn step_on_from(const std::string& name) {
  BLOCKSWAP_CHECK_ARGUMENT(name == "auto" || name == "device" || name == "host",
                           "step_on must be 'auto', 'device' or 'host', got '", name, "'");
  return name == "host" ? StepOn::host : name == "device" ? StepOn::device : StepOn::automatic;
}

std::string step_on_name(StepOn where) {
  return where == StepOn::host ? "host" : where == StepOn::device ? "device" : "auto";
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
  // An option out of range is a blockswap.Error and, as Python's convention has it, a ValueError.
  static py::handle invalid_argument = PyErr_NewException(
      "blockswap._C.InvalidArgumentError",
      py::make_tuple(error, py::handle(PyExc_ValueError)).release().ptr(), nullptr);
  m.attr("InvalidArgumentError") = invalid_argument;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      py::set_error(invalid_argument, e.what());
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
      .def("host_memory", [](const Device& d) { return to_dict(d.host_memory()); })
      .def("trim_host_pool", &Device::trim_host_pool)
      .def("transfers",
           [](const Device& d) {
             const TransferStats t = d.transfers();
             py::dict out;
             out["host_bytes"] = t.host_bytes;
             out["peak_host_bytes"] = t.peak_host_bytes;
             out["bytes_d2h"] = t.bytes_d2h;
             out["bytes_h2d"] = t.bytes_h2d;
             return out;
           })
      .def("__repr__", [](const Device& d) { return "<blockswap.Device " + d.name() + ">"; });

  m.def(
      "open_device",
      [](const std::string& device, std::size_t budget_bytes, double link_gbps,
         std::size_t capacity_bytes, std::optional<std::size_t> pinnable_bytes) {
        DeviceOptions options;
        options.budget_bytes = budget_bytes;
        options.emulated_link_gbps = link_gbps;
        options.emulated_capacity_bytes = capacity_bytes;
        options.emulated_pinnable_bytes = pinnable_bytes;
        return open_device(c10::Device(device), options);
      },
      py::arg("device"), py::arg("budget_bytes") = 0, py::arg("link_gbps") = 0.0,
      py::arg("capacity_bytes") = 0, py::arg("pinnable_bytes") = py::none());
  m.def("node_memory_use", [] {
    const NodeMemoryUse use = NodeMemory::use();
    return std::map<std::string, std::size_t>{{"private_bytes", use.private_bytes},
                                              {"shared_bytes", use.shared_bytes},
                                              {"proportional_bytes", use.proportional_bytes}};
  });
  m.def("cuda_available", &cuda_available);
  bind_activations(m);
  bind_planner(m);
  m.def("max_blocks_to_swap", [](int64_t n, bool training) {
    return Schedule::max_blocks_to_swap(n, training ? Mode::training : Mode::forward_only);
  });

  py::class_<Trace, std::shared_ptr<Trace>>(m, "Trace")
      .def(py::init<>())
      .def("write_chrome_json", &Trace::write_chrome_json);

  // Options field by field (blockswap/torch.hpp): a new option is one field here and one
  // keyword of ModelOffloader; Options::check is where its range is checked.
  py::class_<Options>(m, "Options")
      .def(py::init<>())
      .def_readwrite("blocks_to_swap", &Options::blocks_to_swap)
      .def_readwrite("supports_backward", &Options::supports_backward)
      .def_readwrite("rotating_slots", &Options::rotating_slots)
      .def_readwrite("training_rotating_slots", &Options::training_rotating_slots)
      .def_readwrite("debug", &Options::debug)
      .def_readwrite("trace", &Options::trace)
      .def_property(
          "device", [](const Options& o) { return o.device.str(); },
          [](Options& o, const std::string& device) { o.device = c10::Device(device); })
      .def_readwrite("reentrant_activation_checkpointing",
                     &Options::reentrant_activation_checkpointing)
      .def_readwrite("device_budget_bytes", &Options::device_budget_bytes)
      .def_readwrite("emulated_link_gbps", &Options::emulated_link_gbps)
      .def_readwrite("emulated_capacity_bytes", &Options::emulated_capacity_bytes)
      .def_readwrite("strict_residency", &Options::strict_residency)
      .def_property(
          "compress", [](const Options& o) { return std::string(compress_name(o.compress)); },
          [](Options& o, const std::string& name) {
            try {
              o.compress = parse_compress(name);
            } catch (const Error& e) {
              throw InvalidArgument(e.what());
            }
          })
      .def_readwrite("shared_device", &Options::shared_device)
      .def_readwrite("gradient_accumulation_steps", &Options::gradient_accumulation_steps)
      .def_property(
          "step_on", [](const Options& o) { return step_on_name(o.step_on); },
          [](Options& o, const std::string& name) { o.step_on = step_on_from(name); })
      .def_readwrite("max_grad_norm_per_parameter", &Options::max_grad_norm_per_parameter)
      .def_readwrite("clip_as_python", &Options::clip_as_python)
      .def_readwrite("weights_file", &Options::weights_file)
      .def_readwrite("weights_prefix", &Options::weights_prefix)
      .def_readwrite("weights_from_file", &Options::weights_from_file)
      .def_readwrite("weights_layout", &Options::weights_layout)
      .def_property(
          "weights_map", [](const Options& o) { return static_cast<bool>(o.weights_map); },
          [](Options& o, const py::object& map) { o.weights_map = weights_map_from(map); })
      .def_property(
          "host_budget_bytes",
          [](const Options& o) -> py::object {
            if (!o.host_budget_bytes) return py::none();
            return py::int_(*o.host_budget_bytes);
          },
          [](Options& o, const py::object& bytes) {
            o.host_budget_bytes =
                bytes.is_none() ? std::nullopt : std::optional(bytes.cast<std::size_t>());
          })
      .def_readwrite("staging_buffers", &Options::staging_buffers)
      .def_property(
          "file_reads",
          [](const Options& o) { return o.file_reads == CacheBypass::direct ? "direct" : "drop"; },
          [](Options& o, const std::string& name) {
            BLOCKSWAP_CHECK_ARGUMENT(name == "direct" || name == "drop",
                                     "file_reads must be 'direct' or 'drop', got '", name, "'");
            o.file_reads = name == "direct" ? CacheBypass::direct : CacheBypass::drop;
          })
      .def("set_optimizer",
           [](Options& o, const std::string& kind, const std::map<std::string, double>& hyper) {
             o.optimizer = fused_optimizer(kind, hyper);
           })
      .def("share_node",
           [](Options& o, std::function<void(const std::string&, const std::string&)> set,
              std::function<std::string(const std::string&)> get, int64_t local_rank,
              int64_t local_world_size, std::string group) {
             o.node_sharing = NodeSharing{std::move(set), std::move(get), local_rank,
                                          local_world_size, std::move(group)};
           })
      .def("check", &Options::check, py::arg("label"), py::arg("blocks"));

  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<Offloader>(m, "Offloader")
      .def(py::init(&make_offloader), py::arg("block_type"), py::arg("blocks"), py::arg("options"))
      .def(
          "prepare", [](Offloader& o) { o.get().prepare_block_devices_before_forward(); },
          Release())
      .def(
          "wait_for_block", [](Offloader& o, int64_t i) { o.get().wait_for_block(i); }, Release())
      .def(
          "submit", [](Offloader& o, int64_t i) { o.get().submit_move_blocks_forward(i); },
          Release())
      .def(
          "bracket_outputs",
          [](Offloader& o, int64_t i, const std::vector<at::Tensor>& outputs) {
            return o.get().bracket_outputs(i, outputs);
          },
          Release())
      .def("disable", [](Offloader& o) { o.get().disable_block_swap(); })
      .def("enable", [](Offloader& o) { o.get().enable_block_swap(); })
      .def("set_forward_only", [](Offloader& o, bool f) { o.get().set_forward_only(f); })
      .def("is_resident", [](Offloader& o, int64_t i) { return o.get().is_resident(i); })
      .def("frozen_values", [](Offloader& o, int64_t i) { return o.get().frozen_values(i); })
      .def("take_changes", [](Offloader& o, int64_t i) { o.get().take_changes(i); })
      .def("is_in_file", [](Offloader& o, int64_t i) { return o.get().is_in_file(i); })
      .def(
          "synchronize", [](Offloader& o) { o.get().synchronize(); }, Release())
      .def("blocks_to_swap", [](Offloader& o) { return o.get().blocks_to_swap(); })
      .def("device", [](Offloader& o) { return o.get().device(); })
      .def("stats", [](Offloader& o) { return to_dict(o.get().stats()); })
      .def("compression", [](Offloader& o) { return to_dict(o.get().compression()); })
      .def("reset_stats", [](Offloader& o) { o.get().reset_stats(); })
      .def("set_learning_rate", [](Offloader& o, double lr) { o.get().set_learning_rate(lr); })
      .def("set_optimizer",
           [](Offloader& o, const std::string& kind, const std::map<std::string, double>& hyper) {
             o.get().set_optimizer(fused_optimizer(kind, hyper));
           })
      .def("optimizer_state", [](Offloader& o, int64_t i) { return o.get().optimizer_state(i); })
      .def("optimizer_steps", [](Offloader& o, int64_t i) { return o.get().optimizer_steps(i); })
      .def("accumulated_backwards", [](Offloader& o) { return o.get().accumulated_backwards(); })
      .def("completed_steps", [](Offloader& o) { return o.get().completed_steps(); })
      .def(
          "discard_accumulated_gradients",
          [](Offloader& o) { o.get().discard_accumulated_gradients(); }, Release())
      .def("step_on", [](Offloader& o) { return step_on_name(o.get().step_on()); })
      .def("set_optimizer_steps",
           [](Offloader& o, int64_t i, const std::string& name, int64_t steps) {
             o.get().set_optimizer_steps(i, name, steps);
           })
      .def("close", [](Offloader& o) {
        py::gil_scoped_release release; // waits for copies in flight
        o.impl.reset();
      });
}
