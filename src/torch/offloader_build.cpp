// How a ModelOffloader is built (offloader_impl.hpp): its device, its engine, the model's file,
// the host copies packed and the tensors bound to them; the device and planning functions of
// the front end. Its verbs are in model_offloader.cpp.
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <unordered_set>
#include <utility>

#include "auto_compress.hpp"
#include "blockswap/core/error.hpp"
#include "blockswap/core/layout.hpp"
#include "blockswap/core/load_pipeline.hpp"
#include "blockswap/core/log.hpp"
#include "blockswap/torch.hpp"
#include "file_weights.hpp"
#include "node_sharing.hpp"
#include "offloader_impl.hpp"
#include "torch_compat.hpp"

namespace blockswap {

using torch_frontend::BlockLayout;

namespace {

// Adapters being trained and buffers stay on the compute device for good: their device copies,
// made before anything is changed (the constructor is all or nothing).
std::vector<std::pair<at::Tensor, at::Tensor>>
resident_on(const std::vector<TensorBlock>& blocks, c10::Device device, bool trainable_packed) {
  std::vector<std::pair<at::Tensor, at::Tensor>> moves;
  if (device.is_cpu()) return moves;
  std::unordered_set<const void*> seen; // an aliased tensor moves once
  auto move = [&](const at::Tensor& t) {
    if (t.defined() && t.device() != device && seen.insert(t.unsafeGetTensorImpl()).second) {
      moves.emplace_back(t, t.data().to(device));
    }
  };
  for (const auto& block : blocks) {
    for (const auto& [name, p] : block.parameters) {
      if (p.defined() && p.requires_grad() && !trainable_packed) move(p);
    }
    for (const auto& [name, t] : block.buffers) move(t);
  }
  return moves;
}

int64_t choose_blocks_to_swap(const std::string& label, const Options& options,
                              const Device& device, const std::vector<BlockLayout>& layouts) {
  if (options.blocks_to_swap != -1) return options.blocks_to_swap;
  std::vector<std::size_t> bytes;
  // Compressed weights: the two decode buffers (each its largest block's frozen bytes
  // compressed, at most them) come out of the budget beside the slots (Note [a decode step] in
  // load_pipeline.cpp).
  std::size_t decode_buffer = 0;
  for (const auto& layout : layouts) {
    bytes.push_back(layout.bytes);
    decode_buffer = std::max(decode_buffer, layout.trainable_offset);
  }
  if (options.compress != Compress::on) decode_buffer = 0;
  auto less_decode_buffer = [&](std::size_t budget) {
    const std::size_t buffers = LoadPipeline::kDecodeBuffers * layout::align_up(decode_buffer);
    return budget - std::min(budget, buffers);
  };
  const Mode mode = options.supports_backward ? Mode::training : Mode::forward_only;
  if (options.shared_device && device.budget_bytes() > 0) {
    // What the offloaders made before this one left of the device's budget.
    const std::size_t left = less_decode_buffer(device.available_bytes());
    try {
      return plan_blocks_to_swap(bytes, left, mode);
    } catch (const Error& e) {
      throw OutOfMemory(detail::concat("[", label, "] the shared device ", device.name(), " has ",
                                       left, " bytes left of its budget of ", device.budget_bytes(),
                                       ": ", e.what(),
                                       ". Plan every block list together (plan_block_lists)"));
    }
  }
  try {
    return plan_blocks_to_swap(bytes, less_decode_buffer(options.device_budget_bytes), mode);
  } catch (const Error& e) {
    throw OutOfMemory(detail::concat("[", label, "] ", e.what()));
  }
}

// The packed tensors that are on a device now (a model moved to the GPU before its offloader
// was made), with that device.
std::vector<std::pair<at::Tensor, c10::Device>>
packed_on_device(const std::vector<BlockLayout>& layouts) {
  std::vector<std::pair<at::Tensor, c10::Device>> found;
  for (const BlockLayout& layout : layouts) {
    for (const auto& t : layout.tensors) {
      if (t.variable.defined() && !t.variable.device().is_cpu()) {
        found.emplace_back(t.variable, t.variable.device());
      }
    }
  }
  return found;
}

} // namespace

// The torch device a blockswap Device computes on: kCPU for the emulated device.
c10::Device ModelOffloader::Impl::torch_device(const Device& device) {
  if (!device.is_cuda()) return c10::kCPU;
  const std::string name = device.name(); // "cuda:N"
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(std::stoi(name.substr(5))));
}

// The offloader's device: the shared one, else one of its own made from the options.
std::shared_ptr<Device> ModelOffloader::Impl::device_for(const Options& options) {
  if (!options.shared_device) {
    DeviceOptions own;
    own.emulated_link_gbps = options.emulated_link_gbps;
    own.emulated_capacity_bytes = options.emulated_capacity_bytes;
    return open_device(options.device, own);
  }
  return options.shared_device; // Options::check saw that the options agree with it
}

void ModelOffloader::Impl::build() {
  EngineOptions engine_options;
  // Note [automatic compression] in core/compression_choice.cpp: auto is on or off from here.
  if (options_.compress == Compress::automatic) {
    const CompressionChoice choice = torch_frontend::choose_compression(
        options_, binder_.layouts(), device_->backend().can_decode());
    options_.compress = choice.on ? Compress::on : Compress::off;
    compression_reason_ = "compress='auto': " + choice.reason;
    log_line(detail::concat("[", label_, "] compression ", choice.on ? "on" : "off", ": ",
                            compression_reason_));
  } else {
    compression_reason_ = detail::concat("compress='", compress_name(options_.compress), "'");
  }
  if (!options_.weights_file.empty()) {
    file_ = torch_frontend::locate_weights(options_.weights_file, options_.weights_prefix,
                                           options_.weights_layout, options_.weights_map,
                                           binder_.layouts_to_locate(), label_);
    options_.weights_map = nullptr; // a Python map goes now, while its interpreter surely lives
    if (options_.host_budget_bytes) {
      engine_options.file = FileTier{file_->files, file_->blocks, *options_.host_budget_bytes,
                                     options_.staging_buffers, options_.file_reads};
    }
  }
  engine_options.supports_backward = options_.supports_backward;
  engine_options.rotating_slots = options_.rotating_slots;
  engine_options.training_rotating_slots = options_.training_rotating_slots;
  engine_options.algorithm = options_.algorithm;
  engine_options.debug = options_.debug;
  engine_options.log = options_.log;
  engine_options.trace = options_.trace;
  if (share_) { // local rank 0's memory, or a new one on local rank 0
    share_->open(binder_.layouts(), options_.compress == Compress::on,
                 [this](int64_t block, std::byte* into) { binder_.pack_block(block, into); });
    engine_options.host_memory = share_->host_memory();
    engine_options.host_memory_compressed = share_->compressed_bytes();
  }
  // Note [compressed frozen views] in tier_views.cpp: only the frozen tensors' bytes, each
  // range by its dtype; the front end's trainable bytes are never compressed.
  if (options_.compress == Compress::on) {
    engine_options.compress = Compress::on;
    for (const auto& layout : binder_.layouts()) {
      engine_options.frozen_ranges.push_back(torch_frontend::frozen_ranges(layout));
    }
    if (!share_) { // the node's copy holds no trainable bytes
      for (const auto& layout : binder_.layouts()) {
        engine_options.trainable_bytes.push_back(layout.trainable_bytes());
      }
    }
  }
  if (fine_tuner_.enabled()) {
    engine_options.trainable_bytes.clear();
    for (const auto& layout : binder_.layouts()) {
      engine_options.trainable_bytes.push_back(layout.trainable_bytes());
    }
  }
  engine_options.blocks_to_swap =
      choose_blocks_to_swap(label_, options_, *device_, binder_.layouts());
  blocks_to_swap_ = engine_options.blocks_to_swap;
  std::vector<std::size_t> bytes;
  for (const auto& layout : binder_.layouts()) bytes.push_back(layout.bytes);
  // Note [slots after packing]
  // A model already on the GPU is packed into host memory before the slots are allocated:
  // otherwise its device copy and the slots would be on the device together (the peak would be
  // the whole model plus the slots), and the memory the weights leave would sit in torch's
  // cache, out of the slots' reach (the CUDA backend empties that cache and tries again on
  // cudaErrorMemoryAllocation: Note [slots beside torch's allocator]). Should the slots then
  // not fit, the tensors go back to the device they were on, so that the constructor still
  // changes nothing when it fails.
  const auto was_on_device = packed_on_device(binder_.layouts());
  engine_options.slots_at_construction = was_on_device.empty();
  const std::shared_ptr<Backend> backend = device_->attach(label_);
  engine_ = std::make_unique<Engine>(backend, std::move(bytes), std::move(engine_options), label_);
  if (file_) use_file();
  auto resident = resident_on(blocks_, torch_device_, fine_tuner_.enabled());
  using HostCopies = torch_frontend::BlockBinder::HostCopies;
  const HostCopies copies = !share_            ? HostCopies::own
                            : share_->filled() ? HostCopies::shared_filled
                                               : HostCopies::shared_fill;
  binder_.pack(*engine_, copies); // it changes nothing when it fails
  try {
    engine_->allocate_slots(); // Note [slots after packing]
    engine_->compress();       // then the decode buffer, on the device too
    binder_.use_compressed_copies(*engine_);
  } catch (...) {
    binder_.restore_to_host();
    for (auto& [tensor, device] : was_on_device) {
      try {
        tensor.set_data(tensor.data().to(device));
      } catch (const std::exception& e) {
        warn("", detail::concat("[", label_, "] a weight stays in host memory: ", e.what()));
      }
    }
    throw;
  }
  if (share_) {
    try {
      share_->publish(); // local rank 0 waits here until every other local rank has mapped it
    } catch (...) {
      binder_.restore_to_host();
      throw;
    }
    share_->pin(*backend);
  }
  for (auto& [tensor, on_device] : resident) tensor.set_data(on_device);
  engine_->set_listener(&binder_);
  outputs_seen_.assign(blocks_.size(), false);
}

// The model's file (Options::weights_file): with weights_from_file, the frozen tensors' values
// are read from it; otherwise, with the file tier, blocks read from it for each load must hold
// its values (checked once, here). Their tensors off the device are views of it.
void ModelOffloader::Impl::use_file() {
  std::vector<bool> in_file;
  bool any = false;
  for (int64_t b = 0; b < engine_->blocks(); ++b) {
    in_file.push_back(engine_->in_file(b));
    any = any || in_file.back();
    if (in_file.back() && !options_.weights_from_file) {
      torch_frontend::check_same_as_file(*file_, binder_.layouts()[b], b, label_);
    }
  }
  std::function<void(int64_t, std::byte*)> read;
  if (options_.weights_from_file) {
    read = [this](int64_t block, std::byte* packed) {
      torch_frontend::read_frozen(*file_, binder_.layouts()[block], block, packed, label_);
    };
  }
  binder_.views().use_file(any ? torch_frontend::map_files(file_->files, label_)
                               : torch_frontend::FileMap{},
                           std::move(in_file), std::move(read), file_->path);
}

void ModelOffloader::Impl::start(const std::shared_ptr<Impl>& self) {
  self_ = self;
  fine_tuner_.attach(self, binder_, *engine_, *device_->attach(label_ + " host state"));
}

bool cuda_available() {
  return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) &&
         torch_frontend::compat::torch_cuda_streams() && Device::present("cuda");
}

std::shared_ptr<Device> open_device(c10::Device device, DeviceOptions options) {
  if (device.is_cpu()) return Device::open("emulated", std::move(options));
  if (device.is_cuda()) {
    // Checked here, so that a LibTorch without what the CUDA path needs fails before any pass.
    BLOCKSWAP_CHECK(
        c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA), "device ", device.str(),
        ": this torch was built without CUDA; install a CUDA build of torch and build blockswap "
        "against it (pip install --no-build-isolation .), or use device cpu (the "
        "emulated device)");
    BLOCKSWAP_CHECK(torch_frontend::compat::torch_cuda_streams(), "device ", device.str(),
                    ": this blockswap was built against a torch without CUDA; rebuild it "
                    "against the CUDA build of torch it runs with");
    const int index =
        device.has_index() ? device.index() : torch_frontend::compat::current_cuda_device();
    if (!options.compute_stream) {
      options.compute_stream = [index] {
        return torch_frontend::compat::current_cuda_stream(index);
      };
    }
    // Note [slots beside torch's allocator] (src/device/cuda/cuda_device.cpp)
    if (!options.release_cached_memory) {
      options.release_cached_memory = [index] {
        return torch_frontend::compat::release_cuda_cache(index);
      };
    }
    return Device::open(detail::concat("cuda:", index), std::move(options));
  }
  throw Error(detail::concat("device ", device.str(),
                             " is not one blockswap runs on: cpu (the emulated device) or cuda"));
}

std::vector<std::size_t> packed_block_bytes(const BlockList& blocks, c10::Device device) {
  std::vector<std::size_t> bytes;
  for (const BlockLayout& layout : torch_frontend::layout_blocks(
           torch_frontend::tensor_blocks(blocks, "blocks"), "blocks", device)) {
    bytes.push_back(layout.bytes);
  }
  return bytes;
}

std::vector<std::size_t> packed_block_bytes(const std::vector<TensorBlock>& blocks,
                                            c10::Device device) {
  torch_frontend::PackingRules rules;
  rules.sizes_only = true;
  std::vector<std::size_t> bytes;
  for (const BlockLayout& layout : torch_frontend::layout_blocks(blocks, "blocks", device, rules)) {
    bytes.push_back(layout.bytes);
  }
  return bytes;
}

SwapPlan plan_block_lists(const std::vector<BlockList>& lists, std::size_t budget_bytes, Mode mode,
                          c10::Device device) {
  std::vector<std::vector<std::size_t>> bytes;
  for (const BlockList& list : lists) bytes.push_back(packed_block_bytes(list, device));
  return plan_swaps(bytes, budget_bytes, mode);
}

namespace {

// Only blockswap::Error leaves the constructor: LibTorch's own errors (a copy that fails, a
// device LibTorch lacks) are wrapped with the offloader's label.
std::shared_ptr<ModelOffloader::Impl>
make_impl(std::string block_type, std::vector<TensorBlock> blocks, const Options& options) {
  const std::string label = block_type;
  try {
    options.check(label, static_cast<int64_t>(blocks.size()));
  } catch (const Error& e) {
    // Node sharing: a rank whose options are wrong tells the node's others, as one that fails
    // later does (Note [node sharing protocol]).
    if (options.node_sharing) {
      try {
        torch_frontend::NodeShare(options.node_sharing, label).fail(e.what());
      } catch (const Error&) { // a malformed NodeSharing: the others' store timeout tells them
      }
    }
    throw;
  }
  try {
    auto impl =
        std::make_shared<ModelOffloader::Impl>(std::move(block_type), std::move(blocks), options);
    impl->start(impl);
    return impl;
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw Error(detail::concat(
        "[", label, "] ModelOffloader could not be built: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw Error(detail::concat("[", label, "] ModelOffloader could not be built: ", e.what()));
  }
}

} // namespace

ModelOffloader::ModelOffloader(std::string block_type, BlockList blocks, Options options)
    : impl_(make_impl(block_type, torch_frontend::tensor_blocks(blocks, block_type), options)) {}

ModelOffloader::ModelOffloader(std::string block_type, std::vector<TensorBlock> blocks,
                               Options options)
    : impl_(make_impl(std::move(block_type), std::move(blocks), options)) {}

ModelOffloader::ModelOffloader(std::string block_type, const torch::nn::ModuleList& blocks,
                               Options options)
    : ModelOffloader(std::move(block_type), blocks->children(), options) {}

ModelOffloader::~ModelOffloader() = default;

} // namespace blockswap
