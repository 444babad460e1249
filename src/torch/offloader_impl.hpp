// ModelOffloader::Impl: what a ModelOffloader holds. Its verbs are in model_offloader.cpp, the
// wiring that builds it (the engine, the model's file, the host copies packed and bound) in
// offloader_build.cpp. Implementer-only (src/torch).
#pragma once

#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "block_autograd.hpp"
#include "block_binder.hpp"
#include "blockswap/core/engine.hpp"
#include "blockswap/core/trace.hpp"
#include "blockswap/device/device.hpp"
#include "blockswap/torch/offloader.hpp"
#include "file_weights.hpp"
#include "fine_tune.hpp"
#include "node_sharing.hpp"

namespace blockswap {

class ModelOffloader::Impl final : public torch_frontend::BackwardEvents {
public:
  // `options` were checked (Options::check). Builds the offloader (build()); when that fails, the
  // node's other ranks are told (node sharing), and it throws.
  Impl(std::string block_type, std::vector<TensorBlock> blocks, Options options);
  // What needs the offloader shared: hooks that find it while it lives.
  void start(const std::shared_ptr<Impl>& self);
  ~Impl() override;

  torch_frontend::FineTuner& fine_tuner() { return fine_tuner_; }
  const torch_frontend::FineTuner& fine_tuner() const { return fine_tuner_; }
  Engine& engine() { return *engine_; }
  // ModelOffloader::frozen_values: a compressed block's frozen tensors with their true values.
  // ModelOffloader::take_changes: what the caller wrote into block `block`'s tensors, saved now.
  void take_changes(int64_t block);
  std::vector<std::pair<at::Tensor, at::Tensor>> frozen_values(int64_t block) {
    BLOCKSWAP_CHECK_ARGUMENT(block >= 0 && block < static_cast<int64_t>(binder_.layouts().size()),
                             "frozen_values: block ", block, " out of range");
    return binder_.frozen_values(block);
  }
  // Why compression is on or off (CompressionStats::reason).
  const std::string& compression_reason() const { return compression_reason_; }
  c10::Device compute_device() const { return torch_device_; }
  const std::shared_ptr<Device>& device() const { return device_; }
  bool offloads_activations() const { return options_.offload_activations; }
  int64_t blocks_to_swap() const { return blocks_to_swap_; }
  const std::string& label() const { return label_; }

  // What the engine is told of each block's computation.
  Compute compute() const;
  // Whether a block computed now may be differentiated later, with its weights moved by then,
  // or stepped in its backward.
  bool bracketed() const;

  void prepare();
  // One engine call before the block, one after (Engine::enter, Engine::leave).
  torch_frontend::variable_list run_block(const std::shared_ptr<Impl>& self, int64_t block,
                                          const torch_frontend::variable_list& inputs,
                                          const BlockFn& fn);
  // Block b's parameters and buffers, where they are now.
  std::vector<at::Tensor> block_tensors(int64_t block) const;
  // Before a block's forward: its load waited for (or, in the recompute pass, made).
  Entered wait(int64_t block);
  void check_index(int64_t block) const;
  // After a block's forward: its outputs bracketed in autograd, its moves. `slot` is where it
  // ran, when the caller knows.
  torch_frontend::variable_list submit(const std::shared_ptr<Impl>& self, int64_t block,
                                       const torch_frontend::variable_list& outputs,
                                       std::shared_ptr<Buffer> slot = nullptr);
  // Note [host copy after a pass] in model_offloader.cpp.
  void commit_write_backs();
  // A block's outputs, bracketed in autograd when it may be differentiated later.
  torch_frontend::variable_list bracket(const std::shared_ptr<Impl>& self, int64_t block,
                                        const torch_frontend::variable_list& outputs,
                                        std::shared_ptr<Buffer> slot = nullptr);
  // The plain verb: without the outputs, a block that autograd may differentiate cannot be
  // bracketed, unless they were (bracket_outputs) or this is the recompute pass (its backward
  // follows at once).
  void submit_without_outputs(int64_t block);

  void block_backward_starts(int64_t block, const Buffer* slot) override;
  void gradient_ready(int64_t block, std::size_t param) override;

  // An output that views the block's slot would read another block once the slot is reused.
  void check_no_output_views_weights(int64_t block, const Buffer& slot,
                                     const torch_frontend::variable_list& outputs) const;

private:
  // offloader_build.cpp: the device the options name, the torch device it computes on.
  static std::shared_ptr<Device> device_for(const Options& options);
  static c10::Device torch_device(const Device& device);
  // The engine, the model's file, the host copies packed and the tensors bound to them.
  void build();
  void use_file();

  // Backward runs inside autograd: a traced span ends at each bracket and starts at the last.
  void mark_compute(const std::string& what);

  Options options_;
  std::string label_;
  std::string compression_reason_;
  // Before everything that can fail: a rank that fails tells the node's others (its destructor).
  std::unique_ptr<torch_frontend::NodeShare> share_ =
      options_.node_sharing
          ? std::make_unique<torch_frontend::NodeShare>(options_.node_sharing, label_)
          : nullptr;
  std::weak_ptr<Impl> self_;
  std::shared_ptr<Device> device_;
  c10::Device torch_device_;
  torch_frontend::FineTuner fine_tuner_;
  std::vector<TensorBlock> blocks_;
  torch_frontend::BlockBinder binder_;
  std::optional<torch_frontend::FileWeights> file_; // Options::weights_file
  int64_t blocks_to_swap_ = 0;
  std::unique_ptr<Engine> engine_;
  // bracket_outputs saw block i's outputs since its wait: the plain submit may follow.
  std::vector<bool> outputs_seen_;
  Trace::Clock::time_point last_mark_;
};

} // namespace blockswap
