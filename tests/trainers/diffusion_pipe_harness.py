"""Runs tdrussell/diffusion-pipe's own Wan, Flux and Qwen-Image code on the CPU, as its train.py
drives it, with and without blockswap: the harness behind test_diffusion_pipe.py.

diffusion-pipe's sources come from the extracted tree (scripts/fetch-trainers; the commit is in
tests/trainers/COMMITS) and are imported from there, never copied: `models.wan.wan`,
`models.wan.model`, `models.flux`, `models.qwen_image`, `models.base`, `utils.offloading`,
`utils.pipeline` (its ManualPipelineModule, a deepspeed PipelineModule), `utils.common`,
`utils.isolate_rng`.

How train.py is followed (line numbers at 8f83dbf)
--------------------------------------------------
- `common.AUTOCAST_DTYPE` is set before the model modules are imported (train.py:287), so their
  `@torch.autocast('cuda', dtype=AUTOCAST_DTYPE)` decorators see the model dtype.
- the transformer is loaded, `configure_adapter` makes the peft LoRA (models/base.py:272-300),
  then, for K > 0, `PipelineModule.to` is made a no-op and `model.enable_block_swap(K)` runs
  (train.py:575-583); `model.to_layers()` (train.py:585) go into diffusion-pipe's
  `ManualPipelineModule` (deepspeed's PipelineModule; with one stage it calls the layers in
  order), with `activation_checkpoint_interval=1`,
  `checkpointable_layers=model.checkpointable_layers` and
  `partial(torch.utils.checkpoint.checkpoint, use_reentrant=reentrant)` when checkpointing
  (train.py:586-616); the compile option is `pipeline_model.compile(dynamic=True)`
  (train.py:620-621); the optimizer is AdamW over the trainable parameters, split as
  get_optimizer splits them (weight decay on all but 1-d parameters, train.py:789-813).
- a step is deepspeed's PipelineEngine.train_batch with one micro-batch, done by hand: the
  PipelineModule forward on the features, `model.get_loss_fn()` on its output and the label,
  backward, `optimizer.step()`, `zero_grad(set_to_none=True)`. The engine itself
  (deepspeed.initialize) is not run: its data-parallel gradient reduction
  (deepspeed/runtime/engine.py:2932) turns every `None` gradient into zeros before the step,
  even with one rank, which would hide what the tests look at. So `.grad` is read right after
  backward, and the step is torch.optim.AdamW's, which skips `None` gradients.
- evaluation between steps is train.py's `evaluate` (train.py:230-242):
  `model.prepare_block_swap_inference(disable_block_swap=...)`, the passes under
  `torch.no_grad()` and diffusion-pipe's `isolate_rng()`, then
  `model.prepare_block_swap_training()`. The eval passes run the PipelineModule with the
  model's `prepare_inputs(..., timestep_quantile=q)`, as train.py's eval loader does.
- the inputs are what diffusion-pipe's dataset hands the engine: the model's own
  `prepare_inputs(batch)` on a batch of cached latents / text embeddings (random here), its
  `None`s turned into empty tensors as utils/dataset.py:1273 `split_batch` does.
- not run: train.py's `apply_patches()` (train.py:280, utils/patches.py: peft's fp8 adapter
  casts, HunyuanVideo's text encoder, deepspeed's pipeline schedule and engine internals,
  ComfyUI's Flux blocks; none is on this path, and importing it needs the HunyuanVideo and
  ComfyUI submodules); deepspeed's engine (above); sampling (`CommonPipeline.sample` needs the
  VAE and text encoders).
- `stats()['h2d_bytes']` per step: the offloaders are synchronized before the counters are
  reset and read (a move is counted when it finishes), which changes nothing computed.

The user's change, one line a model (at 8f83dbf)
------------------------------------------------
    models/wan/wan.py:15      from utils.offloading import ModelOffloader
    models/flux.py:17         from utils.offloading import ModelOffloader
    models/qwen_image.py:20   from utils.offloading import ModelOffloader
becomes `from blockswap import ModelOffloader`. The harness does the same by setting the model
module's global `ModelOffloader` (`substitute`) before the pipeline object is built (so its
dummy offloader, models/wan/wan.py:76, models/flux.py:168-169, models/qwen_image.py:193, is
blockswap's too) and before `enable_block_swap`.

What is bypassed (the pipeline classes' loaders need checkpoints)
-----------------------------------------------------------------
- Wan: `WanPipeline.__init__` (models/wan/wan.py:73-212: T5, VAE and CLIP checkpoints, the
  variant detected from the checkpoint's config.json) is not run: the object is made with
  `__new__` and given what __init__ sets for a t2v model (config, model_config, the dummy
  offloader built as __init__ builds it, cache_text_embeddings, t_dist from diffusion-pipe's
  `get_t_distribution`, model_type, json_config, transformer_path). `load_diffusion_model()`
  (models/wan/wan.py:214) IS run, on a tiny random WanModel saved to a safetensors file (its
  `WanModelFromSafetensors.from_pretrained` path).
- Flux: `FluxPipeline.__init__` (models/flux.py:165-219) is run as it is, with
  `diffusers.FluxTransformer2DModel.from_pretrained` returning a tiny random transformer and
  `diffusers.FluxPipeline.from_pretrained` a diffusers FluxPipeline that holds only that
  transformer (no VAE, text encoders, tokenizers, scheduler).
- Qwen-Image: `QwenImagePipeline.__init__` (models/qwen_image.py:190-245: tokenizer, processor,
  Qwen2.5-VL text encoder and VAE from files, some missing from the extracted tree) is not run:
  the object is made with `__new__` and given config, model_config, the dummy offloader and a
  diffusers QwenImagePipeline with no components. `load_diffusion_model()`
  (models/qwen_image.py:247) IS run, in a temporary folder holding a tiny
  `configs/qwen_image/transformer/config.json` (it reads the config by that relative path) and
  a safetensors file of a tiny random transformer.
- Random weights: every parameter gets a small random offset, so that the zero-initialized
  heads and gates (Wan's head, diffusers' zero-init projections) pass gradients to every LoRA.

Shims (every one, and why)
--------------------------
1. `comfy`, `comfy.utils`, `comfy.sd`, `comfy.sd1_clip`, `comfy.model_management`,
   `comfy_api`, `comfy_api.latest`: empty stand-ins. models/base.py:8 puts
   submodules/ComfyUI on sys.path and imports these at lines 24-29 (and patches
   `comfy.sd1_clip` classes at lines 502 and 527); the submodule is not extracted, and only
   ComfyPipeline (not Wan, Flux or Qwen-Image) calls them.
2. `torchvision`, `torchvision.transforms`, `torchaudio`: empty stand-ins, only where no working
   one is installed. models/base.py:12-18 and models/wan/clip.py:9 import them for media
   preprocessing and CLIP only. PyPI has no CPU build of torchvision for this torch (2.13, CPU):
   its torchvision 0.28.0 is a CUDA build that cannot load here.
   Stand-ins 1-2 are in sys.modules only while diffusion-pipe's modules are imported, and
   taken out again (the modules keep their references).
3. deepspeed's shared-memory all-reduce op: `deepspeed.comm.torch.build_shm_op` returns None.
   deepspeed's CPU accelerator JIT-compiles that C++ op (~80 s on 2 cores) when its backend
   starts; a single process never all-reduces through it.
4. `deepspeed.init_distributed(dist_backend='gloo')`, world size 1 on a free local port, and
   LOCAL_RANK=0 in the environment while the PipelineModule is built (deepspeed's launcher
   sets it): deepspeed's PipelineModule and diffusion-pipe's `is_main_process()` need
   deepspeed.comm. `unload()` (the test module's teardown) destroys the process group again.
5. Wan's attention: `models.wan.model.flash_attention` (models/wan/attention.py:19) asserts a
   CUDA device and needs flash-attn; it is replaced by the same computation (keys past
   `k_lens` masked per batch element) with torch's scaled_dot_product_attention, in float32.
6. Qwen-Image's RoPE call: diffusion-pipe's InitialLayer (models/qwen_image.py:546) calls
   `pos_embed(img_shapes, txt_seq_lens, device=...)` with the list of text lengths (the API of
   diffusers <= 0.35); diffusers 0.42's QwenEmbedRope takes `max_txt_seq_len`, an int, and its
   second positional parameter is now `device`. The transformer's `pos_embed` gets a forward
   pre-hook that passes the list's max as `max_txt_seq_len`.
7. CUDA hard-coded as the device: (a) blockswap's ModelOffloader is given through
   `EmulatedModelOffloader`, which maps `torch.device('cuda')` (models/wan/wan.py:76,394,
   models/flux.py:168-169,423,426, models/qwen_image.py:193,499) to `torch.device('cpu')`,
   blockswap's emulated device; (b) `transformer.to('cuda')` in `enable_block_swap`
   (models/wan/wan.py:397, models/flux.py:430, models/qwen_image.py:502) runs with
   `nn.Module.to` mapping 'cuda' to 'cpu' (`cuda_is_cpu`); (c) Wan's `t_dist` is made on the CPU
   (models/wan/wan.py:78 puts it on 'cuda'); (d) `torch.autocast('cuda', ...)` (the layers'
   decorators, the loss) is off on a machine without CUDA: the runs are float32 throughout.
8. `torch.cuda.current_device` returns 0 while diffusion-pipe's modules are imported:
   models/wan/t5.py:547 calls it for a default argument of T5EncoderModel.__init__ (never
   called here), which raises on a torch without CUDA.

Also here: diffusers' own QwenImageTransformer2DModel trained with hook_blocks=True offloaders
(`diffusers_qwen`, `hook_blocks_offloaders`, `train_diffusers`), for test_diffusion_pipe.py's
diffusers tests.
"""

import contextlib
import dataclasses
import functools
import importlib
import importlib.machinery
import importlib.util
import json
import math
import os
import socket
import sys
import types
from unittest import mock
import warnings

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

_STATE = {}

# The model dtype of the configs: float32 (autocast('cuda') is off on the CPU, so the LoRA, the
# base weights and the activations must share one dtype).
DTYPE = torch.float32
STEPS = 3
LR = 1e-2
WEIGHT_DECAY = 0.1
LORA_RANK = 4


# ---------------------------------------------------------------------------------------------
# Loading diffusion-pipe's modules (shims 1-4)
# ---------------------------------------------------------------------------------------------

def _stub(name, **attrs):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.__dict__.update(attrs)
    module.__blockswap_stub__ = True
    return module


def _imports(name):
    """Whether `name` imports (a CUDA build of torchvision on this CPU torch does not: its
    partly imported modules are taken out again)."""
    if importlib.util.find_spec(name.split(".")[0]) is None:
        return False
    try:
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001
        top = name.split(".")[0]
        for loaded in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[loaded]
        return False


def _stand_ins():
    """Shims 1 and 2: modules diffusion-pipe imports at the top of models/base.py and
    models/wan/clip.py that Wan, Flux and Qwen-Image never call."""
    class _Anything:
        def __init__(self, *args, **kwargs):
            pass

    mods = {}
    comfy = _stub("comfy")
    for sub in ("utils", "sd", "model_management"):
        mods[f"comfy.{sub}"] = _stub(f"comfy.{sub}")
        setattr(comfy, sub, mods[f"comfy.{sub}"])
    mods["comfy.sd1_clip"] = _stub("comfy.sd1_clip", SD1Tokenizer=type("SD1Tokenizer", (), {}),
                                   ClipTokenWeightEncoder=type("ClipTokenWeightEncoder", (), {}),
                                   gen_empty_tokens=lambda *a, **k: None)
    comfy.sd1_clip = mods["comfy.sd1_clip"]
    mods["comfy"] = comfy
    latest = _stub("comfy_api.latest", InputImpl=_Anything)
    mods["comfy_api"] = _stub("comfy_api", latest=latest)
    mods["comfy_api.latest"] = latest
    if not _imports("torchvision.transforms"):
        transforms = _stub("torchvision.transforms", Compose=_Anything, ToTensor=_Anything)
        mods["torchvision"] = _stub("torchvision", transforms=transforms)
        mods["torchvision.transforms"] = transforms
    if not _imports("torchaudio"):
        mods["torchaudio"] = _stub("torchaudio")
    return mods


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_deepspeed():
    """Shims 3 and 4."""
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    from deepspeed import comm as dist

    # (`import deepspeed.comm.torch as x` would bind torch itself: deepspeed.comm has `torch`.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if not dist.is_initialized():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                                       init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                       world_size=1)


@contextlib.contextmanager
def _local_rank():
    """Shim 4: LOCAL_RANK=0 while deepspeed's PipelineModule is built (it reads the variable
    deepspeed's launcher sets); unset again after, since accelerate (musubi-tuner's harness, in
    the same process) takes a LOCAL_RANK for a distributed launch."""
    had = "LOCAL_RANK" in os.environ
    os.environ.setdefault("LOCAL_RANK", "0")
    try:
        yield
    finally:
        if not had:
            del os.environ["LOCAL_RANK"]


def unload():
    """Ends what load() started that other code in the process could see: deepspeed's (and
    torch.distributed's) process group. The modules stay imported; load() starts it again."""
    import torch.distributed
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.modules["deepspeed.comm.comm"].cdb = None
    _STATE.pop("dp", None)


def load(root):
    """Imports diffusion-pipe's modules from its extracted tree `root` (once a process):
    returns a namespace of them."""
    if "dp" in _STATE:
        return _STATE["dp"]
    root = str(root)
    # The libraries first, so that they see the real environment, never a stand-in.
    import diffusers  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401
    _init_deepspeed()
    # diffusion-pipe's `models` and `utils` are namespace packages (no __init__.py): a regular
    # package of that name anywhere on sys.path would win over them (musubi-tuner's harness puts
    # src/musubi_tuner, which has a `utils` package, there). They are registered from the tree.
    for name in ("models", "utils"):
        loaded = sys.modules.get(name)
        if loaded is None:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [os.path.join(root, name)]
            sys.modules[name] = importlib.util.module_from_spec(spec)
        elif not str(next(iter(getattr(loaded, "__path__", [])), "")).startswith(root):
            raise RuntimeError(f"a module named {name!r} from elsewhere is already imported "
                               f"({loaded!r}); diffusion-pipe's must import as {name!r}")
    if root not in sys.path:
        sys.path.insert(0, root)
    stand_ins = _stand_ins()
    saved = {name: sys.modules.get(name) for name in stand_ins}
    saved_path = list(sys.path)
    sys.modules.update(stand_ins)
    try:
        import utils.common as common
        common.AUTOCAST_DTYPE = DTYPE  # train.py:287, before the model modules are imported
        with warnings.catch_warnings(), \
                mock.patch.object(torch.cuda, "current_device", lambda: 0):  # shim 8
            warnings.simplefilter("ignore")
            import models.base as base
            import models.flux as flux
            import models.qwen_image as qwen_image
            import models.wan.model as wan_model
            import models.wan.wan as wan
        import utils.isolate_rng as isolate_rng
        import utils.offloading as offloading
        import utils.pipeline as pipeline
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        sys.path[:] = saved_path  # models/base.py:8 added submodules/ComfyUI
    wan_model.flash_attention = cpu_flash_attention  # shim 5
    dp = types.SimpleNamespace(root=root, common=common, base=base, wan=wan,
                               wan_model=wan_model, flux=flux, qwen_image=qwen_image,
                               offloading=offloading, pipeline=pipeline,
                               isolate_rng=isolate_rng)
    _STATE["dp"] = dp
    return dp


# ---------------------------------------------------------------------------------------------
# Shims 5-7
# ---------------------------------------------------------------------------------------------

def cpu_flash_attention(q, k, v, q_lens=None, k_lens=None, dropout_p=0.0, softmax_scale=None,
                        q_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
                        dtype=torch.bfloat16, version=None):
    """Shim 5: models/wan/attention.py's flash_attention (varlen flash-attn, CUDA only) with
    torch's SDPA: q [B, Lq, N, C], k and v [B, Lk, N, C]; keys at or past k_lens[b] masked,
    queries past q_lens[b] zero (flash-attn leaves them out)."""
    assert dropout_p == 0.0 and not causal and tuple(window_size) == (-1, -1)
    b, lq, lk = q.size(0), q.size(1), k.size(1)
    if q_scale is not None:
        q = q * q_scale
    qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
    mask = None
    if k_lens is not None:
        mask = (torch.arange(lk, device=k.device)[None, :] <
                k_lens.to(k.device)[:, None]).view(b, 1, 1, lk)
    x = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=softmax_scale)
    x = x.transpose(1, 2)
    if q_lens is not None:
        keep = torch.arange(lq, device=q.device)[None, :] < q_lens.to(q.device)[:, None]
        x = x * keep.view(b, lq, 1, 1)
    return x.type(q.dtype)


def _max_txt_seq_len(module, args, kwargs):
    """Shim 6: diffusion-pipe passes the list of text lengths where diffusers 0.42 wants one."""
    if len(args) == 2 and isinstance(args[1], (list, tuple)) and "device" in kwargs:
        return (args[0],), dict(kwargs, max_txt_seq_len=max(args[1]))
    return args, kwargs


def _cuda_to_cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


@contextlib.contextmanager
def cuda_is_cpu():
    """Shim 7b: nn.Module.to('cuda') moves to the CPU while this is open."""
    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        args = tuple(_cuda_to_cpu(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cuda_to_cpu(kwargs["device"])
        return original(self, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


def emulated_offloader_class():
    """Shim 7a: blockswap.ModelOffloader with diffusion-pipe's torch.device('cuda') mapped to
    the emulated device, 'cpu'. Keeps every offloader it builds (for stats())."""
    import blockswap

    class EmulatedModelOffloader(blockswap.ModelOffloader):
        built = []

        def __init__(self, block_type, blocks, num_blocks, blocks_to_swap, supports_backward,
                     device, *args, **kwargs):
            super().__init__(block_type, blocks, num_blocks, blocks_to_swap, supports_backward,
                             _cuda_to_cpu(device), *args, **kwargs)
            EmulatedModelOffloader.built.append(self)

    return EmulatedModelOffloader


@contextlib.contextmanager
def substitute(module, offloader_class):
    """The user's one-line change: `from blockswap import ModelOffloader` in the model file,
    done here by setting the model module's global."""
    original = module.ModelOffloader
    module.ModelOffloader = offloader_class
    try:
        yield
    finally:
        module.ModelOffloader = original


# ---------------------------------------------------------------------------------------------
# The models: tiny configs, random weights
# ---------------------------------------------------------------------------------------------

WAN_BLOCKS = 5
FLUX_DOUBLE, FLUX_SINGLE = 4, 7
QWEN_BLOCKS = 5


def _config(kind, checkpointing):
    """The config dict as train.py's set_config_defaults leaves it."""
    model = {"type": kind, "dtype": DTYPE, "guidance": 1.0, "diffusers_path": "unused",
             "ckpt_path": "unused"}
    return {
        "model": model,
        "activation_checkpointing": checkpointing is not None,
        "reentrant_activation_checkpointing": checkpointing == "reentrant",
        "adapter": {"type": "lora", "rank": LORA_RANK, "alpha": LORA_RANK, "dropout": 0.0,
                    "dtype": DTYPE},
        "pipeline_stages": 1,
        "compile": False,
    }


def _save_safetensors(model, path):
    import safetensors.torch
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                str(path))


def wan_json_config():
    return dict(model_type="t2v", patch_size=(1, 2, 2), text_len=8, in_dim=4, dim=32,
                ffn_dim=64, freq_dim=16, text_dim=16, out_dim=4, num_heads=2,
                num_layers=WAN_BLOCKS, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True,
                eps=1e-6)


def build_wan(dp, config, tmp_path):
    wan = dp.wan
    torch.manual_seed(0)
    reference = dp.wan_model.WanModel(**wan_json_config())
    # init_weights() leaves the head's weight and every bias at zero: random, so that every
    # LoRA sees a gradient.
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    weights = tmp_path / "wan_transformer.safetensors"
    _save_safetensors(reference, weights)
    model = wan.WanPipeline.__new__(wan.WanPipeline)
    # What WanPipeline.__init__ (models/wan/wan.py:73-212) sets for a t2v model.
    model.config = config
    model.model_config = config["model"]
    model.offloader = wan.ModelOffloader("dummy", [], 0, 0, True, torch.device("cuda"), False,
                                         debug=False)
    model.cache_text_embeddings = True
    model.t_dist = dp.common.get_t_distribution(model.model_config)  # shim 7c
    model.transformer_path = weights
    model.json_config = dict(wan_json_config(), _class_name="WanModel")
    model.model_type = "t2v"
    model.load_diffusion_model()  # diffusion-pipe's own loader, on the tiny file
    return model


def wan_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    lens = torch.tensor([5, 3])
    return {
        "latents": torch.randn(2, 4, 1, 4, 4, generator=g),
        "mask": None,
        "text_embeddings": torch.randn(2, 5, 16, generator=g),
        "seq_lens": lens,
    }


def build_flux(dp, config, tmp_path):
    import diffusers
    flux = dp.flux
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=FLUX_DOUBLE, num_single_layers=FLUX_SINGLE,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    with torch.no_grad():  # diffusers zero-inits some gates and the output projection
        for p in transformer.parameters():
            p.add_(torch.randn_like(p) * 0.05)

    def transformer_from_pretrained(*args, **kwargs):
        return transformer

    def pipeline_from_pretrained(*args, transformer=None, **kwargs):
        return diffusers.FluxPipeline(scheduler=None, vae=None, text_encoder=None,
                                      tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                      transformer=transformer)

    with mock.patch.object(diffusers.FluxTransformer2DModel, "from_pretrained",
                  transformer_from_pretrained), \
            mock.patch.object(diffusers.FluxPipeline, "from_pretrained", pipeline_from_pretrained):
        model = flux.FluxPipeline(config)  # models/flux.py:165-219, as it is
    return model


def flux_batch(step):
    g = torch.Generator().manual_seed(200 + step)
    return {
        "latents": torch.randn(2, 4, 4, 4, generator=g),
        "clip_embed": torch.randn(2, 32, generator=g),
        "t5_embed": torch.randn(2, 5, 32, generator=g),
        "mask": None,
    }


def qwen_json_config():
    return dict(patch_size=2, in_channels=16, out_channels=4, num_layers=QWEN_BLOCKS,
                attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                axes_dims_rope=(4, 6, 6))


def build_qwen(dp, config, tmp_path):
    import diffusers
    qi = dp.qwen_image
    torch.manual_seed(0)
    reference = diffusers.QwenImageTransformer2DModel(**qwen_json_config())
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / "qwen_image"
    (folder / "configs" / "qwen_image" / "transformer").mkdir(parents=True, exist_ok=True)
    (folder / "configs" / "qwen_image" / "transformer" / "config.json").write_text(
        json.dumps(dict(qwen_json_config(), _class_name="QwenImageTransformer2DModel")))
    weights = folder / "transformer.safetensors"
    _save_safetensors(reference, weights)
    config["model"]["transformer_path"] = str(weights)
    model = qi.QwenImagePipeline.__new__(qi.QwenImagePipeline)
    # What QwenImagePipeline.__init__ (models/qwen_image.py:190-246) sets, without its text
    # encoder, VAE, tokenizer and processor.
    model.config = config
    model.model_config = config["model"]
    model.offloader = qi.ModelOffloader("dummy", [], 0, 0, True, torch.device("cuda"), False,
                                        debug=False)
    model.diffusers_pipeline = diffusers.QwenImagePipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    cwd = os.getcwd()
    os.chdir(folder)  # load_diffusion_model reads configs/qwen_image/transformer/config.json
    try:
        model.load_diffusion_model()
    finally:
        os.chdir(cwd)
    model.transformer.pos_embed.register_forward_pre_hook(_max_txt_seq_len, with_kwargs=True)
    return model


def qwen_batch(step):
    g = torch.Generator().manual_seed(300 + step)
    return {
        "latents": torch.randn(2, 4, 1, 4, 4, generator=g),
        # Two captions of different lengths: prepare_inputs pads them and masks the padding.
        "prompt_embeds": [torch.randn(5, 32, generator=g), torch.randn(3, 32, generator=g)],
        "mask": None,
    }


MODELS = {"wan": (build_wan, wan_batch), "flux": (build_flux, flux_batch),
          "qwen_image": (build_qwen, qwen_batch)}


def offloaders_of(model):
    # vars(): WanPipeline.__getattr__ recurses forever on a missing attribute.
    return [o for o in (vars(model).get(name) for name in
                        ("offloader", "offloader_double", "offloader_single")) if o is not None]


# ---------------------------------------------------------------------------------------------
# A training run as train.py makes it
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    losses: list = dataclasses.field(default_factory=list)
    grads: list = dataclasses.field(default_factory=list)      # a dict name -> Tensor|None a step
    evals: list = dataclasses.field(default_factory=list)      # (outputs, losses) an eval pass
    adapters: dict = dataclasses.field(default_factory=dict)   # name -> Tensor after the steps
    h2d_bytes: list = dataclasses.field(default_factory=list)  # blockswap's, a step
    offloaders: list = dataclasses.field(default_factory=list)
    block_swap: tuple = ()


def _h2d_bytes(offloaders):
    """Host-to-device bytes of a step (stats() counts a move when it has finished)."""
    for o in offloaders:
        o.synchronize()
    return sum(o.stats()["h2d_bytes"] for o in offloaders)


def _split(features, label):
    """utils/dataset.py split_batch with one piece: None becomes an empty tensor."""
    def fix(t):
        return t if t is not None else torch.tensor([])
    return tuple(fix(t) for t in features), tuple(fix(t) for t in label)


def _inputs(model, batch, quantile=None, seed=0):
    torch.manual_seed(seed)
    features, label = model.prepare_inputs(batch, timestep_quantile=quantile)
    return _split(features, label)


def _param_groups(parameters):
    """train.py get_optimizer (train.py:789-813): weight decay for all but 1-d parameters."""
    wd = [p for p in parameters if p.ndim != 1]
    no_wd = [p for p in parameters if p.ndim == 1]
    groups = []
    if wd:
        groups.append({"params": wd})
    if no_wd:
        groups.append({"params": no_wd, "weight_decay": 0.0})
    return groups


# Eval passes between steps: (after step, disable_block_swap), train.py's evaluate, with
# eval_before_first_step (step 0) and disable_block_swap_for_eval both ways.
EVALS = ((0, False), (1, True), (2, False))
EVAL_QUANTILES = (0.3, 0.8)


def train(dp, kind, *, blocks_to_swap, checkpointing, tmp_path, offloader_class=None,
          compile=False, compile_backend=None, steps=STEPS, evals=EVALS):
    """Builds the tiny `kind` model, trains its LoRA for `steps` steps as train.py does, with
    eval passes between steps; with blocks_to_swap > 0, through `offloader_class` (blockswap's)
    substituted in the model file. Returns a Run."""
    build, make_batch = MODELS[kind]
    tmp_path.mkdir(parents=True, exist_ok=True)
    module = {"wan": dp.wan, "flux": dp.flux, "qwen_image": dp.qwen_image}[kind]
    config = _config(kind, checkpointing)
    config["compile"] = compile
    import deepspeed
    with contextlib.ExitStack() as stack:
        if offloader_class is not None:
            stack.enter_context(substitute(module, offloader_class))
        model = build(dp, config, tmp_path)
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.configure_adapter(config["adapter"])  # peft LoRA, models/base.py
        run = Run()
        if blocks_to_swap:
            # train.py:575-583
            stack.enter_context(mock.patch.object(deepspeed.pipe.PipelineModule, "to",
                                         lambda self, *a, **k: None))
            with cuda_is_cpu():
                model.enable_block_swap(blocks_to_swap)
            run.block_swap = tuple(o.blocks_to_swap for o in offloaders_of(model))
        layers = model.to_layers()
        kwargs = {}
        if checkpointing is not None:
            kwargs = dict(activation_checkpoint_interval=1,
                          checkpointable_layers=model.checkpointable_layers,
                          activation_checkpoint_func=functools.partial(
                              torch.utils.checkpoint.checkpoint,
                              use_reentrant=checkpointing == "reentrant"))
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), \
                _local_rank():
            pipeline_model = dp.pipeline.ManualPipelineModule(
                layers=layers, num_stages=1, partition_method="parameters",
                manual_partition_split=[len(layers) / 1], loss_fn=model.get_loss_fn(),
                dynamic_shape=True, **kwargs)
        pipeline_model._precompute_checkpointable_values()  # PipelineEngine.__init__ does it
        model.pipeline_model = pipeline_model
        named = [(n, p) for n, p in pipeline_model.named_parameters() if p.requires_grad]
        if compile:
            # train.py:620-621; compile_backend: None is torch's default (inductor)
            torch._dynamo.reset()
            pipeline_model.compile(dynamic=True, **(
                {"backend": compile_backend} if compile_backend else {}))
        optimizer = torch.optim.AdamW(_param_groups([p for _, p in named]), lr=LR,
                                      weight_decay=WEIGHT_DECAY)
        offloaders = [o for o in offloaders_of(model) if hasattr(o, "stats")]
        run.offloaders = offloaders
        evals = dict(evals)

        def evaluate(step):
            model.prepare_block_swap_inference(disable_block_swap=evals[step])
            pipeline_model.eval()
            outputs, losses = [], []
            with torch.no_grad(), dp.isolate_rng.isolate_rng():
                torch.manual_seed(0)
                for q in EVAL_QUANTILES:
                    features, label = _inputs(model, make_batch(50), quantile=q, seed=7)
                    out = pipeline_model(features)
                    outputs.append(out.detach().clone())
                    losses.append(pipeline_model.loss_fn(out, label).detach().clone())
            model.prepare_block_swap_training()
            run.evals.append((outputs, losses))

        for step in range(steps):
            if step in evals:
                evaluate(step)
            pipeline_model.train()
            for o in offloaders:  # moves still in flight are counted where they finish
                o.synchronize()
                o.reset_stats()
            features, label = _inputs(model, make_batch(step), seed=10 + step)
            out = pipeline_model(features)
            _step(run, pipeline_model.loss_fn(out, label), named, optimizer, offloaders)
        if steps in evals:
            evaluate(steps)
        run.adapters = {n: p.detach().clone() for n, p in named}
        for o in offloaders:
            o.close()
    return run


# ---------------------------------------------------------------------------------------------
# Comparing two runs
# ---------------------------------------------------------------------------------------------

def max_diff(a, b):
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def compare(expected, got):
    """Every difference between two Runs: (problems, max abs difference). Bitwise equality is
    required; a None gradient must stay None."""
    problems, worst = [], 0.0

    def check(what, a, b):
        nonlocal worst
        if a is None or b is None:
            if (a is None) != (b is None):
                problems.append(f"{what}: .grad is {'None' if a is None else 'a tensor'} "
                                f"without blockswap, "
                                f"{'None' if b is None else 'a tensor'} with it"
                                + ("" if b is None else
                                   f" (max |grad| {b.abs().max().item():.3g})"))
            return
        if not torch.equal(a, b):
            d = max_diff(a, b)
            worst = max(worst, d)
            problems.append(f"{what}: max abs difference {d:.3g}")

    for i, (a, b) in enumerate(zip(expected.losses, got.losses)):
        check(f"loss step {i}", a, b)
    for i, (ga, gb) in enumerate(zip(expected.grads, got.grads)):
        for name in ga:
            check(f"grad step {i} {name}", ga[name], gb.get(name))
    for i, ((oa, la), (ob, lb)) in enumerate(zip(expected.evals, got.evals)):
        for j, (a, b) in enumerate(zip(oa, ob)):
            check(f"eval {i} output {j}", a, b)
        for j, (a, b) in enumerate(zip(la, lb)):
            check(f"eval {i} loss {j}", a, b)
    for name in expected.adapters:
        check(f"adapter after {len(expected.losses)} AdamW steps {name}",
              expected.adapters[name], got.adapters.get(name))
    if len(expected.losses) != len(got.losses) or len(expected.evals) != len(got.evals):
        problems.append("the runs made different numbers of steps or eval passes")
    return problems, worst


def max_abs_difference(expected, got):
    """The largest difference over losses, gradients, eval outputs and adapters (None-ness
    aside)."""
    return compare(expected, got)[1]


def summarize(problems, limit=12):
    head = problems[:limit]
    more = len(problems) - len(head)
    return "\n  ".join(head) + (f"\n  ... and {more} more" if more > 0 else "")


# ---------------------------------------------------------------------------------------------
# diffusers' own QwenImageTransformer2DModel (its forward loops over the blocks itself):
# blockswap with hook_blocks=True, as docs/python.md shows it
# ---------------------------------------------------------------------------------------------

QWEN_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                     "add_v_proj", "to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
                     "txt_mlp.net.0.proj", "txt_mlp.net.2", "img_mod.1", "txt_mod.1"]


def diffusers_qwen(gradient_checkpointing=False):
    """A tiny diffusers QwenImageTransformer2DModel, random weights, a peft LoRA through
    diffusers' own add_adapter (base weights frozen, LoRA trainable)."""
    import diffusers
    import peft
    torch.manual_seed(0)
    model = diffusers.QwenImageTransformer2DModel(**qwen_json_config())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.requires_grad_(False)
    torch.manual_seed(1)
    model.add_adapter(peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK,
                                      target_modules=QWEN_LORA_TARGETS))
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    return model


def diffusers_qwen_inputs(step):
    """Two captions of 5 and 3 tokens: the second padded, `encoder_hidden_states_mask` zero on
    its padding."""
    g = torch.Generator().manual_seed(400 + step)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.int64)
    return dict(hidden_states=torch.randn(2, 4, 16, generator=g),
                encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
                encoder_hidden_states_mask=mask,
                timestep=torch.rand(2, generator=g),
                img_shapes=[[(1, 2, 2)], [(1, 2, 2)]]), torch.randn(2, 4, 16, generator=g)


def hook_blocks_offloaders(model, blocks_to_swap):
    """docs/python.md, "diffusers' classes": one offloader a block list, hook_blocks=True, one
    open_device for the model's lists (the emulated device, 'cpu')."""
    import blockswap
    device = blockswap.open_device("cpu")
    blocks = list(model.transformer_blocks)
    return [blockswap.ModelOffloader("transformer_blocks", blocks, len(blocks), blocks_to_swap,
                                     True, torch.device("cpu"), False, shared_device=device,
                                     hook_blocks=True)]


def _step(run, loss, named, optimizer, offloaders):
    """backward, then what a step leaves (the loss, each gradient right after backward, None
    where there is none), the optimizer's step, and the bytes the offloaders moved."""
    loss.backward()
    run.losses.append(loss.detach().clone())
    run.grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in named})
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    run.h2d_bytes.append(_h2d_bytes(offloaders))


def train_diffusers(model, offloaders=(), steps=STEPS, eval_after=(1,)):
    """LoRA training of a diffusers model whose forward runs the blocks: loss, gradients right
    after backward, AdamW with weight decay, an eval pass after the steps in `eval_after`
    (docs/python.md, "An eval pass in the middle of training"). Returns a Run."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(_param_groups([p for _, p in named]), lr=LR,
                                  weight_decay=WEIGHT_DECAY)
    run = Run(offloaders=list(offloaders))
    for step in range(steps):
        for o in offloaders:  # moves still in flight are counted where they finish
            o.synchronize()
            o.reset_stats()
            o.prepare_block_devices_before_forward()
        inputs, target = diffusers_qwen_inputs(step)
        out = model(**inputs).sample
        _step(run, F.mse_loss(out, target), named, optimizer, offloaders)
        if step in eval_after:
            for o in offloaders:
                o.set_forward_only(True)
                o.prepare_block_devices_before_forward()
            model.eval()
            with torch.no_grad():
                inputs, target = diffusers_qwen_inputs(50)
                out = model(**inputs).sample
                run.evals.append(([out.clone()], [F.mse_loss(out, target)]))
            model.train()
            for o in offloaders:
                o.set_forward_only(False)
                o.prepare_block_devices_before_forward()
    run.adapters = {n: p.detach().clone() for n, p in named}
    return run


def unused_text_stream_lora(names, num_blocks=QWEN_BLOCKS):
    """The LoRA tensors of the last block that feed only its text-stream output, which the
    model discards (its output is norm_out/proj_out of hidden_states alone)."""
    last = f"transformer_blocks.{num_blocks - 1}."
    return sorted(n for n in names if last in n and any(
        f"{t}.lora_" in n for t in ("to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")))
