// The blockswap tool, run as a user runs it.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <sys/wait.h>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Result {
  int exit_code = -1;
  std::string out, err;
};

fs::path scratch() {
  fs::path dir = fs::temp_directory_path() / ("blockswap_tool_test_" + std::to_string(getpid()));
  fs::create_directories(dir);
  return dir;
}

// Removes the scratch files (the sparse 24 GB models among them) when the tests end.
struct RemoveScratch {
  ~RemoveScratch() {
    std::error_code ignored;
    fs::remove_all(scratch(), ignored);
  }
} remove_scratch;

// The tool started with `args` (and `environment`, "NAME=value ..." before the command);
// finish() waits for it.
struct Started {
  FILE* pipe = nullptr;
  fs::path err;
};
Started start_tool(const std::string& args, const std::string& environment = "",
                   const std::string& name = "stderr") {
  Started started{nullptr, scratch() / (name + ".txt")};
  const std::string command =
      environment + " " + std::string(BLOCKSWAP_TOOL) + " " + args + " 2>" + started.err.string();
  started.pipe = popen(command.c_str(), "r");
  return started;
}
Result finish(Started started) {
  Result result;
  char buffer[4096];
  for (std::size_t n; (n = fread(buffer, 1, sizeof buffer, started.pipe)) > 0;)
    result.out.append(buffer, n);
  const int status = pclose(started.pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(started.err);
  result.err.assign(std::istreambuf_iterator<char>(in), {});
  return result;
}

Result run_tool(const std::string& args, const std::string& environment = "") {
  return finish(start_tool(args, environment));
}

// A safetensors file with a real header and a sparse data section: a 24 GB model on disk
// without 24 GB of disk.
struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
};

uint64_t write_sparse_model(const fs::path& path, const std::vector<Tensor>& tensors,
                            const std::string& dtype, int element,
                            const json& metadata = json::object()) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const Tensor& t : tensors) {
    uint64_t bytes = element;
    for (int64_t d : t.shape) bytes *= d;
    header[t.name] = {
        {"dtype", dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  const std::string text = header.dump();
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  const uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) file.put(static_cast<char>((length >> (8 * i)) & 0xFF));
  file << text;
  file.close();
  fs::resize_file(path, 8 + text.size() + offset);
  return offset;
}

void linear(std::vector<Tensor>& out, const std::string& name, int64_t o, int64_t i) {
  out.push_back({name + ".weight", {o, i}});
  out.push_back({name + ".bias", {o}});
}

// FLUX.1 [dev]: 19 double blocks, 38 single blocks, hidden 3072, bf16.
std::vector<Tensor> flux_tensors() {
  std::vector<Tensor> t;
  linear(t, "img_in", 3072, 64);
  linear(t, "txt_in", 3072, 4096);
  for (const char* e : {"time_in", "guidance_in"}) {
    linear(t, std::string(e) + ".in_layer", 3072, 256);
    linear(t, std::string(e) + ".out_layer", 3072, 3072);
  }
  linear(t, "vector_in.in_layer", 3072, 768);
  linear(t, "vector_in.out_layer", 3072, 3072);
  for (int i = 0; i < 19; ++i) {
    const std::string p = "double_blocks." + std::to_string(i) + ".";
    for (const std::string s : {"img", "txt"}) {
      linear(t, p + s + "_mod.lin", 18432, 3072);
      linear(t, p + s + "_attn.qkv", 9216, 3072);
      t.push_back({p + s + "_attn.norm.query_norm.scale", {128}});
      t.push_back({p + s + "_attn.norm.key_norm.scale", {128}});
      linear(t, p + s + "_attn.proj", 3072, 3072);
      linear(t, p + s + "_mlp.0", 12288, 3072);
      linear(t, p + s + "_mlp.2", 3072, 12288);
    }
  }
  for (int i = 0; i < 38; ++i) {
    const std::string p = "single_blocks." + std::to_string(i) + ".";
    linear(t, p + "linear1", 21504, 3072);
    linear(t, p + "linear2", 3072, 15360);
    t.push_back({p + "norm.query_norm.scale", {128}});
    t.push_back({p + "norm.key_norm.scale", {128}});
    linear(t, p + "modulation.lin", 9216, 3072);
  }
  linear(t, "final_layer.linear", 64, 3072);
  linear(t, "final_layer.adaLN_modulation.1", 6144, 3072);
  return t;
}

// Wan2.1 14B: 40 blocks, hidden 5120, FFN 13824, bf16.
std::vector<Tensor> wan_tensors() {
  std::vector<Tensor> t;
  t.push_back({"patch_embedding.weight", {5120, 16, 1, 2, 2}});
  t.push_back({"patch_embedding.bias", {5120}});
  linear(t, "text_embedding.0", 5120, 4096);
  linear(t, "text_embedding.2", 5120, 5120);
  linear(t, "time_embedding.0", 5120, 256);
  linear(t, "time_embedding.2", 5120, 5120);
  linear(t, "time_projection.1", 30720, 5120);
  for (int i = 0; i < 40; ++i) {
    const std::string p = "blocks." + std::to_string(i) + ".";
    for (const std::string a : {"self_attn", "cross_attn"}) {
      for (const std::string w : {"q", "k", "v", "o"}) linear(t, p + a + "." + w, 5120, 5120);
      t.push_back({p + a + ".norm_q.weight", {5120}});
      t.push_back({p + a + ".norm_k.weight", {5120}});
    }
    linear(t, p + "ffn.0", 13824, 5120);
    linear(t, p + "ffn.2", 5120, 13824);
    t.push_back({p + "norm3.weight", {5120}});
    t.push_back({p + "norm3.bias", {5120}});
    t.push_back({p + "modulation", {1, 6, 5120}});
  }
  linear(t, "head.head", 64, 5120);
  t.push_back({"head.modulation", {1, 2, 5120}});
  return t;
}

uint64_t bytes_with_prefix(const std::vector<Tensor>& tensors, const std::string& prefix) {
  uint64_t total = 0;
  for (const Tensor& t : tensors) {
    if (t.name.rfind(prefix, 0) != 0) continue;
    uint64_t bytes = 2;
    for (int64_t d : t.shape) bytes *= d;
    total += bytes;
  }
  return total;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The seconds the tool takes to start and stop doing nothing: LibTorch's start-up, under a
// second, but several under the sanitizers (and their leak check at exit).
double startup_seconds() {
  static const double seconds = [] {
    const auto start = std::chrono::steady_clock::now();
    run_tool("plan none.safetensors --budget twelve"); // fails before opening the file
    return seconds_since(start);
  }();
  return seconds;
}

json plan_json(const fs::path& model, const std::string& budget, const std::string& mode) {
  const double limit = 2 * startup_seconds() + 2.0;
  const auto start = std::chrono::steady_clock::now();
  const Result r =
      run_tool("plan " + model.string() + " --budget " + budget + " --mode " + mode + " --json");
  const double seconds = seconds_since(start);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(seconds, limit) << "plan should read only the header (the tool starts in "
                            << startup_seconds() << " s)";
  return json::parse(r.out);
}

TEST(Plan, FluxShapedModel) {
  const auto tensors = flux_tensors();
  const fs::path model = scratch() / "flux1-dev.safetensors";
  const uint64_t total = write_sparse_model(model, tensors, "BF16", 2);
  EXPECT_GT(total, 23'000'000'000u); // FLUX.1 [dev] is about 23.8 GB
  for (const std::string mode : {"train", "infer"}) {
    for (const std::string budget : {"24GiB", "12GiB", "8GiB", "12000MB"}) {
      const json plan = plan_json(model, budget, mode);
      ASSERT_EQ(plan["groups"].size(), 2u);
      const json& d = plan["groups"][0];
      const json& s = plan["groups"][1];
      EXPECT_EQ(d["name"], "double_blocks");
      EXPECT_EQ(d["blocks"], 19);
      EXPECT_EQ(d["total_bytes"], bytes_with_prefix(tensors, "double_blocks."));
      EXPECT_EQ(s["name"], "single_blocks");
      EXPECT_EQ(s["blocks"], 38);
      EXPECT_EQ(s["total_bytes"], bytes_with_prefix(tensors, "single_blocks."));
      EXPECT_EQ(plan["non_block_bytes"].get<uint64_t>() + d["total_bytes"].get<uint64_t>() +
                    s["total_bytes"].get<uint64_t>(),
                total);
      EXPECT_LE(plan["device_bytes"].get<uint64_t>(), plan["budget_bytes"].get<uint64_t>());
      uint64_t device = plan["non_block_bytes"];
      for (const json& g : plan["groups"]) {
        device += (g["blocks"].get<uint64_t>() - g["blocks_to_swap"].get<uint64_t>()) *
                  g["block_bytes"].get<uint64_t>();
      }
      EXPECT_EQ(device, plan["device_bytes"].get<uint64_t>());
    }
  }
  EXPECT_EQ(plan_json(model, "24GiB", "train")["groups"][0]["blocks_to_swap"], 0);
}

// Pipeline stages: FLUX.1 cut into 4 stages of 1F1B, each planned for its own device; every
// block in one stage, in order; the loads per step as each stage's turns make them.
TEST(Plan, PipelineStagesOfFlux) {
  const fs::path model = scratch() / "flux1-stages.safetensors";
  write_sparse_model(model, flux_tensors(), "BF16", 2);
  const Result r = run_tool("plan " + model.string() +
                            " --budget 4GiB --mode train --stages 4 --micro-batches 8 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json plan = json::parse(r.out);
  ASSERT_EQ(plan["stages"].size(), 4u);
  std::map<std::string, int64_t> next;
  for (std::size_t s = 0; s < 4; ++s) {
    const json& stage = plan["stages"][s];
    EXPECT_LE(stage["device_bytes"].get<uint64_t>(), plan["budget_bytes"].get<uint64_t>());
    int64_t plain = 0, seed_turns = 0;
    for (const json& list : stage["lists"]) {
      const std::string group = list["group"];
      EXPECT_EQ(list["first_block"].get<int64_t>(), next[group]) << group;
      next[group] = list["end_block"];
      const int64_t n = list["end_block"].get<int64_t>() - list["first_block"].get<int64_t>();
      const int64_t k = list["blocks_to_swap"];
      plain += 2 * k * 8;
      seed_turns += std::min(k, n - k);
    }
    const int64_t turns = std::min<int64_t>(4 - static_cast<int64_t>(s), 8) - 1;
    const json& seed = stage["choices"][0];
    EXPECT_EQ(seed["training_rotating_slots"], 0);
    EXPECT_EQ(seed["loads_per_step"].get<int64_t>(), plain + 2 * turns * seed_turns) << s;
    for (const json& c : stage["choices"]) {
      EXPECT_LE(c["loads_per_step"].get<int64_t>(), seed["loads_per_step"].get<int64_t>());
      EXPECT_GE(c["predicted_step_seconds"].get<double>(),
                stage["predicted_noswap_seconds"].get<double>() * 0.999);
    }
  }
  EXPECT_EQ(next["double_blocks"], 19);
  EXPECT_EQ(next["single_blocks"], 38);
  const Result infer =
      run_tool("plan " + model.string() + " --budget 4GiB --mode infer --stages 2");
  EXPECT_NE(infer.exit_code, 0);
  EXPECT_NE(infer.err.find("--mode train"), std::string::npos) << infer.err;
  const Result small = run_tool("plan " + model.string() + " --budget 256MiB --stages 2");
  EXPECT_NE(small.exit_code, 0);
  EXPECT_NE(small.err.find("stage 0 of 2"), std::string::npos) << small.err;
}

// A sharded diffusers checkpoint (by its index and by its folder) and ComfyUI's one file plan as
// the one file does: a block's bytes summed across the shards it lies in.
TEST(Plan, AShardedCheckpointPlansAsItsOneFile) {
  const auto tensors = flux_tensors();
  const fs::path one = scratch() / "flux-one.safetensors";
  write_sparse_model(one, tensors, "BF16", 2);
  const fs::path folder = scratch() / "flux-sharded";
  fs::create_directories(folder);
  std::vector<std::vector<Tensor>> shards(3);
  json weight_map = json::object();
  for (std::size_t i = 0; i < tensors.size(); ++i) { // every block's tensors across the shards
    shards[i % 3].push_back(tensors[i]);
    weight_map[tensors[i].name] = "m-0000" + std::to_string(i % 3 + 1) + "-of-00003.safetensors";
  }
  for (std::size_t s = 0; s < 3; ++s) {
    write_sparse_model(folder / ("m-0000" + std::to_string(s + 1) + "-of-00003.safetensors"),
                       shards[s], "BF16", 2);
  }
  std::ofstream(folder / "m.safetensors.index.json")
      << json{{"metadata", json::object()}, {"weight_map", weight_map}}.dump();
  std::vector<Tensor> comfy = tensors;
  for (Tensor& t : comfy) t.name = "model.diffusion_model." + t.name;
  const fs::path comfy_file = scratch() / "flux-comfy.safetensors";
  write_sparse_model(comfy_file, comfy, "BF16", 2);
  const json expected = plan_json(one, "12GiB", "train");
  for (const fs::path& model : {folder / "m.safetensors.index.json", folder, comfy_file}) {
    const json plan = plan_json(model, "12GiB", "train");
    ASSERT_EQ(plan["groups"].size(), 2u) << model;
    for (std::size_t g = 0; g < 2; ++g) {
      for (const char* key : {"blocks", "block_bytes", "total_bytes", "blocks_to_swap"}) {
        EXPECT_EQ(plan["groups"][g][key], expected["groups"][g][key]) << model << " " << key;
      }
    }
    EXPECT_EQ(plan["non_block_bytes"], expected["non_block_bytes"]) << model;
  }
  fs::remove(folder / "m-00002-of-00003.safetensors");
  const Result missing = run_tool("plan " + folder.string() + " --budget 12GiB");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("m-00002-of-00003.safetensors' that the index"), std::string::npos)
      << missing.err;
}

TEST(Plan, WanShapedModel) {
  const auto tensors = wan_tensors();
  const fs::path model = scratch() / "wan2.1-t2v-14b.safetensors";
  write_sparse_model(model, tensors, "BF16", 2);
  const json plan = plan_json(model, "12GiB", "train");
  ASSERT_EQ(plan["groups"].size(), 1u);
  const json& g = plan["groups"][0];
  EXPECT_EQ(g["name"], "blocks");
  EXPECT_EQ(g["blocks"], 40);
  EXPECT_EQ(g["total_bytes"], bytes_with_prefix(tensors, "blocks."));
  EXPECT_LE(plan["device_bytes"].get<uint64_t>(), 12ull << 30);
  // One block fewer swapped would not fit.
  EXPECT_GT(plan["device_bytes"].get<uint64_t>() + g["block_bytes"].get<uint64_t>(), 12ull << 30);
  const Result table = run_tool("plan " + model.string() + " --budget 12GiB");
  EXPECT_EQ(table.exit_code, 0);
  EXPECT_NE(table.out.find("blocks"), std::string::npos);
}

TEST(Plan, BudgetTooSmallNamesTheSmallestThatWorks) {
  const fs::path model = scratch() / "wan-small-budget.safetensors";
  write_sparse_model(model, wan_tensors(), "BF16", 2);
  const Result r = run_tool("plan " + model.string() + " --budget 1GiB");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("the smallest budget that works is"), std::string::npos) << r.err;
  const Result bad = run_tool("plan " + model.string() + " --budget twelve");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("size 'twelve'"), std::string::npos) << bad.err;
}

// The prediction: on the FLUX- and Wan-shaped files, in both modes, the simulator's step time
// against no swapping. A fast link hides every load; a slow one does not.
// Compressed weights (Options::compress): the ratio modelled from the checkpoint's dtypes (bf16:
// 1.40), and whether it pays: where the link bounds the step it pays, where the compute does it
// changes nothing, and a decoder slower than the link costs.
TEST(Plan, SaysWhetherCompressionPays) {
  const fs::path flux = scratch() / "flux-compress.safetensors";
  write_sparse_model(flux, flux_tensors(), "BF16", 2);
  auto plan = [&](const std::string& options) {
    const Result r = run_tool("plan " + flux.string() + " --budget 12GiB " + options + " --json");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return json::parse(r.out)["compression"];
  };
  for (const std::string mode : {"train", "infer"}) {
    const json link_bound = plan("--mode " + mode + " --tflops 400 --tokens 4096 --link-gbps 4");
    EXPECT_NEAR(link_bound["ratio"].get<double>(), 1.40, 0.01);
    EXPECT_EQ(link_bound["ratio_from"], "dtypes");
    EXPECT_EQ(link_bound["verdict"], "pays") << mode;
    const json compute_bound = plan("--mode " + mode + " --block-ms 40 --link-gbps 50");
    EXPECT_EQ(compute_bound["verdict"], "changes nothing") << mode;
    const json slow_decoder =
        plan("--mode " + mode + " --tflops 400 --tokens 4096 --link-gbps 25 --decode-gbps 2");
    EXPECT_EQ(slow_decoder["verdict"], "costs") << mode;
  }
  EXPECT_EQ(plan("--mode infer --compress-ratio 2")["ratio"].get<double>(), 2.0);
  const Result table = run_tool("plan " + flux.string() + " --budget 12GiB --link-gbps 4");
  EXPECT_NE(table.out.find("compressed weights"), std::string::npos) << table.out;
  const Result bad = run_tool("plan " + flux.string() + " --budget 12GiB --compress-ratio 0.5");
  EXPECT_NE(bad.exit_code, 0);
}

// With compression each group's two decode buffers are on the device beside its slots: the plan
// with compression fits the budget with them (as the Python planner and the offloaders count
// them).
TEST(Plan, CompressionCountsTheDecodeBuffersInTheBudget) {
  const fs::path flux = scratch() / "flux-decode-buffers.safetensors";
  write_sparse_model(flux, flux_tensors(), "BF16", 2);
  for (const std::string mode : {"train", "infer"}) {
    const Result r = run_tool("plan " + flux.string() + " --budget 12GiB --mode " + mode +
                              " --link-gbps 4 --json");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const json out = json::parse(r.out);
    const json& c = out["compression"];
    uint64_t largest = 0; // two buffers of each group's block
    for (const json& g : out["groups"]) largest += 2 * g["block_bytes"].get<uint64_t>();
    const uint64_t budget = out["budget_bytes"].get<uint64_t>();
    EXPECT_GE(c["decode_buffer_bytes"].get<uint64_t>(), largest) << mode;
    EXPECT_LE(c["device_bytes"].get<uint64_t>(), budget) << mode;
    // Where the raw plan leaves no room for them, the compressed plan is another one.
    const bool room = out["device_bytes"].get<uint64_t>() + largest <= budget;
    EXPECT_EQ(c["blocks_to_swap"] == json::array({out["groups"][0]["blocks_to_swap"],
                                                  out["groups"][1]["blocks_to_swap"]}),
              room)
        << mode << r.out;
  }
}

TEST(Plan, PredictsTheStepTimeAndTheRotatingSlots) {
  const fs::path flux = scratch() / "flux-predict.safetensors";
  const fs::path wan = scratch() / "wan-predict.safetensors";
  write_sparse_model(flux, flux_tensors(), "BF16", 2);
  write_sparse_model(wan, wan_tensors(), "BF16", 2);
  for (const fs::path& model : {flux, wan}) {
    for (const std::string mode : {"train", "infer"}) {
      const Result fast = run_tool("plan " + model.string() + " --budget 12GiB --mode " + mode +
                                   " --block-ms 40 --link-gbps 50 --json");
      ASSERT_EQ(fast.exit_code, 0) << fast.err;
      const json f = json::parse(fast.out);
      ASSERT_EQ(f["rotating_slots"].size(), f["groups"].size());
      EXPECT_NEAR(f["predicted_overhead"].get<double>(), 0.0, 0.01) << model << " " << mode;
      EXPECT_GE(f["predicted_step_seconds"].get<double>(),
                f["predicted_noswap_seconds"].get<double>());
      for (const json& g : f["groups"]) {
        const bool rotates = mode == "infer" && g["blocks_to_swap"].get<int64_t>() > 0;
        EXPECT_EQ(g["rotating_slots"].get<int64_t>() > 0, rotates) << g.dump();
      }
      const Result slow = run_tool("plan " + model.string() + " --budget 12GiB --mode " + mode +
                                   " --tflops 400 --tokens 4096 --link-gbps 4 --json");
      ASSERT_EQ(slow.exit_code, 0) << slow.err;
      const json w = json::parse(slow.out);
      EXPECT_GT(w["predicted_overhead"].get<double>(), 0.05) << model << " " << mode;
      EXPECT_EQ(w["compute"]["tokens"], 4096);
    }
    const Result table = run_tool("plan " + model.string() + " --budget 12GiB --mode infer");
    EXPECT_NE(table.out.find("predicted pass"), std::string::npos) << table.out;
    EXPECT_NE(table.out.find("rotating slots"), std::string::npos) << table.out;
  }
  const Result bad = run_tool("plan " + wan.string() + " --budget 12GiB --block-ms -1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--block-ms"), std::string::npos) << bad.err;
}

// The file tier's plan: with --host-budget the swapped blocks beyond it are read from the file
// for each load; the prediction plays the disk in series with the link (simulator.hpp).
TEST(Plan, AHostBudgetPlansThreeTiers) {
  const fs::path model = scratch() / "flux-tiers.safetensors";
  write_sparse_model(model, flux_tensors(), "BF16", 2);
  for (const std::string mode : {"train", "infer"}) {
    const std::string plan = "plan " + model.string() + " --budget 12GiB --mode " + mode +
                             " --block-ms 40 --link-gbps 25 --json";
    const json memory = json::parse(run_tool(plan).out);
    EXPECT_FALSE(memory.contains("host_budget_bytes"));
    // Everything in host memory: the plan without a file tier.
    const json all = json::parse(run_tool(plan + " --host-budget 1000GiB").out);
    EXPECT_EQ(all["predicted_step_seconds"], memory["predicted_step_seconds"]);
    for (const json& g : all["groups"]) EXPECT_EQ(g["file_blocks"], 0) << g.dump();
    // Nothing in host memory, a slow disk: every swapped block from the file, the disk the pace.
    const Result none = run_tool(plan + " --host-budget 0 --disk-gbps 0.5");
    ASSERT_EQ(none.exit_code, 0) << none.err;
    const json n = json::parse(none.out);
    EXPECT_EQ(n["host_bytes"], 0);
    uint64_t read = 0;
    for (const json& g : n["groups"]) {
      EXPECT_EQ(g["pinned_blocks"], 0);
      EXPECT_EQ(g["file_blocks"].get<int64_t>() > 0, g["blocks_to_swap"].get<int64_t>() > 0);
      read += g["disk_read_bytes"].get<uint64_t>();
    }
    EXPECT_GT(read, 0u);
    EXPECT_GE(n["predicted_step_seconds"].get<double>(), double(read) / 0.5e9 * (1 - 1e-9));
    EXPECT_GT(n["predicted_step_seconds"].get<double>(),
              n["predicted_in_memory_step_seconds"].get<double>());
    // Half the swapped bytes in host memory: some blocks of each kind.
    const Result half = run_tool(plan + " --host-budget 4GiB --disk-gbps 7");
    ASSERT_EQ(half.exit_code, 0) << half.err;
    const json h = json::parse(half.out);
    EXPECT_LE(h["host_bytes"].get<uint64_t>(), uint64_t{4} << 30);
    EXPECT_GT(h["host_bytes"].get<uint64_t>(), 0u);
  }
  const Result table = run_tool("plan " + model.string() + " --budget 12GiB --host-budget 2GiB");
  EXPECT_NE(table.out.find("from the file"), std::string::npos) << table.out;
  const Result bad = run_tool("plan " + model.string() + " --budget 12GiB --host-budget lots");
  EXPECT_NE(bad.exit_code, 0);
}

// --activation-bytes: the step and the device memory with activations offloaded and kept.
TEST(Plan, ActivationBytesPredictTheStepWithThemOffloaded) {
  const fs::path model = scratch() / "flux-activations.safetensors";
  write_sparse_model(model, flux_tensors(), "BF16", 2);
  const std::string plan =
      "plan " + model.string() + " --budget 12GiB --mode train --block-ms 40 --json";
  const json without = json::parse(run_tool(plan).out);
  EXPECT_FALSE(without.contains("activations"));
  // Small activations hide under compute on a duplex link; large ones make the link the bound.
  const json small = json::parse(run_tool(plan + " --link-gbps 25 --activation-bytes 64MiB").out);
  const json& a = small["activations"];
  EXPECT_EQ(a["bytes_per_block"], uint64_t{64} << 20);
  EXPECT_EQ(a["device_bytes"], (uint64_t{64} << 20) * 57); // 19 double and 38 single blocks
  EXPECT_EQ(a["offloaded_device_bytes"], (uint64_t{64} << 20) * 2);
  EXPECT_EQ(a["offloaded_bytes_per_step"], (uint64_t{64} << 20) * 56);
  EXPECT_NEAR(a["predicted_offloaded_step_seconds"].get<double>(),
              small["predicted_step_seconds"].get<double>(),
              small["predicted_step_seconds"].get<double>() * 0.02);
  const json large = json::parse(run_tool(plan + " --link-gbps 25 --activation-bytes 8GiB").out);
  EXPECT_GE(large["activations"]["predicted_offloaded_step_seconds"].get<double>(),
            56 * 8.0 * (1 << 30) / 25e9 * (1 - 1e-9));
  const Result table =
      run_tool("plan " + model.string() + " --budget 12GiB --activation-bytes 1GiB");
  EXPECT_NE(table.out.find("activations (1.00 GiB a block)"), std::string::npos) << table.out;
  const Result infer =
      run_tool("plan " + model.string() + " --budget 12GiB --mode infer --activation-bytes 1GiB");
  EXPECT_NE(infer.exit_code, 0);
  EXPECT_NE(infer.err.find("--activation-bytes applies to --mode train"), std::string::npos)
      << infer.err;
}

// Twelve groups of twelve blocks: the search is polynomial (an exhaustive one did not finish in
// two minutes), and the prediction too.
TEST(Plan, TwelveGroupsPlanInUnderASecond) {
  std::vector<Tensor> tensors;
  for (int g = 0; g < 12; ++g) {
    for (int i = 0; i < 12; ++i) {
      tensors.push_back({"group" + std::to_string(g) + ".layers." + std::to_string(i) + ".weight",
                         {2048 + 128 * g, 2048}});
    }
  }
  const fs::path model = scratch() / "twelve-groups.safetensors";
  write_sparse_model(model, tensors, "BF16", 2);
  for (const std::string mode : {"train", "infer"}) {
    const auto start = std::chrono::steady_clock::now();
    const Result r =
        run_tool("plan " + model.string() + " --budget 300MiB --mode " + mode + " --json");
    const double seconds = seconds_since(start) - startup_seconds();
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_LT(seconds, 1.0);
    const json plan = json::parse(r.out);
    EXPECT_EQ(plan["groups"].size(), 12u);
    EXPECT_LE(plan["device_bytes"].get<uint64_t>(), 300ull << 20);
  }
}

void write_raw(const fs::path& path, const std::string& json_text, std::size_t data,
               uint64_t length_override = UINT64_MAX) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  const uint64_t length = length_override == UINT64_MAX ? json_text.size() : length_override;
  for (int i = 0; i < 8; ++i) file.put(static_cast<char>((length >> (8 * i)) & 0xFF));
  file << json_text << std::string(data, '\0');
}

TEST(Plan, MalformedFilesAreClearErrors) {
  const fs::path dir = scratch();
  const std::string one = R"({"blocks.0.w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  struct Case {
    std::string name, json;
    std::size_t data;
    uint64_t length;
    std::string message;
  };
  const std::vector<Case> cases{
      {"truncated", "", 0, UINT64_MAX, "truncated safetensors file"},
      {"length", one, 16, 1u << 20, "runs past the end of the file"},
      {"json", R"({"blocks.0.w": [)", 0, UINT64_MAX, "not valid JSON"},
      {"dtype", R"({"blocks.0.w":{"dtype":"Q4","shape":[4],"data_offsets":[0,4]}})", 4, UINT64_MAX,
       "unknown safetensors dtype 'Q4'"},
      {"shape", R"({"blocks.0.w":{"dtype":"F32","shape":[5],"data_offsets":[0,16]}})", 16,
       UINT64_MAX, "needs 20 bytes but its data_offsets span 16"},
      {"outside", one, 8, UINT64_MAX, "lie outside the data"},
      {"overlap",
       R"({"blocks.0.w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
       R"("blocks.1.w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
       16, UINT64_MAX, "overlap"},
  };
  for (const Case& c : cases) {
    const fs::path path = dir / (c.name + ".safetensors");
    if (c.name == "truncated") {
      std::ofstream(path, std::ios::binary) << "abc";
    } else {
      write_raw(path, c.json, c.data, c.length);
    }
    const Result r = run_tool("plan " + path.string() + " --budget 12GiB");
    EXPECT_NE(r.exit_code, 0) << c.name;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << c.name << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.name << ": one line";
  }
  const Result missing =
      run_tool("plan " + (dir / "missing.safetensors").string() + " --budget 1G");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("cannot open"), std::string::npos) << missing.err;
}

void expect_default_run(const std::string& mode) {
  const Result r = run_tool("run --mode " + mode + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json out = json::parse(r.out);
  for (const char* key : {"mode", "blocks", "blocks_to_swap", "max_abs_diff"}) {
    EXPECT_TRUE(out.contains(key)) << key;
  }
  for (const char* key : {"step_seconds", "peak_device_bytes"}) {
    EXPECT_TRUE(out["baseline"].contains(key)) << key;
  }
  for (const char* key :
       {"step_seconds", "peak_device_bytes", "h2d_bytes", "d2h_bytes", "stall_seconds"}) {
    EXPECT_TRUE(out["swapped"].contains(key)) << key;
  }
  EXPECT_EQ(out["mode"], mode);
  EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
  EXPECT_LT(out["swapped"]["peak_device_bytes"].get<uint64_t>(),
            out["baseline"]["peak_device_bytes"].get<uint64_t>());
  EXPECT_GT(out["swapped"]["h2d_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(out["swapped"]["d2h_bytes"].get<uint64_t>(), 0u);
}

// `run --ranks R`: R processes train data-parallel (Gloo) on one host copy of the swapped
// weights; every rank's adapters equal the other ranks' and the same job's without blockswap.
const char* const kSmallRanksJob =
    "run --mode train --blocks 6 --swap 3 --hidden 128 --heads 4 --tokens 32 --steps 3 "
    "--timeout 30 --json";

// The processes still running with `text` in their environment.
std::size_t processes_with(const std::string& text) {
  std::size_t n = 0;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    std::ifstream in(entry.path() / "environ");
    const std::string environment{std::istreambuf_iterator<char>(in), {}};
    n += environment.find(text) != std::string::npos;
  }
  return n;
}

TEST(Ranks, EveryRankTrainsExactlyOnOneHostCopyOfTheSwappedWeights) {
  for (int ranks : {1, 2, 3}) {
    const Result r = run_tool(std::string(kSmallRanksJob) + " --ranks " + std::to_string(ranks));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const json out = json::parse(r.out);
    EXPECT_EQ(out["mode"], "train");
    EXPECT_EQ(out["ranks"].get<int>(), ranks);
    EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
    const uint64_t copy = out["swapped_weight_bytes"];
    ASSERT_GT(copy, 0u);
    ASSERT_EQ(out["rank_stats"].size(), std::size_t(ranks));
    uint64_t private_sum = 0;
    for (const auto& rank : out["rank_stats"]) {
      EXPECT_EQ(rank["max_abs_diff"].get<double>(), 0.0);      // against no swapping
      EXPECT_EQ(rank["max_diff_to_rank0"].get<double>(), 0.0); // against rank 0
      EXPECT_GT(rank["h2d_bytes"].get<uint64_t>(), 0u);
      private_sum += rank["private_host_bytes"].get<uint64_t>();
      if (ranks > 1) {
        EXPECT_GE(rank["shared_host_bytes"].get<uint64_t>(), copy);
      }
      // Each rank's share of the node's one copy.
      EXPECT_NEAR(double(rank["proportional_host_bytes"]), double(copy) / ranks, 64 * 1024.0);
    }
    if (ranks == 1) {
      EXPECT_GE(private_sum, copy); // one rank holds its copy alone
    } else {
      EXPECT_LT(double(private_sum), 0.1 * double(copy)) << ranks << " ranks";
    }
  }
}

// --compress on: the node's one copy holds the frozen weights compressed (float32 random
// weights: a little smaller), every rank maps fewer bytes and trains exactly.
TEST(Ranks, ACompressedCopyIsSharedAndExact) {
  const Result r = run_tool(std::string(kSmallRanksJob) + " --ranks 2 --compress on");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json out = json::parse(r.out);
  EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
  const uint64_t copy = out["swapped_weight_bytes"];
  for (const auto& rank : out["rank_stats"]) {
    EXPECT_EQ(rank["max_abs_diff"].get<double>(), 0.0);
    EXPECT_EQ(rank["max_diff_to_rank0"].get<double>(), 0.0);
    EXPECT_GT(rank["compression_ratio"].get<double>(), 1.05);
    EXPECT_LT(rank["shared_host_bytes"].get<uint64_t>(), copy);
    EXPECT_NEAR(double(rank["proportional_host_bytes"]),
                double(copy) / rank["compression_ratio"].get<double>() / 2, 64 * 1024.0);
  }
}

// A rank killed in the middle of a step: the others fail with a clear error well within the
// timeout, instead of hanging, and nothing of the job is left: no process, no file, no segment.
// --nodes: the ranks as nodes of this machine, each node one host copy shared by its ranks (as
// separate machines would hold; python/tests/test_multinode.py runs real hosts in namespaces).
TEST(Ranks, TwoNodesHoldOneCopyEachAndTrainExactly) {
  const Result r = run_tool(std::string(kSmallRanksJob) + " --ranks 4 --nodes 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json out = json::parse(r.out);
  EXPECT_EQ(out["nodes"].get<int>(), 2);
  EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
  const uint64_t copy = out["swapped_weight_bytes"];
  ASSERT_EQ(out["node_host_bytes"].size(), 2u);
  for (const auto& node : out["node_host_bytes"]) {
    EXPECT_NEAR(double(node.get<uint64_t>()), double(copy), 128 * 1024.0) << out.dump();
  }
  for (const auto& rank : out["rank_stats"]) {
    EXPECT_EQ(rank["node"].get<int>(), rank["rank"].get<int>() / 2);
    EXPECT_EQ(rank["max_diff_to_rank0"].get<double>(), 0.0);
    EXPECT_NEAR(double(rank["proportional_host_bytes"]), double(copy) / 2, 64 * 1024.0);
  }
  const Result uneven = run_tool(std::string(kSmallRanksJob) + " --ranks 4 --nodes 3");
  EXPECT_EQ(uneven.exit_code, 1);
  EXPECT_NE(uneven.err.find("--nodes 3 does not divide --ranks 4"), std::string::npos)
      << uneven.err;
  const Result alone = run_tool("run --mode train --nodes 2");
  EXPECT_EQ(alone.exit_code, 1);
  EXPECT_NE(alone.err.find("give --ranks too"), std::string::npos) << alone.err;
}

TEST(Ranks, AKilledRankMakesTheOthersFailAndLeavesNothing) {
  const fs::path tmp = scratch() / "killed"; // the launcher makes the job's directory in TMPDIR
  fs::create_directories(tmp);
  const auto shm_entries = [] {
    std::size_t n = 0;
    for (const auto& e : fs::directory_iterator("/dev/shm")) {
      n += e.path().filename().string().find("blockswap") != std::string::npos;
    }
    return n;
  };
  const std::size_t shm_before = shm_entries();
  const auto start = std::chrono::steady_clock::now();
  const Result r = run_tool("run --mode train --blocks 6 --swap 3 --hidden 128 --heads 4 "
                            "--tokens 32 --steps 3 --ranks 3 --kill-rank 1 --timeout 30",
                            "TMPDIR=" + tmp.string());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("rank 1 was killed by signal 9"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 0 failed"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 2 failed"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("another rank has ended or failed"), std::string::npos) << r.err;
  EXPECT_LT(seconds, 30.0); // the others saw it at once, not at the timeout
  EXPECT_EQ(processes_with("BLOCKSWAP_JOB_DIR=" + tmp.string()), 0u);
  EXPECT_TRUE(fs::is_empty(tmp));
  EXPECT_EQ(shm_entries(), shm_before);
}

// Two jobs on one node at once, each with its own store: neither maps the other's memory (each
// rank's share of its job's copy is half of it, not a quarter), both exact.
TEST(Ranks, EveryRankOffloadsItsOwnActivationsExactly) {
  const Result r = run_tool("run --mode train --ranks 2 --blocks 4 --swap 1 --hidden 64 --heads 2 "
                            "--tokens 256 --steps 2 --offload-activations --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json out = json::parse(r.out);
  EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
  ASSERT_EQ(out["rank_stats"].size(), 2u) << r.out;
  for (const json& rank : out["rank_stats"]) {
    EXPECT_EQ(rank["max_abs_diff"].get<double>(), 0.0) << rank.dump();
    EXPECT_LT(rank["peak_activation_bytes"].get<uint64_t>(),
              rank["baseline_peak_activation_bytes"].get<uint64_t>())
        << rank.dump();
  }
}

TEST(Ranks, TwoJobsAtOnceKeepTheirOwnCopies) {
  Started a = start_tool(std::string(kSmallRanksJob) + " --ranks 2", "", "job_a");
  Started b = start_tool("run --mode train --blocks 4 --swap 2 --hidden 64 --heads 4 --tokens 32 "
                         "--steps 3 --timeout 30 --json --ranks 2",
                         "", "job_b");
  for (const Result& r : {finish(a), finish(b)}) {
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const json out = json::parse(r.out);
    EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
    const double copy = out["swapped_weight_bytes"];
    for (const auto& rank : out["rank_stats"]) {
      EXPECT_NEAR(double(rank["proportional_host_bytes"]), copy / 2, 64 * 1024.0);
    }
  }
}

TEST(Ranks, BadCombinationsAreOneLineErrors) {
  for (const auto& [args, words] : std::vector<std::pair<std::string, std::string>>{
           {"run --mode infer --ranks 2", "--mode train"},
           {"run --mode train --ranks 2 --kill-rank 2", "--kill-rank 2 is not a rank"},
           {"run --mode train --ranks 2 --hidden 100", "not divisible"},
           {"run --mode train --ranks 0", "--ranks"}}) {
    const Result r = run_tool(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_NE(r.err.find(words), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
  }
}

TEST(Run, DefaultInferenceIsExact) {
  expect_default_run("infer");
}
TEST(Run, DefaultTrainingIsExact) {
  expect_default_run("train");
}

// Full fine-tuning: every block weight trains with the fused AdamW step; the weights after the
// last step equal those of LibTorch's AdamW without swapping, and changed blocks go back.
TEST(Run, FineTuneIsExactAndWritesChangedBlocksBack) {
  const Result r = run_tool(
      "run --mode finetune --step-on device --blocks 6 --swap 2 --hidden 64 --heads 2 --tokens 16 "
      "--steps 3 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json out = json::parse(r.out);
  EXPECT_EQ(out["mode"], "finetune");
  EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
  EXPECT_EQ(out["blocks_to_swap"], 2);
  const uint64_t h2d = out["swapped"]["h2d_bytes"].get<uint64_t>();
  const uint64_t d2h = out["swapped"]["d2h_bytes"].get<uint64_t>();
  EXPECT_GT(h2d, 0u);
  // Per step: 2K = 4 loads of whole blocks, 2K = 4 write-backs of their (all trainable) bytes.
  EXPECT_EQ(d2h, h2d);
  EXPECT_LT(out["swapped"]["peak_device_bytes"].get<uint64_t>(),
            out["baseline"]["peak_device_bytes"].get<uint64_t>());
  const Result table = run_tool("run --mode finetune --blocks 4 --hidden 64 --heads 2 --tokens 16");
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("full fine-tuning"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("(identical)"), std::string::npos) << table.out;
}

// --offload-activations: exact, and the device holds about two blocks' saved activations at
// their peak, whatever the number of blocks.
TEST(Run, OffloadActivationsIsExactAndKeepsAboutTwoBlocksOnTheDevice) {
  for (const std::string mode : {"train", "finetune"}) {
    for (const int blocks : {4, 8}) {
      const Result r = run_tool("run --mode " + mode + " --blocks " + std::to_string(blocks) +
                                " --swap 1 --hidden 64 --heads 2 --tokens 256 --steps 2 "
                                "--offload-activations --json");
      ASSERT_EQ(r.exit_code, 0) << r.err;
      const json out = json::parse(r.out);
      EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0) << mode << " " << blocks;
      const double kept = out["baseline"]["peak_activation_bytes"].get<double>();
      const double offloaded = out["swapped"]["peak_activation_bytes"].get<double>();
      EXPECT_GT(out["swapped"]["activation_offloaded_bytes"].get<uint64_t>(), 0u);
      EXPECT_EQ(out["swapped"]["activation_restored_bytes"],
                out["swapped"]["activation_offloaded_bytes"]);
      EXPECT_LE(offloaded, 2.5 * kept / blocks) << mode << " " << blocks << ": " << r.out;
    }
  }
  const Result table = run_tool(
      "run --mode train --blocks 4 --hidden 64 --heads 2 --tokens 256 --offload-activations");
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("saved activations on the device at their peak"), std::string::npos)
      << table.out;
  const Result stray = run_tool("run --mode train --blocks 4 --activation-threshold 0");
  EXPECT_NE(stray.exit_code, 0);
  EXPECT_NE(stray.err.find("applies to --offload-activations"), std::string::npos) << stray.err;
  const Result infer = run_tool("run --mode infer --blocks 4 --offload-activations");
  EXPECT_NE(infer.exit_code, 0);
  EXPECT_NE(infer.err.find("--offload-activations applies to --mode train"), std::string::npos)
      << infer.err;
}

// --compress on with --dtype bfloat16: exact, the frozen weights compressed by about 1.5 (the
// reference transformer's init), the host memory and link bytes saved reported; off reports 1.
TEST(Run, CompressIsExactAndReportsTheRatioAndTheBytesSaved) {
  for (const std::string mode : {"infer", "train"}) {
    const Result r = run_tool("run --mode " + mode +
                              " --device cpu --blocks 4 --swap 2 --hidden 64 --heads 2 --tokens 16 "
                              "--steps 2 --dtype bfloat16 --compress on --json");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const json out = json::parse(r.out);
    EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0) << mode;
    EXPECT_EQ(out["dtype"], "bfloat16");
    EXPECT_GT(out["swapped"]["compression_ratio"].get<double>(), 1.3) << mode;
    EXPECT_EQ(out["swapped"]["compressed_blocks"], 4);
    EXPECT_GT(out["swapped"]["host_bytes_saved"].get<uint64_t>(), 0u);
    EXPECT_GT(out["swapped"]["link_bytes_saved"].get<uint64_t>(), 0u);
    EXPECT_EQ(out["swapped"]["compression"], "on");
  }
  const Result off = run_tool("run --device cpu --blocks 4 --hidden 64 --heads 2 --tokens 16 "
                              "--steps 1 --json");
  ASSERT_EQ(off.exit_code, 0) << off.err;
  EXPECT_EQ(json::parse(off.out)["swapped"]["compression_ratio"].get<double>(), 1.0);
  EXPECT_EQ(json::parse(off.out)["swapped"]["compression"], "off");
  // auto, with host memory to spare and no step time known: off, and says why (Note [automatic
  // compression]).
  const Result automatic =
      run_tool("run --device cpu --blocks 4 --hidden 64 --heads 2 "
               "--tokens 16 --steps 1 --dtype bfloat16 --compress auto --json");
  ASSERT_EQ(automatic.exit_code, 0) << automatic.err;
  const json chosen = json::parse(automatic.out)["swapped"];
  EXPECT_EQ(chosen["compression"], "off");
  EXPECT_NE(chosen["compression_reason"].get<std::string>().find("host memory suffices"),
            std::string::npos)
      << chosen;
  EXPECT_NE(automatic.err.find("compression off: compress='auto'"), std::string::npos)
      << automatic.err;
  const Result bad = run_tool("run --compress yes");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--compress"), std::string::npos) << bad.err;
  const Result finetune = run_tool("run --mode finetune --dtype bfloat16 --blocks 2");
  EXPECT_NE(finetune.exit_code, 0);
  EXPECT_NE(finetune.err.find("--dtype bfloat16"), std::string::npos) << finetune.err;
}

TEST(Run, TableWithoutArguments) {
  const Result r = run_tool("run --blocks 4 --hidden 64 --heads 2 --tokens 16");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("with blockswap"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("largest difference between the two results: 0 (identical)"),
            std::string::npos)
      << r.out;
}

TEST(Run, TraceHasComputeAndCopyTracks) {
  const fs::path trace = scratch() / "trace.json";
  const Result r =
      run_tool("run --mode train --blocks 4 --hidden 64 --heads 2 --tokens 16 --trace " +
               trace.string() + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream in(trace);
  const json events = json::parse(in)["traceEvents"];
  int compute = 0, copy = 0;
  for (const json& e : events) {
    if (e["ph"] != "X") continue;
    (e["tid"] == 1 ? compute : copy) += 1;
  }
  EXPECT_GE(compute, 4 * 4); // 4 blocks forward, 4 steps
  EXPECT_GE(copy, 4 * 4);    // 2K = 4 loads per step
}

void expect_one_line_error(const Result& r, const std::vector<std::string>& parts,
                           const std::string& what);

TEST(Run, WeightsRoundTripThroughSafetensors) {
  const fs::path weights = scratch() / "reference.safetensors";
  const std::string size = " --blocks 3 --hidden 64 --heads 2 --tokens 8 --json";
  const Result saved = run_tool("run --mode train" + size + " --save-weights " + weights.string());
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  const Result loaded =
      run_tool("run --mode train --tokens 8 --json --weights " + weights.string());
  ASSERT_EQ(loaded.exit_code, 0) << loaded.err;
  const json out = json::parse(loaded.out);
  EXPECT_EQ(out["blocks"], 3);
  EXPECT_EQ(out["hidden"], 64);
  EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
  // The file says the shape: a given --blocks, --hidden or --heads agrees with it or is refused.
  const Result agreeing = run_tool("run --mode train" + size + " --weights " + weights.string());
  ASSERT_EQ(agreeing.exit_code, 0) << agreeing.err;
  for (const auto& [option, in_file] : {std::pair{"--blocks 4", "which has 3 blocks"},
                                        {"--hidden 128", "which has 64 as its hidden size"},
                                        {"--heads 4", "which has 2 attention heads"}}) {
    const Result r =
        run_tool(std::string("run --tokens 8 ") + option + " --weights " + weights.string());
    expect_one_line_error(r, {option, "disagrees with --weights", in_file}, option);
  }
}

// The file tier: the swapped blocks beyond --host-budget are read from --weights for each load,
// the model is built without its frozen weights, and the result is the loaded model's, bitwise.
TEST(Run, HostBudgetReadsTheBlocksBeyondItFromTheFile) {
  const fs::path weights = scratch() / "tiers.safetensors";
  const Result saved =
      run_tool("run --blocks 4 --hidden 64 --heads 2 --tokens 8 --steps 1 --json --save-weights " +
               weights.string());
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  for (const std::string mode : {"infer", "train"}) {
    for (const auto& [budget, in_file] : {std::pair{"0", 4}, {"1GiB", 0}}) {
      const Result r = run_tool("run --mode " + mode + " --swap 2 --tokens 8 --steps 2 --json " +
                                "--host-budget " + budget + " --weights " + weights.string());
      ASSERT_EQ(r.exit_code, 0) << r.err;
      const json out = json::parse(r.out);
      EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0) << mode << " " << budget;
      EXPECT_EQ(out["swapped"]["blocks_in_file"], in_file) << mode << " " << budget;
      EXPECT_EQ(out["swapped"]["disk_read_bytes"].get<uint64_t>() > 0, in_file > 0);
      EXPECT_EQ(out["swapped"]["disk_read_bytes"],
                in_file > 0 ? out["swapped"]["h2d_bytes"] : json(0));
      EXPECT_GT(out["swapped"]["peak_rss_bytes"].get<uint64_t>(), 0u);
    }
  }
  expect_one_line_error(run_tool("run --host-budget 0 --blocks 4 --hidden 64 --heads 2"),
                        {"--host-budget needs --weights"}, "no file");
  expect_one_line_error(
      run_tool("run --mode finetune --host-budget 0 --weights " + weights.string()),
      {"--host-budget with --mode finetune"}, "fine-tuning");
  expect_one_line_error(run_tool("run --host-budget 12Q --weights " + weights.string()), {"12Q"},
                        "size");
}

// Where pinning is capped (--pinnable-bytes on the emulated device), the loads are staged from
// pageable memory, and every mode stays bitwise the model without blockswap.
TEST(Run, PinnableBytesStagesTheLoadsFromPageableMemoryExactly) {
  for (const std::string mode : {"infer", "train", "finetune"}) {
    for (const std::string pinnable : {"0", "64KiB"}) {
      const Result r =
          run_tool("run --mode " + mode + " --blocks 4 --hidden 64 --heads 2 " +
                   "--swap 2 --tokens 8 --steps 2 --json --pinnable-bytes " + pinnable);
      ASSERT_EQ(r.exit_code, 0) << r.err;
      const json out = json::parse(r.out);
      EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0) << mode << " " << pinnable;
      EXPECT_GT(out["swapped"]["staged_bytes"].get<uint64_t>(), 0u) << mode << " " << pinnable;
      EXPECT_NE(r.err.find("are pageable"), std::string::npos) << r.err;
    }
  }
  const Result pinned = run_tool("run --blocks 4 --hidden 64 --heads 2 --swap 2 --tokens 8 "
                                 "--steps 1 --json");
  ASSERT_EQ(pinned.exit_code, 0) << pinned.err;
  EXPECT_EQ(json::parse(pinned.out)["swapped"]["staged_bytes"], 0);
  expect_one_line_error(run_tool("run --pinnable-bytes 12Q"), {"12Q"}, "size");
  expect_one_line_error(run_tool("run --pinnable-bytes ''"), {"--pinnable-bytes needs a size"},
                        "empty");
}

// A failure as the tool reports every one: a non-zero exit and one line, "blockswap: error: …",
// that contains each of `parts`.
void expect_one_line_error(const Result& r, const std::vector<std::string>& parts,
                           const std::string& what) {
  EXPECT_NE(r.exit_code, 0) << what;
  EXPECT_EQ(r.err.rfind("blockswap: error: ", 0), 0u) << what << ": " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << what << ": one line: " << r.err;
  for (const std::string& part : parts) {
    EXPECT_NE(r.err.find(part), std::string::npos) << what << ": '" << part << "' in " << r.err;
  }
}

// A model small enough that a run takes well under a second.
const std::string kSmall = " --blocks 4 --hidden 64 --heads 2 --tokens 8 --steps 1";

TEST(Arguments, BadArgumentsAreOneLineErrors) {
  expect_one_line_error(
      run_tool("run --blocks 4 --swap 4 --hidden 64 --heads 2"),
      {"--swap 4 is out of range for --blocks 4 in infer mode", "expected 0 <= --swap <= 3"},
      "K = N");
  expect_one_line_error(run_tool("run --mode fly"), {"--mode must be infer, train or finetune"},
                        "mode");
  expect_one_line_error(run_tool("run --blocks 4 --hidden 64 --heads 6"),
                        {"--hidden 64 is not divisible by --heads 6"}, "heads");
  expect_one_line_error(run_tool("run --no-such-option"), {"--no-such-option"}, "unknown option");
  // Sizes this machine cannot hold fail at once, with the sizes, not in the operating system's
  // out-of-memory killer.
  expect_one_line_error(run_tool("run --blocks 4096 --hidden 65536 --heads 64"),
                        {"--blocks 4096 --hidden 65536", "of host memory"}, "memory");
}

// Defect 10: every numeric option, malformed or out of range, is named in a one-line error.
TEST(Arguments, MalformedNumbersNameTheOption) {
  // Each option with one malformed value and one out of range (a tool run costs about a second
  // of LibTorch start-up, so the kinds of value take turns across the options).
  const std::vector<std::string> options{"--blocks", "--hidden",  "--heads",    "--tokens",
                                         "--steps",  "--threads", "--lora-rank"};
  const std::vector<std::string> malformed{"abc", "1.5", "4x", "", "0x10"};
  const std::vector<std::string> out_of_range{"0", "-3", "99999999999999999999"};
  for (std::size_t i = 0; i < options.size(); ++i) {
    for (const std::string& value :
         {malformed[i % malformed.size()], out_of_range[i % out_of_range.size()]}) {
      const Result r = run_tool("run" + kSmall + " " + options[i] + " '" + value + "'");
      expect_one_line_error(r, {options[i] + ": '" + value + "'"}, options[i] + " " + value);
    }
  }
  expect_one_line_error(run_tool("run" + kSmall + " --blocks 5000"),
                        {"--blocks: '5000' is out of range: expected 1 to 4096"}, "--blocks 5000");
  expect_one_line_error(run_tool("bench --blocks 2"),
                        {"--blocks: '2' is out of range: expected 3 to 4096"}, "bench --blocks");
  expect_one_line_error(run_tool("bench --hidden 200"), {"--hidden 200", "heads"},
                        "bench --hidden");
  expect_one_line_error(run_tool("bench --steps 0"), {"--steps: '0'"}, "bench --steps");
  expect_one_line_error(run_tool("bench --tokens x"), {"--tokens: 'x'"}, "bench --tokens");
}

// Defect 3: only the devices blockswap runs on, never LibTorch's message for the others.
TEST(Arguments, UnsupportedDeviceIsOneLineError) {
  for (const std::string device : {"meta", "xla", "cuda:x", "cpu:0", "CPU", ""}) {
    const Result r = run_tool("run" + kSmall + " --device '" + device + "'");
    expect_one_line_error(r, {"--device: '" + device + "'", "expected cpu", "cuda"}, device);
  }
}

// Defect 5: --swap outside 0 <= K <= max is an error naming --swap and the range.
TEST(Arguments, SwapOutOfRangeNamesTheRange) {
  expect_one_line_error(
      run_tool("run --swap -5" + kSmall),
      {"--swap -5 is out of range for --blocks 4 in infer mode", "expected 0 <= --swap <= 3"},
      "negative");
  expect_one_line_error(run_tool("run --mode train --swap 4" + kSmall),
                        {"--swap 4 is out of range for --blocks 4 in train mode",
                         "expected 0 <= --swap <= 3", "needs at least 5 blocks"},
                        "train K = N");
  expect_one_line_error(run_tool("run --swap two" + kSmall), {"--swap: 'two'"}, "not a number");
  const Result ok = run_tool("run --mode train --swap 3 --json" + kSmall); // N-1: one slot
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(json::parse(ok.out)["blocks_to_swap"], 3);
  EXPECT_EQ(json::parse(ok.out)["max_abs_diff"].get<double>(), 0.0);
}

// The step on the host: as exact; the optimizer's state never moves, so fewer bytes load and
// the device holds less than with the step on the device.
TEST(Run, FineTuneWithTheStepOnTheHostIsExactAndMovesNoState) {
  const std::string common =
      "run --mode finetune --blocks 6 --swap 2 --hidden 64 --heads 2 --tokens 16 --steps 3 --json";
  const Result host = run_tool(common + " --step-on host");
  const Result device = run_tool(common + " --step-on device");
  ASSERT_EQ(host.exit_code, 0) << host.err;
  ASSERT_EQ(device.exit_code, 0) << device.err;
  const json h = json::parse(host.out), d = json::parse(device.out);
  EXPECT_EQ(h["max_abs_diff"].get<double>(), 0.0);
  EXPECT_EQ(d["max_abs_diff"].get<double>(), 0.0);
  // Device: 2K loads of weights and two moments. Host: 2K loads of weights, and the N - K
  // resident blocks' new weights once per step; gradients of all N blocks go out.
  EXPECT_LT(h["swapped"]["h2d_bytes"].get<uint64_t>(), d["swapped"]["h2d_bytes"].get<uint64_t>());
  EXPECT_GT(h["swapped"]["d2h_bytes"].get<uint64_t>(), 0u);
  EXPECT_LT(h["swapped"]["peak_device_bytes"].get<uint64_t>(),
            d["swapped"]["peak_device_bytes"].get<uint64_t>());
  const Result table = run_tool("run --mode finetune --step-on host --blocks 4 --hidden 64 "
                                "--heads 2 --tokens 16");
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("fused step on the host"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("(identical)"), std::string::npos) << table.out;
  expect_one_line_error(run_tool("run --mode finetune --step-on moon"),
                        {"--step-on must be auto, device or host, got 'moon'"}, "step-on");
  expect_one_line_error(run_tool("run --mode train --step-on host"),
                        {"--step-on applies to --mode finetune only"}, "step-on without finetune");
}

// Defect 6: the default K (half the blocks) is clamped to what the mode allows.
TEST(Run, DefaultSwapIsClampedToTheValidRange) {
  struct Case {
    std::string mode;
    int blocks, expected_k;
  };
  for (const Case& c :
       {Case{"train", 2, 1}, Case{"train", 3, 1}, Case{"infer", 1, 0}, Case{"train", 8, 4}}) {
    const Result r = run_tool("run --mode " + c.mode + " --blocks " + std::to_string(c.blocks) +
                              " --hidden 64 --heads 2 --tokens 8 --steps 1 --json");
    ASSERT_EQ(r.exit_code, 0) << c.mode << " " << c.blocks << ": " << r.err;
    const json out = json::parse(r.out);
    EXPECT_EQ(out["blocks_to_swap"], c.expected_k) << c.mode << " " << c.blocks;
    EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0) << c.mode << " " << c.blocks;
  }
  // Asking for more than the blocks allow says how many blocks it needs.
  expect_one_line_error(
      run_tool("run --mode train --blocks 2 --swap 2 --hidden 64 --heads 2 --tokens 8"),
      {"--swap 2 is out of range for --blocks 2 in train mode", "needs at least 3 blocks"},
      "train N=2 K=2");
}

// Defect 7: a bandwidth that would never finish, or would overflow the throttle, is refused.
TEST(Arguments, LinkBandwidthMustBeSane) {
  for (const std::string gbps :
       {"1e-12", "1e-300", "0.0009", "-1", "nan", "inf", "1e999", "fast"}) {
    const Result r = run_tool("run" + kSmall + " --device cpu --link-gbps " + gbps);
    expect_one_line_error(r, {"--link-gbps: '" + gbps + "'", "0 (unlimited)", "0.001 GB/s"}, gbps);
  }
  for (const std::string gbps : {"0", "0.5", "1e300"}) { // 0 = unlimited
    const Result r = run_tool("run" + kSmall + " --device cpu --json --link-gbps " + gbps);
    ASSERT_EQ(r.exit_code, 0) << gbps << ": " << r.err;
    EXPECT_EQ(json::parse(r.out)["max_abs_diff"].get<double>(), 0.0) << gbps;
  }
  expect_one_line_error(run_tool("bench --link-gbps 1e-12"), {"--link-gbps: '1e-12'"}, "bench");
}

// Defect 8: an output file that cannot be written fails before the work, not after it.
TEST(Arguments, UnwritableTraceFailsBeforeTheRun) {
  const fs::path missing_dir = scratch() / "no-such-dir" / "trace.json";
  // 100000 steps of the default model would take hours: the error must come at once.
  const auto start = std::chrono::steady_clock::now();
  const Result r = run_tool("run --steps 100000 --trace " + missing_dir.string());
  const double seconds = seconds_since(start);
  expect_one_line_error(r, {"--trace " + missing_dir.string(), "cannot open for writing"},
                        "missing directory");
  EXPECT_LT(seconds, 30.0);
  expect_one_line_error(run_tool("run --steps 100000 --trace " + scratch().string()),
                        {"--trace " + scratch().string(), "cannot open for writing"},
                        "a directory");
  expect_one_line_error(run_tool("bench --csv " + missing_dir.string()),
                        {"--csv " + missing_dir.string()}, "bench --csv");
  expect_one_line_error(run_tool("bench --plot " + missing_dir.string()),
                        {"--plot " + missing_dir.string()}, "bench --plot");
  // A writable path is left as it was when the run fails for another reason.
  const fs::path fresh = scratch() / "fresh-trace.json";
  expect_one_line_error(run_tool("run --blocks 0 --trace " + fresh.string()), {"--blocks"},
                        "other error");
  EXPECT_FALSE(fs::exists(fresh));
}

// The tensors of a reference transformer's safetensors file (models/reference_transformer.hpp).
std::vector<Tensor> reference_tensors(int blocks, int64_t h, int64_t rank = 0) {
  std::vector<Tensor> t;
  for (int i = 0; i < blocks; ++i) {
    const std::string p = "blocks." + std::to_string(i) + ".";
    for (const std::string norm : {"norm1", "norm2"}) {
      t.push_back({p + norm + ".weight", {h}});
      t.push_back({p + norm + ".bias", {h}});
    }
    for (const auto& [name, out, in] : {std::tuple{"qkv", 3 * h, h}, std::tuple{"proj", h, h},
                                        std::tuple{"fc1", 4 * h, h}, std::tuple{"fc2", h, 4 * h}}) {
      linear(t, p + name, out, in);
      if (rank > 0) {
        t.push_back({p + name + ".lora_a", {rank, in}});
        t.push_back({p + name + ".lora_b", {out, rank}});
      }
    }
  }
  return t;
}

Result run_weights(const fs::path& path, const std::vector<Tensor>& tensors,
                   const json& metadata = {{"heads", "2"}}, const std::string& dtype = "F32") {
  write_sparse_model(path, tensors, dtype, dtype == "F32" ? 4 : 2, metadata);
  return run_tool("run --tokens 8 --steps 1 --json --weights " + path.string());
}

std::vector<Tensor> renamed(std::vector<Tensor> tensors, const std::string& from,
                            const std::string& to) {
  for (Tensor& t : tensors) {
    if (t.name.rfind(from, 0) == 0) t.name = to + t.name.substr(from.size());
  }
  return tensors;
}

// Defect 1: a block index or `heads` value that is not a number names the tensor or the key.
TEST(Weights, MalformedIndexAndHeadsAreOneLineErrors) {
  const fs::path path = scratch() / "malformed.safetensors";
  const auto good = reference_tensors(2, 16);
  ASSERT_EQ(run_weights(path, good).exit_code, 0) << "the well-formed file runs";
  for (const std::string index : {"x1", "-1", "01", "", "99999999999999999999"}) {
    const std::string name = "blocks." + index + ".norm1.weight";
    expect_one_line_error(
        run_weights(path, renamed(good, "blocks.1.", "blocks." + index + ".")),
        {path.string(), "tensor '" + name + "'", "malformed block index '" + index + "'"}, index);
  }
  expect_one_line_error(run_weights(path, renamed(good, "blocks.1.", "blocks.1")),
                        {"malformed block index"}, "no dot");
  for (const std::string heads : {"two", "-2", "2.0", "99999999999999999999"}) {
    expect_one_line_error(
        run_weights(path, good, {{"heads", heads}}),
        {path.string(), "metadata 'heads' is '" + heads + "'", "expected a positive integer"},
        "heads " + heads);
  }
  expect_one_line_error(run_weights(path, good, {{"heads", "3"}}),
                        {"metadata 'heads' is 3, which does not divide the hidden size 16"},
                        "heads 3");
}

// Defect 2: every tensor's name, shape and dtype is checked against the model before any is used.
TEST(Weights, EveryTensorIsCheckedBeforeUse) {
  const fs::path path = scratch() / "checked.safetensors";
  const auto good = reference_tensors(3, 16);
  struct Case {
    std::string what;
    std::vector<Tensor> tensors;
    std::vector<std::string> parts;
  };
  std::vector<Case> cases;
  auto with = [&](const std::string& name, std::vector<int64_t> shape) {
    auto t = good;
    for (Tensor& x : t) {
      if (x.name == name) x.shape = std::move(shape);
    }
    return t;
  };
  cases.push_back({"scalar norm of block 0",
                   with("blocks.0.norm1.weight", {}),
                   {"tensor 'blocks.0.norm1.weight' has shape []", "expected [hidden]"}});
  cases.push_back(
      {"scalar norm of block 2",
       with("blocks.2.norm2.weight", {}),
       {"tensor 'blocks.2.norm2.weight' is F32 of shape []", "expected F32 of shape [16]"}});
  cases.push_back({"matrix norm",
                   with("blocks.0.norm1.weight", {16, 16}),
                   {"tensor 'blocks.0.norm1.weight' has shape [16, 16]"}});
  cases.push_back({"wrong linear",
                   with("blocks.1.fc2.weight", {16, 16}),
                   {"tensor 'blocks.1.fc2.weight' is F32 of shape [16, 16]",
                    "expected F32 of shape [16, 64]"}});
  cases.push_back({"wrong bias",
                   with("blocks.2.qkv.bias", {16}),
                   {"tensor 'blocks.2.qkv.bias' is F32 of shape [16]", "[48]"}});
  {
    auto t = good;
    t.pop_back();
    cases.push_back({"missing", t, {"tensor 'blocks.2.fc2.bias' is missing"}});
  }
  {
    auto t = good;
    t.push_back({"blocks.1.extra.weight", {16}});
    cases.push_back({"unexpected", t, {"unexpected tensor 'blocks.1.extra.weight'"}});
  }
  {
    auto t = good;
    t.push_back({"blocks.1.qkv.lora_a", {4, 16}});
    cases.push_back({"stray adapter", t, {"unexpected tensor 'blocks.1.qkv.lora_a'"}});
  }
  {
    auto t = good;
    t.push_back({"head.weight", {16}});
    cases.push_back({"outside blocks", t, {"tensor 'head.weight' is not a reference"}});
  }
  cases.push_back({"gap",
                   renamed(good, "blocks.1.", "blocks.7."),
                   {"block indices must run from 0 without gaps"}});
  cases.push_back({"huge index",
                   renamed(good, "blocks.2.", "blocks.999999999999."),
                   {"block indices must run from 0 without gaps"}});
  cases.push_back({"no hidden",
                   renamed(good, "blocks.0.", "blocks.3."),
                   {"tensor 'blocks.0.norm1.weight' is missing"}});
  cases.push_back({"empty", {}, {"tensor 'blocks.0.norm1.weight' is missing"}});
  {
    auto t = reference_tensors(2, 16, 4);
    for (Tensor& x : t) {
      if (x.name == "blocks.1.proj.lora_b") x.shape = {16, 5};
    }
    cases.push_back(
        {"adapter rank", t, {"tensor 'blocks.1.proj.lora_b' is F32 of shape [16, 5]", "[16, 4]"}});
  }
  for (const Case& c : cases) {
    std::vector<std::string> parts = c.parts;
    parts.push_back(path.string());
    expect_one_line_error(run_weights(path, c.tensors), parts, c.what);
  }
  expect_one_line_error(run_weights(path, good, {{"heads", "2"}}, "F16"),
                        {"tensor 'blocks.0.norm1.weight' is F16", "expected F32"}, "dtype");
}

// Defect 9 (a use-after-free in ReferenceTransformer::load) shows under the address sanitizer
// (scripts/test --sanitize runs these tests on the sanitized tool): load every kind of file.
TEST(Weights, InferenceWeightsRoundTrip) {
  const fs::path weights = scratch() / "inference.safetensors";
  const Result saved = run_tool("run" + kSmall + " --json --save-weights " + weights.string());
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  const Result loaded = run_tool("run --tokens 8 --steps 1 --json --weights " + weights.string());
  ASSERT_EQ(loaded.exit_code, 0) << loaded.err;
  const json out = json::parse(loaded.out);
  EXPECT_EQ(out["blocks"], 4);
  EXPECT_EQ(out["hidden"], 64);
  EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
}

// Defect 4: training on weights without adapters adds fresh ones (of --lora-rank), as
// `run --help` says, rather than failing inside LibTorch.
TEST(Weights, TrainingOnWeightsWithoutAdaptersAddsThem) {
  const fs::path weights = scratch() / "no-adapters.safetensors";
  const Result saved = run_tool("run" + kSmall + " --json --save-weights " + weights.string());
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  for (const std::string rank : {"", " --lora-rank 3"}) {
    const Result trained = run_tool("run --mode train --tokens 8 --steps 2 --json --weights " +
                                    weights.string() + rank);
    ASSERT_EQ(trained.exit_code, 0) << rank << ": " << trained.err;
    const json out = json::parse(trained.out);
    EXPECT_EQ(out["mode"], "train");
    EXPECT_EQ(out["blocks"], 4);
    EXPECT_EQ(out["blocks_to_swap"], 2);
    EXPECT_EQ(out["max_abs_diff"].get<double>(), 0.0);
  }
}
// The timed device's table: every model shape, ratio and mode, the performance targets met, and
// the simulator's prediction within 2 % of every measurement.
TEST(Bench, TimedDeviceQuickMeetsTheTargets) {
  const Result r = run_tool("bench --device timed --quick --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json out = json::parse(r.out);
  std::set<std::string> models;
  std::set<double> ratios;
  for (const json& row : out["rows"]) {
    for (const char* key : {"device", "model", "copy_compute_ratio", "mode", "k", "t_noswap",
                            "t_swap", "t_seed", "t_bound"}) {
      ASSERT_TRUE(row.contains(key)) << key;
    }
    EXPECT_EQ(row["device"], "timed");
    models.insert(row["model"].get<std::string>());
    ratios.insert(row["copy_compute_ratio"].get<double>());
    EXPECT_GE(row["t_swap"].get<double>(), row["t_bound"].get<double>() * (1 - 1e-6)) << row;
    EXPECT_NEAR(row["t_swap"].get<double>() / row["t_predicted"].get<double>(), 1.0, 0.02) << row;
  }
  EXPECT_EQ(models, (std::set<std::string>{"reference", "flux", "wan14b"}));
  EXPECT_EQ(ratios.size(), 4u);
  // With one slot (K = N-1) the seed's lead is 1.5 exactly in theory (N(2l+c) against
  // N(l+c) at l = c): the host's own microseconds may put it a hair either side.
  for (const auto& [model, t] : out["timed"]["summary"].items()) {
    EXPECT_LE(t["infer_max_swap_over_bound"].get<double>(), 1.03) << model;
    EXPECT_GE(t["infer_min_seed_over_swap"].get<double>(), 1.49) << model;
    EXPECT_LE(t["train_max_swap_over_bound"].get<double>(), 1.02) << model;
    EXPECT_LT(t["max_prediction_error"].get<double>(), 0.02) << model;
  }
}

// The emulated sweep, small: every mode over its whole range of K, the device's peak as the
// plan says in every row, and the fine-tuning rows' bytes: with the step on the host the
// optimizer's state never loads, and the gradients of all N blocks go out at every K.
TEST(Bench, EmulatedSweepHasEveryModeAndTheBytesOfEach) {
  const Result r =
      run_tool("bench --device emulated --blocks 4 --hidden 64 --tokens 16 --steps 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json out = json::parse(r.out);
  std::map<std::string, std::map<int64_t, json>> rows;
  for (const json& row : out["rows"]) {
    EXPECT_EQ(row["device"], "emulated");
    EXPECT_EQ(row["peak_device_bytes"], row["planned_device_bytes"]) << row;
    rows[row["mode"].get<std::string>()][row["k"].get<int64_t>()] = row;
  }
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows["infer"].size(), 4u); // K = 0..N-1
  for (const char* mode : {"train", "finetune", "finetune-host"}) {
    EXPECT_EQ(rows[mode].size(), 3u) << mode; // K = 0..N-2, where the seed's replay runs too
  }
  const uint64_t gradients = rows["finetune-host"][0]["d2h_bytes"].get<uint64_t>();
  EXPECT_GT(gradients, 0u);
  EXPECT_EQ(rows["finetune"][0]["d2h_bytes"], 0); // nothing swaps, nothing goes back
  for (int64_t k = 1; k <= 2; ++k) {
    const json& host = rows["finetune-host"][k];
    const json& device = rows["finetune"][k];
    EXPECT_EQ(host["d2h_bytes"].get<uint64_t>(), gradients) << k;
    EXPECT_LT(host["h2d_bytes"].get<uint64_t>(), device["h2d_bytes"].get<uint64_t>()) << k;
    EXPECT_LT(host["peak_device_bytes"].get<uint64_t>(),
              device["peak_device_bytes"].get<uint64_t>())
        << k;
  }
  EXPECT_TRUE(out["emulated"]["summary"]["peak_device_bytes_as_planned"].get<bool>());
  EXPECT_GT(out["emulated"]["summary"]["finetune_host_over_device_median"].get<double>(), 0.0);
}

} // namespace
