// blockswap._C's half of offloaded activations: the one activation store
// (src/torch/activation_store.hpp) that python/blockswap/_activations.py hands every saved
// tensor to from torch.autograd.graph.saved_tensors_hooks. The store's header is
// implementer-only; this module is the store's other front end, as activation_scope.cpp is.
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>

#include "../../src/torch/activation_store.hpp"
#include "blockswap/device/device.hpp"

namespace py = pybind11;

namespace blockswap {

void bind_activations(py::module_& m) {
  using torch_frontend::ActivationGroup;
  using torch_frontend::SavedActivation;

  py::class_<SavedActivation, std::shared_ptr<SavedActivation>>(m, "SavedActivation")
      .def("unpack", &SavedActivation::unpack);

  // `weights()`: the data pointers of the block's own weights' storages, asked at the first pack.
  using PythonWeights = std::function<std::unordered_set<std::uintptr_t>()>;
  py::class_<ActivationGroup, std::shared_ptr<ActivationGroup>>(m, "ActivationGroup")
      .def(py::init([](c10::Device device, std::string label, PythonWeights weights,
                       std::size_t threshold_bytes, std::shared_ptr<Device> counted_by) {
             ActivationGroup::Weights storages = [weights = std::move(weights)] {
               std::unordered_set<const void*> pointers;
               for (const std::uintptr_t p : weights()) {
                 pointers.insert(reinterpret_cast<const void*>(p));
               }
               return pointers;
             };
             return ActivationGroup::open(device, std::move(label), std::move(storages),
                                          threshold_bytes, counted_by);
           }),
           py::arg("device"), py::arg("label"), py::arg("weights"), py::arg("threshold_bytes"),
           py::arg("counted_by") = py::none())
      .def("pack", &ActivationGroup::pack)
      .def("keep", &ActivationGroup::keep);

  m.def("activation_stats", [](c10::Device device) {
    const ActivationStats s = torch_frontend::store_stats(device);
    py::dict d;
    d["activation_offloaded_bytes"] = s.offloaded_bytes;
    d["activation_restored_bytes"] = s.restored_bytes;
    d["activation_device_bytes"] = s.device_bytes;
    d["peak_activation_bytes"] = s.peak_device_bytes;
    return d;
  });
  m.def("reset_activation_stats", &torch_frontend::reset_store_stats);
  m.def(
      "set_activation_host_allocator",
      [](std::optional<torch_frontend::HostAllocator> allocator) {
        torch_frontend::set_activation_host_allocator(allocator ? std::move(*allocator) : nullptr);
      },
      py::arg("allocator"));
  m.def("allocate_activation_host", &torch_frontend::default_host_allocation, py::arg("nbytes"),
        py::arg("pin"));
}

} // namespace blockswap
