// Offloaded activations in C++ replace the process's autograd engine (Note [saved-tensor hooks
// in C++] in torch_compat_autograd.cpp). Where another library replaced it first, installing is
// a clear blockswap::Error that leaves that engine in charge, for an ActivationScope and for a
// ModelOffloader with offload_activations alike. Process-wide state: this executable is the
// only one that replaces the engine with another, and holds only this case.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include "blockswap/core/error.hpp"
#include "blockswap/torch.hpp"
#include "test_model.hpp"
#include "torch_compat_autograd.hpp"

namespace blockswap {
namespace {

// Another library's engine: LibTorch's own class, subclassed.
class OtherEngine final : public torch::autograd::Engine {
public:
  ~OtherEngine() override { stop(); }
};

torch::autograd::Engine& other_engine() {
  static OtherEngine engine;
  return engine;
}

std::unique_ptr<torch_frontend::compat::SavedTensorHooks> no_hooks() {
  return nullptr;
}

TEST(TorchCompatAutograd, AnotherLibrarysEngineIsAClearErrorAndStaysInCharge) {
  torch::autograd::set_default_engine_stub(&other_engine);
  ASSERT_EQ(&torch::autograd::Engine::get_default_engine(), &other_engine());

  try {
    torch_frontend::compat::install_saved_tensor_hooks(&no_hooks);
    ADD_FAILURE() << "installed over another library's engine";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("the engine in charge is not LibTorch's own"), std::string::npos)
        << message;
    EXPECT_NE(message.find("another library replaced it first"), std::string::npos) << message;
  }
  EXPECT_EQ(&torch::autograd::Engine::get_default_engine(), &other_engine());

  // The front end's entry points refuse the same way, and change nothing.
  expect_error([] { const ActivationScope scope(kDevice, "blocks.0", {}, 0); },
               "not LibTorch's own");
  Model model(3);
  Options o = options(1, true);
  o.offload_activations = true;
  expect_error([&] { ModelOffloader offloader("blocks", model.modules(), o); },
               "not LibTorch's own");
  EXPECT_EQ(&torch::autograd::Engine::get_default_engine(), &other_engine());

  // Training on the other engine still works, and nothing was offloaded.
  const Inputs in;
  model.forward(in.x, in.context).pow(2).mean().backward();
  EXPECT_EQ(activation_stats(kDevice).offloaded_bytes, 0u);
}

} // namespace
} // namespace blockswap
