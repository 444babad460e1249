// A module's tensor names against a checkpoint's (checkpoint.hpp): the same names (diffusers'
// own files), a known layout (the original Black Forest Labs FLUX layout, whose fused qkv and
// linear1 hold diffusers' to_q, to_k, to_v and proj_mlp as row slices), or a map the user gives.
// A row slice of a tensor is a contiguous run of its bytes, read where it lies in the file: no
// copy, no conversion. ComfyUI's "model.diffusion_model." before a name, and fp8 scales named
// "weight_scale" for "scale_weight" (or the other way), are found without being asked for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "blockswap/model_io/checkpoint.hpp"

namespace blockswap {

// Where a module's tensor is in a checkpoint: a tensor, or rows of its first dimension.
struct FileSlice {
  std::string name;
  // Rows [row_begin, row_end) of the file tensor: with `parts` 0 as they are (row_end -1: to the
  // last row); with `parts` > 0 in parts of the first dimension, rows [row_begin * R / parts,
  // row_end * R / parts) of its R (qkv's q: parts [0, 1) of 3). A 0-dimensional file tensor (a
  // fused layer's one fp8 scale) is taken whole by each of its parts.
  int64_t row_begin = 0, row_end = -1, parts = 0;
  // Not empty: the module's tensor is the file's after this transform, which is not a row slice
  // ("its shift and scale halves swapped"): refused, named.
  std::string transform = {};
};

// From a module's tensor name (`<prefix>N.<name>`) to where it is in the file; nothing: the map
// does not know the name.
using NameMap = std::function<std::optional<FileSlice>(const std::string& name)>;

enum class WeightsLayout {
  automatic, // the same names if every tensor is found so, else FLUX's if the file is in it
  diffusers, // the same names (ComfyUI's prefix still found)
  flux,      // diffusers' FluxTransformer2DModel over Black Forest Labs' original names
};
// "" and "auto", "diffusers", "flux"; throws Error naming the text otherwise.
WeightsLayout parse_weights_layout(std::string_view text);
std::string_view to_string(WeightsLayout layout);

// The map of a layout other than `automatic` (diffusers: the identity).
NameMap layout_map(WeightsLayout layout);
// The block lists' prefixes a layout's map knows ("transformer_blocks.",
// "single_transformer_blocks." for FLUX); none for the identity.
std::vector<std::string> layout_prefixes(WeightsLayout layout);
// Whether the checkpoint holds FLUX blocks in Black Forest Labs' names.
bool in_flux_layout(const Checkpoint& checkpoint);

// A module tensor's bytes in the checkpoint.
struct LocatedTensor {
  std::size_t file = 0; // Checkpoint::files
  uint64_t offset = 0;  // in that file
  uint64_t bytes = 0;
  std::string source; // the file's tensor, with its rows if a slice: "'a.qkv.weight' rows [0, 32)"
};
struct Located {
  std::optional<LocatedTensor> tensor;
  std::string why; // without a tensor: what was looked for and what did not fit
};

// Finds the module's tensor `name` of `dtype` (a safetensors dtype) and `shape` in `checkpoint`
// through `map` (null: the same name). Never throws for a tensor that is not there or does not
// fit: `why` says so ("has no tensor 'x' (looked for 'x', 'model.diffusion_model.x')", "has 'x'
// as BF16 [4, 8], but the module's tensor is F32 [4, 8]").
Located locate_tensor(const Checkpoint& checkpoint, const NameMap& map, const std::string& name,
                      std::string_view dtype, const std::vector<int64_t>& shape);

} // namespace blockswap
