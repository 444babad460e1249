"""Runs kohya-ss/musubi-tuner's own scripts with blockswap.ModelOffloader in place of its own.

What runs as musubi-tuner's own code (imported from the extracted tree, scripts/fetch-trainers):

* Training: the training scripts' `main()` itself -- `wan_train_network.main`,
  `flux_kontext_train_network.main`, `qwen_image_train_network.main` -- with `sys.argv` set to
  a realistic command line (`--blocks_to_swap 3 --gradient_checkpointing --fp8_base
  --fp8_scaled --sample_prompts ... --sdpa --network_module networks.lora_wan ...`), parsed by
  the script's own `setup_parser_common()` + `wan_setup_parser()` (etc.). `main()` builds the
  script's trainer and calls `NetworkTrainer.train(args)` (training/trainer_base.py line 1312):
  the dataset from a dataset-config TOML and latent / text-encoder caches on disk
  (`_build_dataset`), `prepare_accelerator` (a CPU `accelerate.Accelerator`),
  `_load_dit_and_swap` (the script's `load_transformer` -> `load_wan_model` /
  `flux_utils.load_flow_model` / `load_qwen_image_model` from a safetensors file, with their
  fp8-scaled loading path for --fp8_scaled; requires_grad_(False); `BlockSwapConfig.from_args`;
  `enable_block_swap`; `move_to_device_except_swap_blocks`), `_build_network` (the LoRA module
  named by --network_module), `_build_optimizer_and_dataloader` (AdamW from --optimizer_type,
  the DataLoader), `_prepare_with_accelerator` (`accelerator.prepare(transformer,
  device_placement=[False])`, move + `prepare_block_swap_before_forward`, train()/eval(),
  `prepare_grad_etc`) and `_run_training_loop` (the script's `process_batch` /
  `get_noisy_model_input_and_timesteps` / `call_dit` / `compute_loss`, `accelerator.backward`,
  `optimizer.step`, `sample_images` with `switch_block_swap_for_inference` / `_training` and
  the script's `do_inference`, Wan 2.2's `swap_high_low_weights`, saving the LoRA file).
* Inference: wan_generate_video.py's `main()` with --from_file (a prompt file of two lines):
  `setup_args`, `preprocess_prompts_for_batch`, `process_batch_prompts` (line 1801:
  `load_dit_models` -> `load_dit_model` (enable_block_swap, move, prepare, then
  `eval().requires_grad_(False)`), `generate` -> `prepare_t2v_inputs`, `setup_scheduler`,
  `run_sampling` with CFG and skip-layer guidance) for two prompts on one loaded model; flux_kontext_generate_image.py's and
  qwen_image_generate_image.py's `generate` (their `load_dit_model` / `optimize_model`, the
  denoising loop; for the second image the shared model's `move_to_device_except_swap_blocks`
  + `prepare_block_swap_before_forward`), called twice with one `shared_models` dict and the
  text embeddings passed in through their own `precomputed_*_data` parameters, as their
  `process_batch_prompts` does after encoding (that function itself is not run for them: it
  loads the VAE and the Qwen2.5-VL / T5 + CLIP encoders from files first, shim 4).
* The caches are written by musubi's own writers (`dataset.cache_io.save_latent_cache_wan`,
  `save_text_encoder_output_cache_wan`, ... as its cache_latents / cache_text_encoder_outputs
  scripts do after encoding), and the DiT files hold the state_dict of musubi's own model class
  (random weights) that its loaders read back.

What this file adds (observation only, none of it on the block-swap path): a subclass of the
script's trainer that overrides the trainer's documented extension hooks (`on_train_start`,
`on_post_optimizer_step`, `on_post_save`, `process_batch` calling super) and
`sample_image_inference` (calling super) to record losses, LoRA gradients (an optimizer step
pre-hook), LoRA weights, sampled latents, h2d bytes per step / pass and which blocks are
resident; wrappers around wan_generate_video's `load_dit_models` / `generate` that call the
real ones and record the same. The LoRA weights compared are read back from the file the
training script saved.

The substitution, as a user makes it: musubi-tuner builds every block-swap offloader in
`create_offloader` (src/musubi_tuner/modules/custom_offloading_utils.py, line 140:
`return ModelOffloader(`), which reads the module-global name `ModelOffloader` when it is called.
The user's one-line change is to rebind that name after musubi's class (line 431) is defined,
e.g. as the last line of that file:

    from blockswap import ModelOffloader  # noqa: E402,F811

The harness does the same at run time (the `mt` fixture of test_musubi_tuner.py). The device is
the CPU (`accelerate` picks it: no CUDA here), blockswap's emulated device; the runs without
block swap leave --blocks_to_swap out (musubi's default, `enable_block_swap` never called).

Shims and substitutions (every one, and why):

1. torchvision: the scripts import it (`torchvision.transforms.functional as TF`, and
   hv_generate_video's `torchvision.utils.make_grid` in `save_images_grid`, which trainer_base's
   `sample_image_inference` calls to write each sample). PyPI's torchvision==0.28.0, the
   release paired with torch 2.13.0, is a CUDA build (its `_C.so` needs libc10_cuda.so), and no
   CPU build is on the registry: on this CPU torch `import torchvision` fails in
   `_meta_registrations.py` line 163 ("operator torchvision::nms does not exist"), and while it
   is installed transformers reports it available and its image processors stop importing
   (`from transformers import CLIPImageProcessor`: "Could not import module
   'CLIPImageProcessor'"), which breaks the rest of the project's tests. So it is not
   installed, and while musubi's scripts are imported (only then, and only when no working
   torchvision exists) `torchvision`, `.transforms`, `.transforms.functional` and `.utils` are
   stub modules: every function raises "torchvision is not installed", except `make_grid`,
   which returns a batch of one as that image (what torchvision returns for it). The paths run
   here call TF nowhere (it serves i2v / CLIP image inputs). The stubs leave sys.modules after
   the import, so nothing else in the process sees them.
2. `torch.cuda.current_device` returns 0 while musubi is imported: `wan/modules/t5.py` line 457
   calls it in a default argument at import time ("Torch not compiled with CUDA enabled").
3. Tiny models: the loaders build the model from fixed configurations; the harness registers
   tiny Wan task configs (`WAN_CONFIGS["t2v-tiny"]` from "t2v-1.3B", `"t2v-A-tiny"` from
   "t2v-A14B", dim 32, 2 heads, 6 blocks) and, for the test module's duration, swaps FLUX's
   `flux_models.configs_flux_dev_context.params` (hidden 32, 2 heads, 4 double + 8 single
   blocks) and Qwen-Image's `qwen_image_model.QwenImageTransformer2DModel` for a subclass that
   passes head dim 16 / 2 heads / rope axes (4, 6, 6) to the real class (`create_model`
   hard-codes the 20B sizes; the layer count is the script's own --num_layers 4).
4. Text encoders, VAEs: their weights (umt5-xxl, T5-XXL + CLIP-L, Qwen2.5-VL, the VAEs) cannot
   be had here. The trainer subclass's `process_sample_prompts` reads the prompt file with
   musubi's own `load_prompts` and puts seeded random embeddings of the encoders' shapes where
   the encoders' outputs go; its `load_vae` returns a stub whose `decode` records the latent it
   is given (the sampled result compared bitwise) and returns black pixels.
   wan_generate_video's `load_text_encoder` is replaced by a stub encoder (a seeded embedding
   per prompt text); Flux / Qwen `generate` get the embeddings as precomputed data.
5. `time.sleep` in wan_generate_video: `process_batch_prompts` sleeps 5 s after a block-swap
   run "to finish block swap" (CUDA streams); its module's `time` is given a `sleep` that does
   not wait. Nothing else in that module uses `time.sleep`.
6. Not shimmed, reported instead: `LoRAStreamOffloader.__init__` asserts `device.type ==
   "cuda"` and uses `torch.cuda.Stream`; it cannot run on the CPU, so the h2d-only test puts
   blockswap.ModelOffloader in its place (`create_offloader`'s other branch, line 129).
7. `gc.freeze()` after the imports (test fixture): musubi calls `gc.collect()` in every
   `clean_memory_on_device`, dozens of times a run; with transformers / diffusers / torch
   imported each full collection takes ~0.3 s. Freezing the objects that exist after import
   makes those collections cheap; it changes nothing they collect.

What is still written here, and why:

* The calls of the FLUX and Qwen-Image generate scripts' `generate()` (two images, one
  `shared_models`), in place of their `process_batch_prompts` (shim 4).
* The frozen-first inference orders (not musubi's order for these models) wrap the loader the
  script calls (`load_wan_model`, `load_flow_model`, `load_qwen_image_model`) so the model comes
  out of it frozen, before the script's enable_block_swap; and the h2d-only inference
  (krea2_generate_image.py's order, whose model is another architecture) is wan_generate_video
  with its `BlockSwapConfig` given `h2d_only=True, ring_size=2` and the loader's model frozen.
* `enable_block_swap` twice (an edge case no script does): `on_transformer_loaded` wraps the
  model's `enable_block_swap` so the trainer's one call makes two.
* Packages the scripts import, pinned in python/requirements-trainers.txt: einops, ftfy,
  wcwidth, easydict, toml (before), opencv-python-headless, av, voluptuous, pillow; not
  torchvision (shim 1).

Precision: Wan runs in float32 (--mixed_precision no; a bfloat16 Wan does not run on a CPU
torch: the float32 autocast region around its time embedding, wan/modules/model.py line 849, is
disabled on the CPU and its Linear meets a float32 input, "mat1 and mat2 must have the same
dtype"); FLUX and Qwen-Image store bfloat16 weights and train with --mixed_precision bf16, as
their scripts expect (accelerate's CPU bf16 autocast around the prepared transformer), and
sample / generate in bfloat16 as their scripts do.
"""
import contextlib
import copy
import dataclasses
import functools
import gc
import os
import pathlib
import sys
import types
from unittest import mock
import zlib

import torch

LR = "1e-2"               # large enough that a few AdamW steps change every LoRA weight
LORA_DIM = 4
RES = 64                  # image size: 8x8 latents, 16 image tokens after 2x2 patches

# --------------------------------------------------------------------------------- importing

def _torchvision_works():
    try:
        import torchvision.transforms.functional  # noqa: F401
        return True
    except Exception:  # absent, or a CUDA build that cannot load on a CPU torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        return False


def _stub_module(name, **attrs):
    import importlib.machinery
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def missing(attr):
        def call(*a, **kw):
            raise RuntimeError(f"{name}.{attr}: torchvision is not installed (musubi_harness "
                               "shim 1); this path needs the real package")
        return call
    module.__getattr__ = lambda attr: missing(attr) if not attr.startswith("__") else (
        _raise_attribute(name, attr))
    module.__dict__.update(attrs)
    return module


def _raise_attribute(name, attr):
    raise AttributeError(f"module {name!r} has no attribute {attr!r}")


def _make_grid(tensor, nrow=8, **kw):
    """torchvision.utils.make_grid for what the harness's runs give it (save_images_grid, one
    sampled image at a time): a batch of one is that image (torchvision returns
    tensor.squeeze(0) for it too)."""
    if tensor.dim() == 4 and tensor.size(0) == 1:
        return tensor.squeeze(0)
    raise RuntimeError("make_grid: only a batch of one is provided by musubi_harness shim 1")


@contextlib.contextmanager
def _torchvision_stub():
    """Shim 1 of the module docstring: while musubi's scripts are imported, and only when no
    working torchvision is installed, `torchvision`, `torchvision.transforms`,
    `torchvision.transforms.functional` and `torchvision.utils` are stub modules; they leave
    sys.modules again afterwards (the scripts keep their references), so nothing else in the
    process sees them."""
    if _torchvision_works():
        yield
        return
    import transformers  # noqa: F401  (their availability checks run before the stub exists)
    import diffusers  # noqa: F401
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.functional",
             "torchvision.utils"]
    functional = _stub_module(names[2])
    transforms = _stub_module(names[1], functional=functional)
    utils = _stub_module(names[3], make_grid=_make_grid)
    root = _stub_module(names[0], transforms=transforms, utils=utils, __version__="stub")
    modules = dict(zip(names, (root, transforms, functional, utils)))
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in names:
            if sys.modules.get(name) is modules[name]:
                del sys.modules[name]


@contextlib.contextmanager
def _cuda_current_device_shim():
    """Shim 2 of the module docstring."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def load_musubi(root):
    """Imports musubi-tuner's scripts and modules from the extracted tree `root`."""
    src = str(root / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    with _torchvision_stub(), _cuda_current_device_shim():
        from musubi_tuner import wan_train_network, wan_generate_video
        from musubi_tuner import flux_kontext_train_network, flux_kontext_generate_image
        from musubi_tuner import qwen_image_train_network, qwen_image_generate_image
    from musubi_tuner.training import trainer_base, sampling_prompts
    from musubi_tuner.wan import configs as wan_configs
    from musubi_tuner.wan.modules import model as wan_model
    from musubi_tuner.flux import flux_models
    from musubi_tuner.qwen_image import qwen_image_model
    from musubi_tuner.modules import custom_offloading_utils
    from musubi_tuner.dataset import cache_io
    from musubi_tuner.dataset.image_video_dataset import ItemInfo

    # Shim 3: tiny Wan task configurations, next to musubi's own.
    if "t2v-tiny" not in wan_configs.WAN_CONFIGS:
        for name, base in (("t2v-tiny", "t2v-1.3B"), ("t2v-A-tiny", "t2v-A14B")):
            cfg = copy.deepcopy(wan_configs.WAN_CONFIGS[base])
            cfg.update(dim=32, ffn_dim=64, freq_dim=32, num_heads=2, num_layers=6, text_len=8)
            cfg.__name__ = f"Config: tiny ({base})"
            wan_configs.WAN_CONFIGS[name] = cfg
            wan_configs.SUPPORTED_SIZES[name] = (f"{RES}*{RES}",)
    return types.SimpleNamespace(
        wan_train=wan_train_network, wan_gen=wan_generate_video,
        flux_train=flux_kontext_train_network, flux_gen=flux_kontext_generate_image,
        qwen_train=qwen_image_train_network, qwen_gen=qwen_image_generate_image,
        trainer_base=trainer_base, load_prompts=sampling_prompts.load_prompts,
        wan_configs=wan_configs, wan_model=wan_model, flux_models=flux_models,
        qwen_image_model=qwen_image_model, cou=custom_offloading_utils, cache_io=cache_io,
        ItemInfo=ItemInfo)


@contextlib.contextmanager
def tiny_models(mt):
    """Shim 3 for FLUX and Qwen-Image, for the duration of the block."""
    fm, qm = mt.flux_models, mt.qwen_image_model
    spec = fm.configs_flux_dev_context
    tiny_spec = dataclasses.replace(spec, params=dataclasses.replace(
        spec.params, hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=4, depth_single_blocks=8,
        axes_dim=[4, 6, 6]))
    real_qwen = qm.QwenImageTransformer2DModel

    class TinyQwenImageTransformer2DModel(real_qwen):
        def __init__(self, **kw):
            kw.update(attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(4, 6, 6))
            super().__init__(**kw)

    with mock.patch.object(fm, "configs_flux_dev_context", tiny_spec), \
            mock.patch.object(qm, "QwenImageTransformer2DModel", TinyQwenImageTransformer2DModel):
        yield


@contextlib.contextmanager
def patched(*triples):
    with contextlib.ExitStack() as stack:
        for obj, name, value in triples:
            stack.enter_context(mock.patch.object(obj, name, value))
        yield


def _reset_accelerate():
    """Each run makes its Accelerator afresh (as each script run does in its own process)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _argv(script, argv):
    return patched((sys, "argv", [script] + [str(a) for a in argv]))


def _embed(text, *shape, dtype=torch.float32):
    """A seeded embedding standing for a text encoder's output for `text` (shim 4)."""
    gen = torch.Generator().manual_seed(zlib.crc32(text.encode()))
    return torch.randn(*shape, generator=gen).to(dtype)


def _save_model(model, path, dtype):
    from safetensors.torch import save_file
    save_file({k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()},
              str(path))


class StubVAE(torch.nn.Module):
    """Shim 4: records what the script decodes; returns black pixels of the right shape."""

    def __init__(self, sink, kind):
        super().__init__()
        self.sink, self.kind = sink, kind

    @property
    def dtype(self):
        return torch.float32

    def decode(self, z):
        self.sink(z)
        if self.kind == "wan":        # (1, C, F, h, w) -> list of (3, F, H, W)
            return [torch.zeros(3, z.shape[2], z.shape[3] * 8, z.shape[4] * 8)]
        return torch.zeros(z.shape[0], 3, z.shape[-2] * 8, z.shape[-1] * 8)   # FLUX: (B, 3, H, W)

    def decode_to_pixels(self, z):   # Qwen-Image: (1, C, 1, h, w) -> (1, 3, H, W)
        self.sink(z)
        return torch.zeros(1, 3, z.shape[-2] * 8, z.shape[-1] * 8)


# ----------------------------------------------------------------------------------- models

class Arch:
    """One architecture: its script, its tiny DiT file, its cached data set, its offloaders."""
    name = None
    mixed_precision = "no"
    weight_dtype = torch.float32

    def __init__(self, mt, num_blocks):
        self.mt = mt
        self.num_blocks = num_blocks

    def offloaders(self, model):
        return [model.offloader] if model.offloader is not None else []

    def getters(self):
        return [lambda m: m.offloader]

    def write_dit(self, path, seed):
        _save_model(self.build(seed), path, self.weight_dtype)

    def write_dataset(self, root, items=3):
        """Latent and text-encoder caches written by musubi's own cache writers, and the
        dataset config TOML that points at them."""
        (root / "img").mkdir(parents=True, exist_ok=True)
        (root / "cache").mkdir(exist_ok=True)
        gen = torch.Generator().manual_seed(1)
        for i in range(items):
            info = self.mt.ItemInfo(f"item{i}", f"caption {i}", (RES, RES), (RES, RES))
            info.latent_cache_path = str(root / "cache" / f"item{i}_{RES:04d}x{RES:04d}_"
                                                          f"{self.arch_key}.safetensors")
            info.text_encoder_output_cache_path = str(root / "cache" /
                                                      f"item{i}_{self.arch_key}_te.safetensors")
            self.write_item(info, gen)
        toml = root / "dataset.toml"
        toml.write_text(f"""[general]
resolution = [{RES}, {RES}]
caption_extension = ".txt"
batch_size = 1
enable_bucket = false

[[datasets]]
image_directory = "{root / 'img'}"
cache_directory = "{root / 'cache'}"
{self.extra_dataset_toml(root)}""")
        return toml

    def extra_dataset_toml(self, root):
        return ""

    def train_argv(self, tmp, dit):
        """The script-specific part of the command line."""
        raise NotImplementedError


class Wan(Arch):
    """Wan 2.1 / 2.2 t2v through wan_train_network.py / wan_generate_video.py."""
    arch_key = "wan"
    lora = "networks.lora_wan"

    def __init__(self, mt, num_blocks, version="2.1"):
        super().__init__(mt, num_blocks)
        assert num_blocks == 6, "the tiny Wan configurations have 6 blocks"
        self.version = version
        self.name = f"Wan {version}"
        self.task = "t2v-tiny" if version == "2.1" else "t2v-A-tiny"
        self.trainer_module = mt.wan_train
        self.trainer_attr = "WanNetworkTrainer"

    def build(self, seed):
        torch.manual_seed(seed)
        cfg = self.mt.wan_configs.WAN_CONFIGS[self.task]
        model = self.mt.wan_model.WanModel(
            model_type="t2v", model_version=self.version, dim=cfg.dim, ffn_dim=cfg.ffn_dim,
            freq_dim=cfg.freq_dim, in_dim=cfg.in_dim, out_dim=cfg.out_dim, num_heads=cfg.num_heads,
            num_layers=cfg.num_layers, text_len=cfg.text_len, eps=cfg.eps, attn_mode="torch",
            split_attn=False)
        # init_weights() zeroes the output layer (as Wan's release does): the loss would then
        # not depend on the blocks and every LoRA gradient would be 0. Give it random weights.
        torch.nn.init.normal_(model.head.head.weight, std=0.05)
        return model

    def blocks(self, model):
        return [model.blocks]

    def write_item(self, info, gen):
        cio = self.mt.cache_io
        cio.save_latent_cache_wan(info, torch.randn(16, 1, RES // 8, RES // 8, generator=gen),
                                  None, None, None)
        cio.save_text_encoder_output_cache_wan(info, torch.randn(8, 4096, generator=gen))

    def train_argv(self, tmp, dit):
        argv = ["--task", self.task, "--t5", "unused-t5.pth", "--vae", "unused-vae.pth"]
        return argv

    def sample_embeds(self, p):
        return {"t5_embeds": _embed(p.get("prompt", ""), 8, 4096),
                "negative_t5_embeds": _embed(p.get("negative_prompt") or "", 8, 4096)}


class Flux(Arch):
    """FLUX.1 Kontext (`flux_models.Flux`) through flux_kontext_train_network.py /
    flux_kontext_generate_image.py; 4 double and 8 single blocks: enable_block_swap(K) swaps
    K // 2 double blocks and (K - K // 2) * 2 + 1 single blocks, each at most N - 2."""
    name = "FLUX"
    arch_key = "fk"
    lora = "networks.lora_flux"
    mixed_precision = "bf16"
    weight_dtype = torch.bfloat16

    def __init__(self, mt, num_double=4, num_single=8):
        super().__init__(mt, num_double + num_single)
        self.trainer_module = mt.flux_train
        self.trainer_attr = "FluxKontextNetworkTrainer"

    def build(self, seed):
        torch.manual_seed(seed)
        fm = self.mt.flux_models
        return fm.Flux(fm.configs_flux_dev_context.params, attn_mode="torch", split_attn=False)

    def blocks(self, model):
        return [model.double_blocks, model.single_blocks]

    def offloaders(self, model):
        return [o for o in (model.offloader_double, model.offloader_single) if o is not None]

    def getters(self):
        return [lambda m: m.offloader_double, lambda m: m.offloader_single]

    def write_item(self, info, gen):
        cio = self.mt.cache_io
        cio.save_latent_cache_flux_kontext(info, torch.randn(16, RES // 8, RES // 8, generator=gen),
                                           torch.randn(16, RES // 8, RES // 8, generator=gen))
        cio.save_text_encoder_output_cache_flux_kontext(info, torch.randn(6, 4096, generator=gen),
                                                        torch.randn(768, generator=gen))

    def extra_dataset_toml(self, root):
        (root / "control").mkdir(exist_ok=True)
        return f'control_directory = "{root / "control"}"\n'

    def train_argv(self, tmp, dit):
        return ["--text_encoder1", "unused-t5.safetensors", "--text_encoder2",
                "unused-clip.safetensors", "--vae", "unused-ae.safetensors"]

    def sample_embeds(self, p):
        return {"t5_vec": _embed(p.get("prompt", ""), 1, 6, 4096),
                "clip_l_pooler": _embed(p.get("prompt", "") + "/clip", 1, 768)}


class Qwen(Arch):
    """Qwen-Image (`QwenImageTransformer2DModel`) through qwen_image_train_network.py /
    qwen_image_generate_image.py."""
    name = "Qwen-Image"
    arch_key = "qi"
    lora = "networks.lora_qwen_image"
    mixed_precision = "bf16"
    weight_dtype = torch.bfloat16

    def __init__(self, mt, num_blocks):
        super().__init__(mt, num_blocks)
        self.trainer_module = mt.qwen_train
        self.trainer_attr = "QwenImageNetworkTrainer"

    def write_dit(self, path, seed):
        # create_model builds on the meta device (init_empty_weights): build the same class
        # for real, from create_model's own arguments.
        torch.manual_seed(seed)
        qm = self.mt.qwen_image_model
        calls = []
        real = qm.QwenImageTransformer2DModel

        def capture(**kw):
            calls.append(kw)
            return real(**kw)

        with patched((qm, "QwenImageTransformer2DModel", capture)):
            qm.create_model("torch", False, False, False, False, None, num_layers=self.num_blocks)
        torch.manual_seed(seed)
        _save_model(real(**calls[0]), path, self.weight_dtype)

    def blocks(self, model):
        return [model.transformer_blocks]

    def write_item(self, info, gen):
        cio = self.mt.cache_io
        cio.save_latent_cache_qwen_image(info, torch.randn(16, 1, RES // 8, RES // 8,
                                                           generator=gen), None)
        cio.save_text_encoder_output_cache_qwen_image(info, torch.randn(6, 3584, generator=gen))

    def train_argv(self, tmp, dit):
        return ["--num_layers", self.num_blocks, "--text_encoder", "unused-vl.safetensors",
                "--vae", "unused-vae.safetensors"]

    def sample_embeds(self, p):
        return {"vl_embed": _embed(p.get("prompt", ""), 1, 6, 3584),
                "negative_vl_embed": _embed(p.get("negative_prompt") or " ", 1, 6, 3584)}


# ------------------------------------------------------------------------------ observation

class Residency:
    """Forward pre-hooks on every block that record, as each block starts, which blocks of its
    list are resident (offloader.is_resident): proof that swapped weights really were off the
    device during a pass."""

    def __init__(self, arch, model):
        self.records = []
        self.handles = []
        for blocks, getter in zip(arch.blocks(model), arch.getters()):
            for block in blocks:
                self.handles.append(block.register_forward_pre_hook(self._hook(model, getter)))

    def _hook(self, model, getter):
        def hook(module, args):
            offloader = getter(model)
            if offloader is not None and hasattr(offloader, "is_resident"):
                self.records.append([offloader.is_resident(i)
                                     for i in range(offloader.num_blocks)])
        return hook

    def some_block_was_off(self):
        return any(not all(r) for r in self.records)

    def remove(self):
        for h in self.handles:
            h.remove()


def nonresident(offloaders):
    """For each offloader, the indices of the blocks that are not on the device now."""
    return [[i for i in range(o.num_blocks) if not o.is_resident(i)] for o in offloaders
            if hasattr(o, "is_resident")]


def h2d(offloaders):
    return sum(o.stats()["h2d_bytes"] for o in offloaders if hasattr(o, "stats"))


def reset_stats(offloaders):
    """Counts from 0 for the step or pass about to run. (The bytes of a step are read this way
    rather than as a difference of stats() before and after: an offloader rebuilt over replaced
    Parameters in the middle of a step starts its counters again.)"""
    for o in offloaders:
        if hasattr(o, "reset_stats"):
            o.reset_stats()


def swapped(offloaders):
    """The offloaders that swap something (K > 0 for their list)."""
    return [o for o in offloaders if (o.blocks_to_swap or 0) > 0]


class Result:
    """What a run produced, by name, for a bitwise comparison; and what it moved."""

    def __init__(self):
        self.values = {}          # name -> tensor
        self.h2d_per_step = []    # training steps
        self.h2d_cumulative = []  # stats()["h2d_bytes"] after each step, never reset (cumulative)
        self.sample_h2d = []      # sampling passes
        self.off_after_prepare = None
        self.off_during_sampling = []
        self.off_during_pass = None
        self.offloaders = []
        self.experts = []         # Wan 2.2: True where the high-noise expert ran the step
        self.sample_experts = []  # Wan 2.2: the expert active when each sampling began
        self.model = None

    def add(self, name, tensor):
        self.values[name] = tensor.detach().to("cpu").clone()


# ---------------------------------------------------------------------------------- training

def _observed_trainer(arch, result, cumulative, enable_again_with):
    """The script's trainer class, subclassed for observation (and shim 4)."""
    base = getattr(arch.trainer_module, arch.trainer_attr)
    mt = arch.mt
    state = types.SimpleNamespace(step=-1, model=None, sample_tag=None)

    def current_offloaders():
        return arch.offloaders(state.model) if state.model is not None else []

    class Observed(base):
        # -- shim 4
        def process_sample_prompts(self, args, accelerator, sample_prompts):
            out = []
            for p in mt.load_prompts(sample_prompts):
                p = p.copy()
                p.update(arch.sample_embeds(p))
                out.append(p)
            return out

        def load_vae(self, args, vae_dtype, vae_path):
            return StubVAE(lambda z: result.add(state.sample_tag, z), arch.arch_key)

        # -- observation
        def on_transformer_loaded(self, args, accelerator, transformer):
            super().on_transformer_loaded(args, accelerator, transformer)
            if enable_again_with is not None:
                enable = transformer.enable_block_swap

                def enable_twice(k, config):
                    enable(k, config)
                    enable(enable_again_with, config)
                transformer.enable_block_swap = enable_twice

        def on_train_start(self, args, accelerator, network, transformer, optimizer):
            super().on_train_start(args, accelerator, network, transformer, optimizer)
            state.model = accelerator.unwrap_model(transformer)
            result.model = state.model
            result.offloaders = current_offloaders()
            result.off_after_prepare = nonresident(swapped(result.offloaders))
            names = {id(p): n for n, p in accelerator.unwrap_model(network).named_parameters()}
            inner = getattr(optimizer, "optimizer", optimizer)

            def before_step(opt, a, kw):
                for group in opt.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            result.add(f"step{state.step}.grad.{names[id(p)]}", p.grad)
            inner.register_step_pre_hook(before_step)

        def process_batch(self, *a, **kw):
            state.step += 1
            if not cumulative:
                reset_stats(current_offloaders())
            loss, metrics = super().process_batch(*a, **kw)
            result.add(f"step{state.step}.loss", loss)
            if getattr(self, "high_low_training", False):
                result.experts.append(bool(self.current_model_is_high_noise))
            return loss, metrics

        def on_post_optimizer_step(self, args, accelerator, network, transformer, sync, step):
            super().on_post_optimizer_step(args, accelerator, network, transformer, sync, step)
            offs = current_offloaders()
            if cumulative:
                result.h2d_cumulative.append(h2d(offs))
            else:
                result.h2d_per_step.append(h2d(offs))

        def sample_image_inference(self, accelerator, args, transformer, dit_dtype, vae, save_dir,
                                   sample_parameter, epoch, steps):
            # sample_images has switched the model to inference (switch_block_swap_for_inference)
            model = transformer
            offs = arch.offloaders(model)
            reset_stats(offs)
            off_prepare = nonresident(swapped(offs))
            if getattr(self, "high_low_training", False):
                result.sample_experts.append(bool(self.current_model_is_high_noise))
            residency = Residency(arch, model)
            state.sample_tag = f"sample.step{steps}.{sample_parameter.get('enum', 0)}"
            try:
                super().sample_image_inference(accelerator, args, transformer, dit_dtype, vae,
                                               save_dir, sample_parameter, epoch, steps)
            finally:
                residency.remove()
            result.sample_h2d.append(h2d(arch.offloaders(model)))
            result.off_during_sampling.append((off_prepare, residency.some_block_was_off()))

        def on_post_save(self, args, accelerator, network, transformer, ckpt_name, save_dtype,
                         metadata, force_sync_upload):
            super().on_post_save(args, accelerator, network, transformer, ckpt_name, save_dtype,
                                 metadata, force_sync_upload)
            from safetensors.torch import load_file
            for name, tensor in load_file(os.path.join(args.output_dir, ckpt_name)).items():
                result.add(f"lora.{name}", tensor)

    return Observed


def _with_dit(arch, tmp, seed):
    """The run's folder, holding the architecture's random DiT file (written once)."""
    tmp = pathlib.Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    dit = tmp / "dit.safetensors"
    if not dit.exists():
        arch.write_dit(dit, seed)
    return tmp


def train(mt, arch, blocks_to_swap, tmp, *, gradient_checkpointing=False, cpu_offload=False,
          steps=3, sample=False, fp8=False, seed=0, extra_argv=(), high_low=False,
          cumulative=False, enable_again_with=None, timestep_boundary=500):
    """LoRA training by the architecture's training script: `main()` of wan_train_network.py /
    flux_kontext_train_network.py / qwen_image_train_network.py with a command line, and
    NetworkTrainer.train under it. `blocks_to_swap` K (0: --blocks_to_swap left out).

    `sample`: --sample_at_first --sample_every_n_steps 2 (sampling before step 1 and after
    step 2, training goes on after). `high_low`: Wan 2.2 with --dit_high_noise (the experts
    exchanged by swap_high_low_weights as the timesteps fall) and --timestep_boundary.
    `cumulative`: never reset the offloaders' counters; record stats() after each step in
    `h2d_cumulative`. `enable_again_with`: enable_block_swap is called a second time right after
    the first, with this K. Returns a Result."""
    result = Result()
    tmp = _with_dit(arch, tmp, seed)
    dit = tmp / "dit.safetensors"
    toml = tmp / "dataset.toml"
    if not toml.exists():
        arch.write_dataset(tmp)
    out = tmp / f"out-{blocks_to_swap}-{len(list(tmp.glob('out-*')))}"
    argv = ["--dit", dit, "--dataset_config", toml, "--sdpa", "--mixed_precision",
            arch.mixed_precision, "--network_module", arch.lora, "--network_dim", LORA_DIM,
            "--network_alpha", "1", "--optimizer_type", "AdamW", "--optimizer_args",
            "weight_decay=0.01", "--learning_rate", LR, "--max_train_steps", steps, "--seed",
            seed, "--output_dir", out, "--output_name", "lora", "--max_data_loader_n_workers", "0"]
    argv += arch.train_argv(tmp, dit)
    if blocks_to_swap > 0:
        argv += ["--blocks_to_swap", blocks_to_swap]
    if gradient_checkpointing:
        argv += ["--gradient_checkpointing"]
    if cpu_offload:
        argv += ["--gradient_checkpointing_cpu_offload"]
    if fp8:
        argv += ["--fp8_base", "--fp8_scaled"]
    if sample:
        prompts = tmp / "prompts.txt"
        prompts.write_text(f"a cat --w {RES} --h {RES} --f 1 --s 3 --d 42 --n blurry\n")
        argv += ["--sample_prompts", prompts, "--sample_every_n_steps", "2", "--sample_at_first"]
    if high_low:
        high = tmp / "dit_high.safetensors"
        if not high.exists():
            arch.write_dit(high, seed + 100)
        argv += ["--dit_high_noise", high, "--timestep_boundary", timestep_boundary]
    argv += list(extra_argv)

    observed = _observed_trainer(arch, result, cumulative, enable_again_with)
    _reset_accelerate()
    with _argv(arch.trainer_module.__file__, argv), \
            patched((arch.trainer_module, arch.trainer_attr, observed)):
        arch.trainer_module.main()
    _reset_accelerate()
    return result


# ---------------------------------------------------------------------------------- inference

class _StubT5:
    """Shim 4: wan_generate_video's text encoder (umt5-xxl) in place: one seeded embedding per
    prompt, of the encoder's output shape (a list of (L, 4096))."""

    def __init__(self):
        self.model = torch.nn.Module()

    def __call__(self, texts, device):
        return [_embed(t, 8, 4096).to(device) for t in texts]


def _no_wait_time(module):
    """Shim 5: the module's `time`, with a sleep that does not wait."""
    real = module.time
    ns = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    ns.sleep = lambda seconds: None
    return ns


def _frozen_loader(loader):
    @functools.wraps(loader)
    def load(*a, **kw):
        return loader(*a, **kw).eval().requires_grad_(False)
    return load


def generate(mt, arch, blocks_to_swap, tmp, *, fp8=False, freeze_first=False, seed=0, passes=2,
             slg_layers=None, h2d_only=False, pinned=False):
    """Inference by the architecture's generate script, `passes` images on one loaded model.
    Wan: wan_generate_video.process_batch_prompts (the models loaded once by load_dit_models,
    then generate() per prompt with no prepare in between). FLUX / Qwen-Image: the script's
    generate() per image with one shared_models dict (the first call loads the model by the
    script's load_dit_model (+ optimize_model), the next ones move + prepare the shared model).
    `freeze_first`: the loader's model is frozen before enable_block_swap (not musubi's order
    for these scripts). `slg_layers`: Wan's --slg_mode original --slg_layers.
    `h2d_only`: Wan, BlockSwapConfig(..., h2d_only=True, ring_size=2) and frozen first."""
    result = Result()
    tmp = _with_dit(arch, tmp, seed)
    dit = tmp / "dit.safetensors"
    out = tmp / f"gen-{blocks_to_swap}-{len(list(tmp.glob('gen-*')))}"
    out.mkdir()
    prompts = [f"a photo of a cat, {i}" for i in range(passes)]
    state = types.SimpleNamespace(models=None, residency=None)

    def observe(models):
        state.models = [m for m in models if m is not None]
        result.model = state.models[-1]
        result.offloaders = [o for m in state.models for o in arch.offloaders(m)]
        result.off_after_prepare = nonresident(swapped(result.offloaders))
        state.residency = [Residency(arch, m) for m in state.models]

    common = ["--dit", dit, "--save_path", out, "--seed", seed + 10, "--device", "cpu",
              "--attn_mode", "torch", "--infer_steps", "3", "--output_type", "latent"]
    if blocks_to_swap > 0:
        common += ["--blocks_to_swap", blocks_to_swap]
    else:
        common += ["--blocks_to_swap", "0"]
    if fp8:
        common += ["--fp8_scaled"]
    if pinned:
        common += ["--use_pinned_memory_for_block_swap"]

    _reset_accelerate()
    try:
        if isinstance(arch, Wan):
            wg = mt.wan_gen
            argv = common + ["--task", arch.task, "--video_size", RES, RES, "--video_length", "1",
                             "--from_file", out / "prompts.txt", "--guidance_scale", "5.0"]
            if slg_layers is not None:
                argv += ["--slg_mode", "original", "--slg_layers", ",".join(map(str, slg_layers)),
                         "--slg_start", "0", "--slg_end", "1"]
            real_generate, real_load = wg.generate, wg.load_dit_models

            def load_dit_models(*a, **kw):
                models = real_load(*a, **kw)
                observe(models)
                reset_stats(result.offloaders)
                return models

            def observed_generate(args, gen_settings, shared_models=None):
                offs = result.offloaders
                reset_stats(offs)
                latent = real_generate(args, gen_settings, shared_models)
                result.add(f"sample{len(result.sample_h2d)}", latent)
                result.sample_h2d.append(h2d(offs))
                return latent

            patches = [(wg, "load_text_encoder", lambda args, config, device: _StubT5()),
                       (wg, "load_dit_models", load_dit_models),
                       (wg, "generate", observed_generate), (wg, "time", _no_wait_time(wg))]
            if freeze_first or h2d_only:
                patches.append((wg, "load_wan_model", _frozen_loader(wg.load_wan_model)))
            if h2d_only:
                patches.append((wg, "BlockSwapConfig", functools.partial(
                    wg.BlockSwapConfig, h2d_only=True, ring_size=2)))
            (out / "prompts.txt").write_text("".join(p + "\n" for p in prompts))
            with _argv("wan_generate_video.py", argv), patched(*patches):
                wg.main()
        else:
            gen_module = mt.flux_gen if isinstance(arch, Flux) else mt.qwen_gen
            argv = common + ["--image_size", RES, RES, "--prompt", prompts[0]]
            if isinstance(arch, Flux):
                argv += ["--text_encoder1", "unused-t5", "--text_encoder2", "unused-clip"]
                loader = (gen_module, "load_flow_model")
            else:
                argv += ["--text_encoder", "unused-vl", "--num_layers", arch.num_blocks,
                         "--negative_prompt", "blurry"]
                loader = (mt.qwen_image_model, "load_qwen_image_model")
            with _argv(f"{arch.arch_key}_generate.py", argv):
                args = gen_module.parse_args()
            args.device = torch.device(args.device)
            gen_settings = gen_module.get_generation_settings(args)
            shared_models = {}
            patches = []
            if freeze_first:
                patches.append((loader[0], loader[1], _frozen_loader(getattr(*loader))))
            # observation: the model as the script's loading leaves it (FLUX: after
            # optimize_model, which enables the block swap; Qwen-Image: after load_dit_model)
            hook = "optimize_model" if isinstance(arch, Flux) else "load_dit_model"
            real_hooked = getattr(gen_module, hook)

            def loaded(*a, **kw):
                ret = real_hooked(*a, **kw)
                observe([a[0] if ret is None else ret])
                reset_stats(result.offloaders)
                return ret
            patches.append((gen_module, hook, loaded))
            with patched(*patches):
                for i, prompt in enumerate(prompts):
                    prompt_args = gen_module.apply_overrides(args, {"prompt": prompt})
                    if "model" in shared_models:
                        reset_stats(result.offloaders)
                    if isinstance(arch, Flux):
                        text = {"prompt": prompt, "t5_vec": _embed(prompt, 1, 6, 4096),
                                "clip_l_pooler": _embed(prompt + "/clip", 1, 768)}
                        image = {"height": RES, "width": RES, "control_latent": None}
                        _, latent = gen_module.generate(prompt_args, gen_settings, shared_models,
                                                        image, text)
                    else:
                        def ctx(p):
                            return {"prompt": p, "embed": _embed(p, 1, 6, 3584),
                                    "mask": torch.ones(1, 6)}
                        text = {"context": ctx(prompt), "context_null": ctx("blurry")}
                        _, latent = gen_module.generate(prompt_args, gen_settings, shared_models,
                                                        text)
                    result.add(f"sample{i}", latent)
                    result.sample_h2d.append(h2d(result.offloaders))
    finally:
        if state.residency:
            for r in state.residency:
                r.remove()
        _reset_accelerate()
    result.off_during_pass = (any(r.some_block_was_off() for r in state.residency)
                              if state.residency else None)
    return result


# ---------------------------------------------------------------------------- comparison

def compare(base, swap):
    """(max abs difference over everything, [names that differ or are missing])."""
    worst, differ = 0.0, []
    for name in sorted(set(base.values) | set(swap.values)):
        a, b = base.values.get(name), swap.values.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            differ.append(f"{name}: only in one run or of another shape/dtype")
            worst = float("inf")
            continue
        if not torch.equal(a, b):
            d = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            d = d if d == d else float("inf")   # NaN
            differ.append(f"{name}: max abs diff {d:.3g}")
            worst = max(worst, d)
    return worst, differ


def freeze_gc():
    """Shim 7 of the module docstring."""
    gc.collect()
    gc.freeze()


def unfreeze_gc():
    gc.unfreeze()
