// The blockswap command-line tool: `blockswap run`, `blockswap plan` and `blockswap bench`.
//
// Every error is one line, "blockswap: error: <what>", and a non-zero exit: the options are
// checked as they are parsed (validators.hpp), and the commands check the rest before any work.
#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "blockswap/core/error.hpp"
#include "commands.hpp"
#include "validators.hpp"

namespace {

// LibTorch appends a C++ backtrace to its messages: keep the first line.
std::string first_line(const char* text) {
  std::string line(text);
  const auto end = line.find('\n');
  return end == std::string::npos ? line : line.substr(0, end);
}

int fail(const std::string& message) {
  std::fprintf(stderr, "blockswap: error: %s\n", message.c_str());
  return 1;
}

} // namespace

int main(int argc, char** argv) {
  using namespace blockswap::tool;
  CLI::App app{"blockswap: run and train models whose weights do not fit in device memory"};
  app.require_subcommand(0, 1);

  RunArgs run;
  int64_t swap = 0;
  CLI::App* run_cmd = app.add_subcommand(
      "run", "Run the reference transformer with and without block swapping and compare");
  run_cmd
      ->add_option("--mode", run.mode,
                   "infer, train (LoRA; with --weights that has no adapters, fresh adapters "
                   "of --lora-rank are added) or finetune (every block weight trains, AdamW "
                   "fused into backward)")
      ->capture_default_str();
  run_cmd
      ->add_option(
          "--step-on", run.step_on,
          "finetune: where the fused AdamW step runs, device (the optimizer state "
          "swaps with its block), host (gradients copied out, the CPU steps the host "
          "copy) or auto (the faster measured: host on the emulated device, device on a GPU)")
      ->capture_default_str();
  run_cmd->add_option("--blocks", run.blocks, "number of transformer blocks")
      ->check(integer_in<int64_t>(1, 4096))
      ->capture_default_str();
  run_cmd
      ->add_option("--swap", swap,
                   "blocks to swap, 0 <= K <= N-1; default: half the "
                   "blocks, at most that")
      ->check(integer<int64_t>());
  run_cmd->add_option("--hidden", run.hidden, "hidden size")
      ->check(integer_in<int64_t>(1, 65536))
      ->capture_default_str();
  run_cmd->add_option("--heads", run.heads, "attention heads (must divide --hidden)")
      ->check(integer_in<int64_t>(1, 65536))
      ->capture_default_str();
  run_cmd->add_option("--tokens", run.tokens, "tokens per step")
      ->check(integer_in<int64_t>(1, 65536))
      ->capture_default_str();
  run_cmd->add_option("--lora-rank", run.lora_rank, "LoRA rank in training")
      ->check(integer_in<int64_t>(1, 4096))
      ->capture_default_str();
  run_cmd->add_option("--steps", run.steps, "measured steps (after one warm-up)")
      ->check(integer_in<int>(1, 100000))
      ->capture_default_str();
  run_cmd
      ->add_option("--device", run.device,
                   "cpu (the emulated device) or cuda (default: best present)")
      ->check(device_name());
  run_cmd
      ->add_option("--link-gbps", run.link_gbps,
                   "emulated device: host-to-device GB/s (0 = unlimited, else at least 0.001)")
      ->check(link_bandwidth())
      ->capture_default_str();
  run_cmd->add_option("--threads", run.threads, "compute threads")
      ->check(integer_in<int>(1, 1024))
      ->capture_default_str();
  run_cmd->add_option("--weights", run.weights, "load the model from FILE.safetensors");
  run_cmd->add_option("--save-weights", run.save_weights, "write the model to FILE.safetensors");
  run_cmd->add_option("--host-budget", run.host_budget,
                      "with --weights: pinned host memory for the swapped blocks (12GiB, ...; 0: "
                      "none); the blocks beyond it are read from the file for each load, and the "
                      "model is loaded without a second copy");
  run_cmd
      ->add_option("--file-reads", run.file_reads,
                   "with --host-budget: direct (O_DIRECT) or drop (buffered reads, each dropped "
                   "from the page cache after)")
      ->check(CLI::IsMember({"direct", "drop"}))
      ->capture_default_str();
  run_cmd->add_option("--pinnable-bytes", run.pinnable_bytes,
                      "emulated device: page-lock at most this much host memory (0, 4GiB, ...), "
                      "as a low ulimit -l or WSL does; past it, loads are staged from pageable "
                      "memory");
  run_cmd->add_flag("--offload-activations", run.offload_activations,
                    "train or finetune: what each block saves for backward goes to host memory "
                    "and comes back before its backward");
  run_cmd
      ->add_option("--activation-threshold", run.activation_threshold,
                   "with --offload-activations: saved storages under this size stay on the "
                   "device (0: every one moves)")
      ->capture_default_str();
  run_cmd->add_option("--trace", run.trace,
                      "write a Chrome trace of compute and copies to FILE.json");
  run_cmd->add_flag("--json", run.json, "print one JSON object");
  run_cmd
      ->add_option("--compress", run.compress,
                   "off, on (the swapped blocks' frozen weights kept losslessly compressed in "
                   "host memory and decoded on the device at each load: exact, fewer bytes) or "
                   "auto (on where host memory is short, else off: blockswap plan says when "
                   "it pays; the choice and its reason are printed)")
      ->check(CLI::IsMember({"off", "on", "auto"}))
      ->capture_default_str();
  run_cmd
      ->add_option("--dtype", run.dtype,
                   "the blocks' weights and the input: float32 or bfloat16 (not with --weights, "
                   "whose file says float32)")
      ->check(CLI::IsMember({"float32", "bfloat16"}))
      ->capture_default_str();
  run_cmd
      ->add_option("--ranks", run.ranks,
                   "data-parallel LoRA training (--mode train) over R processes of this machine, "
                   "Gloo between them, one node-shared host copy of the swapped weights")
      ->check(integer_in<int>(1, 64));
  run_cmd
      ->add_option("--timeout", run.timeout_seconds,
                   "--ranks: seconds a rank waits for the others before it fails")
      ->check(CLI::Range(1.0, 86400.0))
      ->capture_default_str();
  run_cmd
      ->add_option("--nodes", run.nodes,
                   "--ranks: the ranks as N nodes of R/N ranks each (on this machine), each node "
                   "its own host copy of the swapped weights, shared by its ranks")
      ->check(integer_in<int>(1, 64))
      ->capture_default_str();
  run_cmd->add_option("--kill-rank", run.kill_rank,
                      "--ranks, fault injection: this rank kills itself (SIGKILL) in the middle "
                      "of its second step, to show how the others fail");

  PlanArgs plan;
  CLI::App* plan_cmd = app.add_subcommand(
      "plan", "Choose how many blocks of a safetensors model to swap to fit a device budget");
  plan_cmd
      ->add_option("model", plan.model,
                   "MODEL.safetensors, a sharded set's *.safetensors.index.json, or the "
                   "folder holding either (only the headers are read)")
      ->required();
  plan_cmd
      ->add_option("--budget", plan.budget, "device memory for weights: 12GiB, 12000MB, 12G, bytes")
      ->required();
  plan_cmd->add_option("--mode", plan.mode, "train or infer")->capture_default_str();
  plan_cmd->add_flag("--json", plan.json, "print one JSON object");
  plan_cmd
      ->add_option("--link-gbps", plan.link_gbps,
                   "prediction: host-to-device GB/s (PCIe 4 pinned measures about 25)")
      ->check(number_in(kMinLinkGbps, 1e6))
      ->capture_default_str();
  CLI::Option* block_ms =
      plan_cmd
          ->add_option("--block-ms", plan.block_ms,
                       "prediction: the forward of the largest block, in ms (others in proportion "
                       "to their bytes); default: from --tflops and --tokens")
          ->check(number_in(1e-6, 1e9));
  plan_cmd
      ->add_option("--tflops", plan.tflops,
                   "prediction: the device's sustained TFLOP/s (a block's forward = 2 x its "
                   "parameters x --tokens FLOPs)")
      ->check(number_in(1e-6, 1e9))
      ->excludes(block_ms)
      ->capture_default_str();
  plan_cmd->add_option("--host-budget", plan.host_budget,
                       "the file tier: host memory for the swapped blocks' weights (12GiB, ...); "
                       "the swapped blocks beyond it are read from the model file for each load "
                       "(default: all in host memory)");
  plan_cmd
      ->add_option("--disk-gbps", plan.disk_gbps,
                   "prediction, with --host-budget: the disk's read GB/s (PCIe 4 NVMe: about 7)")
      ->check(number_in(kMinLinkGbps, 1e6))
      ->capture_default_str();
  plan_cmd->add_option("--activation-bytes", plan.activation_bytes,
                       "training: the bytes each block's forward saves for backward (64MiB, ...: "
                       "`blockswap run --offload-activations --json` measures them); predicts the "
                       "step and the device memory with activations offloaded and without");
  CLI::Option* stages =
      plan_cmd
          ->add_option("--stages", plan.stages,
                       "pipeline training: cut the blocks into this many stages as DeepSpeed's "
                       "partition by parameters does, each on its own device of --budget, and "
                       "plan each")
          ->check(integer_in<int64_t>(1, 4096));
  plan_cmd->add_option("--pipeline", plan.pipeline, "with --stages: gpipe or 1f1b")
      ->check(CLI::IsMember({"gpipe", "1f1b"}, CLI::ignore_case))
      ->needs(stages)
      ->capture_default_str();
  plan_cmd->add_option("--micro-batches", plan.micro_batches, "with --stages: per step")
      ->check(integer_in<int64_t>(1, 1 << 20))
      ->needs(stages)
      ->capture_default_str();
  plan_cmd
      ->add_option("--compress-ratio", plan.compress_ratio,
                   "prediction with compressed weights (Options::compress): raw bytes over "
                   "compressed bytes (default: modelled from the checkpoint's dtypes, bf16 1.40)")
      ->check(number_in(1, 100));
  plan_cmd
      ->add_option("--decode-gbps", plan.decode_gbps,
                   "prediction with compressed weights: the device's decode GB/s (decoded bytes; "
                   "an assumption: the CUDA decoder is not yet measured)")
      ->check(number_in(kMinLinkGbps, 1e6))
      ->capture_default_str();
  plan_cmd->add_option("--tokens", plan.tokens, "prediction: tokens per step")
      ->check(integer_in<int64_t>(1, int64_t{1} << 40))
      ->excludes(block_ms)
      ->capture_default_str();

  BenchArgs bench;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench", "blockswap, the seed's schedule and the bound T*: model shapes on the timed "
               "device, then a sweep of K on the emulated device");
  bench_cmd
      ->add_option("--device", bench.device,
                   "timed (device time: model shapes, copy/compute ratios), emulated (this "
                   "machine's compute and copies) or both")
      ->check(CLI::IsMember({"timed", "emulated", "both"}))
      ->capture_default_str();
  bench_cmd->add_flag("--quick", bench.quick,
                      "timed: five K per model; emulated: 8 measured steps per point");
  bench_cmd->add_flag("--json", bench.json, "print one JSON object");
  bench_cmd->add_option("--csv", bench.csv, "also write the rows to FILE.csv");
  bench_cmd->add_option("--plot", bench.plot, "also write the plot to FILE.svg");
  bench_cmd
      ->add_option("--link-gbps", bench.link_gbps,
                   "emulated device: link GB/s (0 = unlimited, else at least 0.001)")
      ->check(link_bandwidth())
      ->capture_default_str();
  bench_cmd->add_option("--blocks", bench.blocks, "blocks")
      ->check(integer_in<int64_t>(3, 4096))
      ->capture_default_str();
  bench_cmd
      ->add_option("--hidden", bench.hidden,
                   "hidden size (heads: hidden/64; a multiple of 64 works)")
      ->check(integer_in<int64_t>(64, 65536))
      ->capture_default_str();
  bench_cmd->add_option("--steps", bench.steps, "measured steps per point (default 20, 8 quick)")
      ->check(integer_in<int>(1, 100000));
  bench_cmd
      ->add_option("--tokens", bench.tokens,
                   "tokens (default: calibrated so a block's compute takes its copy time)")
      ->check(integer_in<int64_t>(1, 65536));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e); // --help
    std::string message = e.what();
    for (char& c : message) c = c == '\n' ? ' ' : c;
    std::fprintf(stderr, "blockswap: error: %s (see --help)\n", message.c_str());
    return e.get_exit_code();
  }
  if (run_cmd->count("--swap") > 0) run.swap = swap;
  run.blocks_given = run_cmd->count("--blocks") > 0;
  run.hidden_given = run_cmd->count("--hidden") > 0;
  run.heads_given = run_cmd->count("--heads") > 0;

  try {
    if (*plan_cmd) return plan_command(plan);
    if (*bench_cmd) return bench_command(bench);
    BLOCKSWAP_CHECK(run_cmd->count("--file-reads") == 0 || run_cmd->count("--host-budget") > 0,
                    "--file-reads applies to --host-budget (the file tier) only");
    if (run_cmd->count("--host-budget") > 0) {
      BLOCKSWAP_CHECK(!run.host_budget.empty(), "--host-budget needs a size (12GiB, 0, ...)");
      BLOCKSWAP_CHECK(run.ranks == 0, "--host-budget with --ranks: the tool runs the file tier "
                                      "in one process; leave one of them out");
    }
    BLOCKSWAP_CHECK(run_cmd->count("--activation-threshold") == 0 || run.offload_activations,
                    "--activation-threshold applies to --offload-activations only");
    BLOCKSWAP_CHECK(run_cmd->count("--pinnable-bytes") == 0 || !run.pinnable_bytes.empty(),
                    "--pinnable-bytes needs a size (0, 64MiB, ...)");
    BLOCKSWAP_CHECK(run.ranks == 0 || run.dtype == "float32",
                    "--ranks runs the model in float32: leave --dtype out");
    BLOCKSWAP_CHECK(run.dtype == "float32" || run.weights.empty(),
                    "--dtype bfloat16 makes the model's own weights bfloat16; --weights files "
                    "hold float32: leave one of them out");
    BLOCKSWAP_CHECK(run.nodes == 1 || run.ranks > 0,
                    "--nodes splits the ranks of --ranks into nodes: give --ranks too");
    if (run.ranks > 0) return ranks_command(run, argv);
    return run_command(run); // `blockswap` alone runs the default comparison
  } catch (const std::bad_alloc&) {
    return fail("out of host memory: try a smaller --blocks, --hidden or --tokens");
  } catch (const std::exception& e) {
    return fail(first_line(e.what()));
  }
}
