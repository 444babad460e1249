"""The checkpoint files users have, for the file tier (weights_file=, host_budget_bytes=): a
sharded diffusers checkpoint (its index JSON or its folder), Black Forest Labs' original FLUX
layout (weights_layout=, its fused qkv and linear1 read as row slices), ComfyUI's prefix, a
user's name map (weights_map=), fp8 weights with their scales. Each loads bitwise as the model
loaded plainly, reading its blocks from the files (stats), and every file, shard or name that
cannot be matched is an error that names it."""

import json

import pytest
import torch

import blockswap
from real_models import BLOCK_LISTS, assert_bitwise, build, infer, swap, train

safetensors_torch = pytest.importorskip("safetensors.torch")

SHARDS = 3


def plain_state():
    """The diffusers model's frozen weights, as its own checkpoint has them."""
    return {name: t.contiguous() for name, t in build("flux", lora=False).state_dict().items()}


def write_sharded(state, folder):
    """diffusers' sharded layout: tensor i (sorted by name) in shard i % 3, so that every block's
    tensors lie in all three shards; the index JSON names each tensor's shard."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    files = [f"diffusion_pytorch_model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
             for s in range(SHARDS)]
    weight_map = {name: files[i % SHARDS] for i, name in enumerate(names)}
    for s, file in enumerate(files):
        safetensors_torch.save_file({n: state[n] for n in names if weight_map[n] == file},
                                    str(folder / file))
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


# diffusers' FluxTransformer2DModel names against Black Forest Labs' (diffusers' single-file
# loader, convert_flux_transformer_checkpoint_to_diffusers), applied in reverse to write a file
# in the original layout.
DOUBLE = {"img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
          "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
          "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2",
          "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out"}
DOUBLE_NORMS = {"img_attn.norm.query_norm.scale": "attn.norm_q.weight",
                "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
                "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
                "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight"}
SINGLE = {"modulation.lin": "norm.linear", "linear2": "proj_out"}
SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight",
                "norm.key_norm.scale": "attn.norm_k.weight"}


def to_bfl(state, prefix=""):
    """The state dict in Black Forest Labs' names (the tensors outside the blocks left out, as
    the offloader reads only the blocks')."""
    out = {}
    for i in range(len({n.split(".")[1] for n in state if n.startswith("transformer_blocks.")})):
        d, b = f"transformer_blocks.{i}.", f"{prefix}double_blocks.{i}."
        for w in ("weight", "bias"):
            for bfl, dif in DOUBLE.items():
                out[f"{b}{bfl}.{w}"] = state[f"{d}{dif}.{w}"]
            out[f"{b}img_attn.qkv.{w}"] = torch.cat([state[f"{d}attn.to_{x}.{w}"] for x in "qkv"])
            out[f"{b}txt_attn.qkv.{w}"] = torch.cat(
                [state[f"{d}attn.add_{x}_proj.{w}"] for x in "qkv"])
        out.update({b + bfl: state[d + dif] for bfl, dif in DOUBLE_NORMS.items()})
    for i in range(len({n.split(".")[1] for n in state
                        if n.startswith("single_transformer_blocks.")})):
        s, b = f"single_transformer_blocks.{i}.", f"{prefix}single_blocks.{i}."
        for w in ("weight", "bias"):
            for bfl, dif in SINGLE.items():
                out[f"{b}{bfl}.{w}"] = state[f"{s}{dif}.{w}"]
            out[f"{b}linear1.{w}"] = torch.cat(
                [state[f"{s}attn.to_{x}.{w}"] for x in "qkv"] + [state[f"{s}proj_mlp.{w}"]])
        out.update({b + bfl: state[s + dif] for bfl, dif in SINGLE_NORMS.items()})
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    state = plain_state()
    bfl = to_bfl(state)
    safetensors_torch.save_file(bfl, str(root / "flux1-bfl.safetensors"))
    safetensors_torch.save_file(to_bfl(state, "model.diffusion_model."),
                                str(root / "flux1-comfy.safetensors"))
    return {"index": str(write_sharded(state, root / "sharded")), "folder": str(root / "sharded"),
            "bfl": str(root / "flux1-bfl.safetensors"),
            "comfy": str(root / "flux1-comfy.safetensors"), "root": root}


def read_from_the_file(offloaders):
    """Every block is read from the file for each load, and bytes were read."""
    assert all(o.is_in_file(i) for o in offloaders for i in range(len(o.blocks)))
    assert sum(o.stats()["disk_bytes"] for o in offloaders) > 0


@pytest.mark.parametrize("source", ["index", "folder"])
def test_a_sharded_checkpoint_is_bitwise(files, source):
    folder = files["root"] / "sharded"
    weight_map = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json")
                            .read_text())["weight_map"]
    assert len({weight_map[f"transformer_blocks.0.{n}"]  # a block across every shard
                for n, _ in build("flux", lora=False).transformer_blocks[0]
                .named_parameters()}) == SHARDS
    expected = [infer(build("flux"), "flux", seed=s) for s in (1, 2)]
    model = build("flux")
    offloaders = swap(model, "flux", 2, supports_backward=False, weights_file=files[source],
                      host_budget_bytes=0)
    assert_bitwise([infer(model, "flux", offloaders, seed=s) for s in (1, 2)], expected)
    read_from_the_file(offloaders)


def test_lora_training_from_a_sharded_checkpoint_is_bitwise(files):
    expected = train(build("flux"), "flux")
    model = build("flux")
    offloaders = swap(model, "flux", 2, weights_file=files["folder"], host_budget_bytes=0)
    assert_bitwise(train(model, "flux", offloaders), expected)
    read_from_the_file(offloaders)


@pytest.mark.parametrize("source,layout", [("bfl", "flux"), ("bfl", "auto"), ("comfy", ""),
                                           ("index", "diffusers")])
@pytest.mark.parametrize("budget", [0, None])
def test_a_model_on_meta_loads_from_each_layout(files, source, layout, budget):
    """The blocks' weights come from the file alone (built on the meta device): to_q, to_k, to_v
    and proj_mlp from their rows of the fused tensors, the norms' scales, ComfyUI's prefix."""
    expected = infer(build("flux", lora=False), "flux")
    plain = plain_state()
    with torch.device("meta"):
        model = build("flux", lora=False)
    model.load_state_dict({n: t.clone() for n, t in plain.items() if not n.startswith(
        tuple(f"{n}." for n in BLOCK_LISTS["flux"]))}, strict=False, assign=True)
    offloaders = swap(model, "flux", 2, supports_backward=False, weights_file=files[source],
                      weights_layout=layout, host_budget_bytes=budget)
    assert_bitwise(infer(model, "flux", offloaders), expected)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), plain[name]), name
    if budget == 0:
        read_from_the_file(offloaders)


def test_a_users_map_gives_names_and_rows(files):
    """weights_map: a callable to the file's name, or to (name, (first row, end row))."""
    bfl = safetensors_torch.load_file(files["bfl"])
    inner = build("flux", lora=False).transformer_blocks[0].attn.to_q.weight.shape[0]
    renames = {dif: bfl_name for bfl_name, dif in DOUBLE.items()}

    def double(name):  # "<i>.<name>" with weights_prefix ""
        i, rest = name.split(".", 1)
        for x, n in enumerate("qkv"):
            for attn, fused in ((f"attn.to_{n}.", "img_attn.qkv."),
                                (f"attn.add_{n}_proj.", "txt_attn.qkv.")):
                if rest.startswith(attn):
                    return (f"double_blocks.{i}.{fused}{rest[len(attn):]}",
                            (x * inner, (x + 1) * inner))
        for bfl_name, dif in DOUBLE_NORMS.items():
            if rest == dif:
                return f"double_blocks.{i}.{bfl_name}"
        module, w = rest.rsplit(".", 1)
        return f"double_blocks.{i}.{renames[module]}.{w}" if module in renames else None

    expected = infer(build("flux"), "flux")
    model = build("flux")
    device = blockswap.open_device("cpu")
    double_blocks = blockswap.ModelOffloader(
        "transformer_blocks", list(model.transformer_blocks), len(model.transformer_blocks), 2,
        False, torch.device("cpu"), shared_device=device, hook_blocks=True,
        weights_file=files["bfl"], weights_map=double, host_budget_bytes=0)
    single_blocks = blockswap.ModelOffloader(
        "single_transformer_blocks", list(model.single_transformer_blocks),
        len(model.single_transformer_blocks), 2, False, torch.device("cpu"),
        shared_device=device, hook_blocks=True, weights_file=files["bfl"],
        weights_layout="flux", weights_prefix="single_transformer_blocks.", host_budget_bytes=0)
    assert_bitwise(infer(model, "flux", [double_blocks, single_blocks]), expected)
    read_from_the_file([double_blocks, single_blocks])


def test_mistakes_in_the_files_are_named(files, tmp_path):
    state = plain_state()
    index = write_sharded(state, tmp_path / "sharded")
    (tmp_path / "sharded" / "diffusion_pytorch_model-00002-of-00003.safetensors").unlink()
    with pytest.raises(blockswap.Error, match="diffusion_pytorch_model-00002-of-00003.safetensors"
                       "' that the index .* is missing"):
        swap(build("flux"), "flux", 2, weights_file=index, host_budget_bytes=0)
    index.write_text("{\"weight_map\": ")
    with pytest.raises(blockswap.Error, match="is not valid JSON"):
        swap(build("flux"), "flux", 2, weights_file=tmp_path / "sharded", host_budget_bytes=0)
    bfl = to_bfl(state)
    del bfl["double_blocks.1.img_attn.qkv.weight"]
    safetensors_torch.save_file(bfl, str(tmp_path / "partial.safetensors"))
    with pytest.raises(blockswap.Error, match="has no tensor 'double_blocks.1.img_attn.qkv.weight'"
                       r" \(looked for .*\) \(tensor 'attn.to_q.base_layer.weight' of block 1\)"):
        swap(build("flux"), "flux", 2, weights_file=tmp_path / "partial.safetensors",
             weights_layout="flux", host_budget_bytes=0)
    model = build("flux")
    with pytest.raises(blockswap.Error, match="has no tensor for '0.norm1.linear.weight' "
                       r"\(the name map gives none\)"):
        blockswap.ModelOffloader("blocks", list(model.transformer_blocks), 4, 2, False, "cpu",
                                 weights_file=files["bfl"], weights_map={}, host_budget_bytes=0)
    with pytest.raises(blockswap.Error, match=r"has 'double_blocks.0.img_attn.qkv.weight' rows "
                       r"\[0, 16\) as F32 \[16, 32\], but the module's tensor "
                       r"'0.norm1.linear.weight' is F32 \[192, 32\].* \(through weights_map\)"):
        blockswap.ModelOffloader(
            "blocks", list(model.transformer_blocks), 4, 2, False, "cpu",
            weights_file=files["bfl"], host_budget_bytes=0,
            weights_map=lambda n: ("double_blocks.0.img_attn.qkv.weight", (0, 16)))
    with pytest.raises(blockswap.Error, match="weights_map gave 3 for '0.norm1.linear.weight'"):
        blockswap.ModelOffloader("blocks", list(model.transformer_blocks), 4, 2, False, "cpu",
                                 weights_file=files["bfl"], weights_map=lambda n: 3,
                                 host_budget_bytes=0)
    with pytest.raises(blockswap.InvalidArgumentError, match="weights_layout 'comfy' is not one"):
        swap(model, "flux", 2, weights_file=files["bfl"], weights_layout="comfy")
    with pytest.raises(blockswap.InvalidArgumentError, match="weights_layout and weights_map say"):
        swap(model, "flux", 2, weights_layout="flux")
    # Nothing was left managed: the model still runs plain.
    assert_bitwise(infer(model, "flux"), infer(build("flux"), "flux"))


class ScaledLinear(torch.nn.Module):
    """ComfyUI's and kohya's fp8 linear: an fp8 weight and its scale, a frozen parameter
    (ComfyUI) or a buffer (kohya)."""

    def __init__(self, n, buffer, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter((torch.randn(n, n) * 4).to(dtype), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.randn(n), requires_grad=False)
        scale = torch.rand(()) + 0.5
        if buffer:
            self.register_buffer("scale_weight", scale)
        else:
            self.scale_weight = torch.nn.Parameter(scale, requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(x.dtype) * self.scale_weight,
                                          self.bias)


def fp8_blocks(buffer, dtype=torch.float8_e4m3fn):
    torch.manual_seed(0)
    return [torch.nn.Sequential(ScaledLinear(32, buffer, dtype), torch.nn.GELU(),
                                ScaledLinear(32, buffer, dtype)) for _ in range(4)]


def run_blocks(blocks, offloader=None):
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if offloader is not None:
            offloader.prepare_block_devices_before_forward()
        for block in blocks:
            x = block(x)
    return x


@pytest.mark.parametrize("buffer", [False, True])
@pytest.mark.parametrize("scale_name", ["scale_weight", "weight_scale"])
def test_fp8_weights_with_their_scales_are_read_raw(tmp_path, buffer, scale_name):
    expected = run_blocks(fp8_blocks(buffer))
    state = {f"model.diffusion_model.blocks.{i}.{n.replace('scale_weight', scale_name)}": t
             for i, block in enumerate(fp8_blocks(buffer)) for n, t in block.state_dict().items()}
    assert state["model.diffusion_model.blocks.0.0.weight"].dtype == torch.float8_e4m3fn
    path = tmp_path / "fp8_scaled.safetensors"
    safetensors_torch.save_file(state, str(path))
    blocks = fp8_blocks(buffer)
    offloader = blockswap.ModelOffloader("blocks", blocks, 4, 2, False, "cpu", hook_blocks=True,
                                         weights_file=path, weights_prefix="blocks.",
                                         host_budget_bytes=0)
    assert_bitwise([run_blocks(blocks, offloader), run_blocks(blocks, offloader)],
                   [expected, expected])
    read_from_the_file([offloader])
    offloader.close()
    with pytest.raises(blockswap.Error, match="is F8_E5M2 .*cast after loading is not possible"):
        blockswap.ModelOffloader("blocks", fp8_blocks(buffer, torch.float8_e5m2), 4, 2, False,
                                 "cpu", weights_file=path, host_budget_bytes=0)
