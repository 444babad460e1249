// The blockswap command-line tool: `blockswap run` and `blockswap plan`.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <string>

#include "commands.hpp"

namespace {

// Errors are one line: LibTorch appends a C++ backtrace to its messages.
std::string first_line(const char* text) {
  std::string line(text);
  const auto end = line.find('\n');
  return end == std::string::npos ? line : line.substr(0, end);
}

} // namespace

int main(int argc, char** argv) {
  using namespace blockswap::tool;
  CLI::App app{"blockswap: run and train models whose weights do not fit in device memory"};
  app.require_subcommand(0, 1);

  RunArgs run;
  CLI::App* run_cmd = app.add_subcommand(
      "run", "Run the reference transformer with and without block swapping and compare");
  run_cmd->add_option("--mode", run.mode, "infer or train (LoRA)")->capture_default_str();
  run_cmd->add_option("--blocks", run.blocks, "number of transformer blocks")
      ->capture_default_str();
  run_cmd->add_option("--swap", run.swap, "blocks to swap (default: half of them)");
  run_cmd->add_option("--hidden", run.hidden, "hidden size")->capture_default_str();
  run_cmd->add_option("--heads", run.heads, "attention heads")->capture_default_str();
  run_cmd->add_option("--tokens", run.tokens, "tokens per step")->capture_default_str();
  run_cmd->add_option("--lora-rank", run.lora_rank, "LoRA rank in training")->capture_default_str();
  run_cmd->add_option("--steps", run.steps, "measured steps (after one warm-up)")
      ->capture_default_str();
  run_cmd->add_option("--device", run.device,
                      "cpu (the emulated device) or cuda (default: best present)");
  run_cmd->add_option("--link-gbps", run.link_gbps, "emulated device: host-to-device GB/s")
      ->capture_default_str();
  run_cmd->add_option("--threads", run.threads, "compute threads")->capture_default_str();
  run_cmd->add_option("--weights", run.weights, "load the model from FILE.safetensors");
  run_cmd->add_option("--save-weights", run.save_weights, "write the model to FILE.safetensors");
  run_cmd->add_option("--trace", run.trace,
                      "write a Chrome trace of compute and copies to FILE.json");
  run_cmd->add_flag("--json", run.json, "print one JSON object");

  PlanArgs plan;
  CLI::App* plan_cmd = app.add_subcommand(
      "plan", "Choose how many blocks of a safetensors model to swap to fit a device budget");
  plan_cmd->add_option("model", plan.model, "MODEL.safetensors (only its header is read)")
      ->required();
  plan_cmd
      ->add_option("--budget", plan.budget, "device memory for weights: 12GiB, 12000MB, 12G, bytes")
      ->required();
  plan_cmd->add_option("--mode", plan.mode, "train or infer")->capture_default_str();
  plan_cmd->add_flag("--json", plan.json, "print one JSON object");

  BenchArgs bench;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench", "Sweep K on the emulated device: blockswap, the seed's schedule and the bound T*");
  bench_cmd->add_flag("--quick", bench.quick, "8 measured steps per point (under two minutes)");
  bench_cmd->add_flag("--json", bench.json, "print one JSON object");
  bench_cmd->add_option("--csv", bench.csv, "also write the rows to FILE.csv");
  bench_cmd->add_option("--plot", bench.plot, "also write the plot to FILE.svg");
  bench_cmd->add_option("--link-gbps", bench.link_gbps, "emulated link GB/s")
      ->capture_default_str();
  bench_cmd->add_option("--blocks", bench.blocks, "blocks")->capture_default_str();
  bench_cmd->add_option("--hidden", bench.hidden, "hidden size")->capture_default_str();
  bench_cmd->add_option("--steps", bench.steps, "measured steps per point (default 20, 8 quick)");
  bench_cmd->add_option("--tokens", bench.tokens,
                        "tokens (default: calibrated so a block's compute takes its copy time)");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*plan_cmd) return plan_command(plan);
    if (*bench_cmd) return bench_command(bench);
    return run_command(run); // `blockswap` alone runs the default comparison
  } catch (const std::exception& e) {
    std::fprintf(stderr, "blockswap: error: %s\n", first_line(e.what()).c_str());
    return 1;
  }
}
