#include "blockswap/model_io/name_map.hpp"

#include <array>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

constexpr std::string_view kComfyPrefix = "model.diffusion_model.";

// One diffusers name (a module path, "attn.to_q.": every tensor under it) and the BFL name it
// comes from, with the rows it takes: parts [begin, end) of `parts` (0: the whole tensor).
struct Rename {
  std::string_view diffusers, bfl;
  int64_t begin = 0, end = 0, parts = 0;
  std::string_view transform = {};
};

// What diffusers' single-file loader (convert_flux_transformer_checkpoint_to_diffusers) takes
// from each tensor of Black Forest Labs' FLUX: the double blocks' fused qkv gives to_q, to_k
// and to_v (add_*_proj from txt_attn) as thirds of its rows; the single blocks' linear1 gives
// to_q, to_k, to_v and proj_mlp as rows in the ratio 1:1:1:4 (mlp_ratio 4, as diffusers fixes
// it: a checkpoint with another ratio fails the shape check, named).
constexpr std::array kDouble{
    Rename{"norm1.linear.", "img_mod.lin."},
    Rename{"norm1_context.linear.", "txt_mod.lin."},
    Rename{"attn.to_q.", "img_attn.qkv.", 0, 1, 3},
    Rename{"attn.to_k.", "img_attn.qkv.", 1, 2, 3},
    Rename{"attn.to_v.", "img_attn.qkv.", 2, 3, 3},
    Rename{"attn.add_q_proj.", "txt_attn.qkv.", 0, 1, 3},
    Rename{"attn.add_k_proj.", "txt_attn.qkv.", 1, 2, 3},
    Rename{"attn.add_v_proj.", "txt_attn.qkv.", 2, 3, 3},
    Rename{"attn.norm_q.weight", "img_attn.norm.query_norm.scale"},
    Rename{"attn.norm_k.weight", "img_attn.norm.key_norm.scale"},
    Rename{"attn.norm_added_q.weight", "txt_attn.norm.query_norm.scale"},
    Rename{"attn.norm_added_k.weight", "txt_attn.norm.key_norm.scale"},
    Rename{"ff.net.0.proj.", "img_mlp.0."},
    Rename{"ff.net.2.", "img_mlp.2."},
    Rename{"ff_context.net.0.proj.", "txt_mlp.0."},
    Rename{"ff_context.net.2.", "txt_mlp.2."},
    Rename{"attn.to_out.0.", "img_attn.proj."},
    Rename{"attn.to_add_out.", "txt_attn.proj."},
};
constexpr std::array kSingle{
    Rename{"norm.linear.", "modulation.lin."},
    Rename{"attn.to_q.", "linear1.", 0, 1, 7},
    Rename{"attn.to_k.", "linear1.", 1, 2, 7},
    Rename{"attn.to_v.", "linear1.", 2, 3, 7},
    Rename{"proj_mlp.", "linear1.", 3, 7, 7},
    Rename{"attn.norm_q.weight", "norm.query_norm.scale"},
    Rename{"attn.norm_k.weight", "norm.key_norm.scale"},
    Rename{"proj_out.", "linear2."},
};
constexpr std::array kOutside{
    Rename{"time_text_embed.timestep_embedder.linear_1.", "time_in.in_layer."},
    Rename{"time_text_embed.timestep_embedder.linear_2.", "time_in.out_layer."},
    Rename{"time_text_embed.text_embedder.linear_1.", "vector_in.in_layer."},
    Rename{"time_text_embed.text_embedder.linear_2.", "vector_in.out_layer."},
    Rename{"time_text_embed.guidance_embedder.linear_1.", "guidance_in.in_layer."},
    Rename{"time_text_embed.guidance_embedder.linear_2.", "guidance_in.out_layer."},
    Rename{"context_embedder.", "txt_in."},
    Rename{"x_embedder.", "img_in."},
    Rename{"proj_out.", "final_layer.linear."},
    Rename{"norm_out.linear.", "final_layer.adaLN_modulation.1.", 0, 0, 0,
           "its shift and scale halves swapped (diffusers' swap_scale_shift)"},
};

template <std::size_t N>
std::optional<FileSlice> rename(const std::array<Rename, N>& table, std::string_view rest,
                                const std::string& before) {
  for (const Rename& r : table) {
    const bool module_path = r.diffusers.back() == '.';
    if (module_path ? !rest.starts_with(r.diffusers) : rest != r.diffusers) continue;
    const std::string tail(module_path ? rest.substr(r.diffusers.size()) : std::string_view());
    return FileSlice{before + std::string(r.bfl) + tail, r.begin, r.parts ? r.end : -1, r.parts,
                     std::string(r.transform)};
  }
  return std::nullopt;
}

// `<before>transformer_blocks.N.<rest>` or `<before>single_transformer_blocks.N.<rest>`.
std::optional<FileSlice> flux_name(const std::string& name) {
  for (const std::string_view list : {"single_transformer_blocks.", "transformer_blocks."}) {
    for (std::size_t at = name.find(list); at != std::string::npos; at = name.find(list, at + 1)) {
      if (at > 0 && name[at - 1] != '.') continue;
      std::size_t digits = at + list.size();
      while (digits < name.size() && name[digits] >= '0' && name[digits] <= '9') ++digits;
      if (digits == at + list.size() || digits >= name.size() || name[digits] != '.') continue;
      const std::string before =
          name.substr(0, at) +
          (list == "transformer_blocks." ? "double_blocks." : "single_blocks.") +
          name.substr(at + list.size(), digits + 1 - at - list.size());
      const std::string_view rest = std::string_view(name).substr(digits + 1);
      return list == "transformer_blocks." ? rename(kDouble, rest, before)
                                           : rename(kSingle, rest, before);
    }
  }
  return rename(kOutside, name, "");
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return text + "]";
}

// The names a file may give the tensor `name`: ComfyUI's prefix, and fp8's scale either way.
std::vector<std::string> spellings(const std::string& name) {
  std::vector<std::string> names{name};
  for (const auto& [from, to] :
       {std::pair<std::string_view, std::string_view>{".scale_weight", ".weight_scale"},
        {".weight_scale", ".scale_weight"}}) {
    if (name.ends_with(from))
      names.push_back(name.substr(0, name.size() - from.size()) + std::string(to));
  }
  const std::size_t n = names.size();
  for (std::size_t i = 0; i < n; ++i) names.push_back(std::string(kComfyPrefix) + names[i]);
  return names;
}

} // namespace

WeightsLayout parse_weights_layout(std::string_view text) {
  if (text.empty() || text == "auto") return WeightsLayout::automatic;
  if (text == "diffusers") return WeightsLayout::diffusers;
  if (text == "flux") return WeightsLayout::flux;
  throw Error(detail::concat("weights_layout '", text,
                             "' is not one blockswap knows: \"auto\" (or \"\"), \"diffusers\" or "
                             "\"flux\"; give a name map (weights_map) for another"));
}

std::string_view to_string(WeightsLayout layout) {
  switch (layout) {
  case WeightsLayout::automatic:
    return "auto";
  case WeightsLayout::diffusers:
    return "diffusers";
  case WeightsLayout::flux:
    return "flux";
  }
  return "?";
}

NameMap layout_map(WeightsLayout layout) {
  if (layout == WeightsLayout::flux) return flux_name;
  return [](const std::string& name) { return FileSlice{name}; };
}

std::vector<std::string> layout_prefixes(WeightsLayout layout) {
  if (layout == WeightsLayout::flux) return {"transformer_blocks.", "single_transformer_blocks."};
  return {};
}

bool in_flux_layout(const Checkpoint& checkpoint) {
  for (const auto& [name, t] : checkpoint.tensors) {
    std::string_view n = name;
    if (n.starts_with(kComfyPrefix)) n.remove_prefix(kComfyPrefix.size());
    if ((n.starts_with("double_blocks.") && n.ends_with(".img_attn.qkv.weight")) ||
        (n.starts_with("single_blocks.") && n.ends_with(".linear1.weight"))) {
      return true;
    }
  }
  return false;
}

Located locate_tensor(const Checkpoint& checkpoint, const NameMap& map, const std::string& name,
                      std::string_view dtype, const std::vector<int64_t>& shape) {
  std::optional<FileSlice> slice = map ? map(name) : FileSlice{name};
  if (!slice)
    return {std::nullopt,
            detail::concat("has no tensor for '", name, "' (the name map gives none)")};
  const std::vector<std::string> names = spellings(slice->name);
  const CheckpointTensor* found = nullptr;
  for (const std::string& n : names) {
    const auto it = checkpoint.tensors.find(n);
    if (it != checkpoint.tensors.end()) {
      found = &it->second;
      break;
    }
  }
  if (found == nullptr) {
    std::string looked;
    for (const std::string& n : names) looked += (looked.empty() ? "'" : ", '") + n + "'";
    return {std::nullopt,
            detail::concat("has no tensor '", slice->name, "' (looked for ", looked, ")")};
  }
  const TensorInfo& info = found->info;
  if (!slice->transform.empty()) {
    return {std::nullopt,
            detail::concat("holds '", name, "' as '", info.name, "' with ", slice->transform,
                           ", which is not a row slice: the file tier reads bytes as they are; "
                           "give that tensor in a file of the module's layout")};
  }
  const std::vector<int64_t>& file_shape = info.shape;
  int64_t begin = 0, end = file_shape.empty() ? 1 : file_shape[0];
  const int64_t rows = end;
  bool sliced = false;
  if (!file_shape.empty() && slice->parts > 0) {
    if (rows % slice->parts != 0) {
      return {std::nullopt, detail::concat("has '", info.name, "' as ", shape_text(file_shape),
                                           ", whose ", rows, " rows do not split into ",
                                           slice->parts, " equal parts for '", name, "'")};
    }
    begin = slice->row_begin * rows / slice->parts;
    end = slice->row_end * rows / slice->parts;
    sliced = true;
  } else if (slice->parts == 0 && (slice->row_begin != 0 || slice->row_end != -1)) {
    if (file_shape.empty() || slice->row_begin < 0 ||
        (slice->row_end >= 0 && slice->row_end < slice->row_begin) || slice->row_begin > rows ||
        slice->row_end > rows) {
      return {std::nullopt, detail::concat("has '", info.name, "' as ", shape_text(file_shape),
                                           ", which has no rows [", slice->row_begin, ", ",
                                           slice->row_end, ") for '", name, "'")};
    }
    begin = slice->row_begin;
    end = slice->row_end < 0 ? rows : slice->row_end;
    sliced = true;
  }
  std::vector<int64_t> taken = file_shape;
  if (sliced) taken[0] = end - begin;
  const std::string source = sliced
                                 ? detail::concat("'", info.name, "' rows [", begin, ", ", end, ")")
                                 : detail::concat("'", info.name, "'");
  if (taken != shape || info.dtype != dtype) {
    return {std::nullopt,
            detail::concat("has ", source, " as ", info.dtype, " ", shape_text(taken),
                           ", but the module's tensor '", name, "' is ", dtype, " ",
                           shape_text(shape),
                           taken != shape ? ": another model's file, or another block list's "
                                            "(set weights_prefix), or another layout "
                                            "(weights_layout)"
                                          : ": the file tier copies the file's bytes as they "
                                            "are, so the model must have the file's dtypes "
                                            "(cast after loading is not possible)")};
  }
  const uint64_t row_bytes = rows == 0 ? 0 : info.bytes() / static_cast<uint64_t>(rows);
  const uint64_t offset = found->offset + (sliced ? static_cast<uint64_t>(begin) * row_bytes : 0);
  const uint64_t bytes = sliced ? static_cast<uint64_t>(end - begin) * row_bytes : info.bytes();
  return {LocatedTensor{found->file, offset, bytes, source}, {}};
}

} // namespace blockswap
