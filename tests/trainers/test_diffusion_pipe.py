"""tdrussell/diffusion-pipe's own Wan, Flux and Qwen-Image LoRA training, run on the CPU as its
train.py runs it, with blockswap.ModelOffloader substituted for diffusion-pipe's
utils.offloading.ModelOffloader (the one-line change a user makes in the model file), compared
bitwise with the same diffusion-pipe code without block swapping: losses, LoRA gradients
(a `.grad` that is None without blockswap must stay None), the adapters after 3 AdamW steps with
weight decay, and the outputs and losses of the eval passes train.py makes between steps
(`prepare_block_swap_inference(disable_block_swap=...)`, then back to training). Swapped runs
must move bytes (`stats()['h2d_bytes'] > 0` each step).

Also diffusers' own QwenImageTransformer2DModel (a padding `encoder_hidden_states_mask`) with
`hook_blocks=True` offloaders as docs/python.md shows them, and diffusers' regional compilation
(`compile_repeated_blocks(fullgraph=True)`) of a model with hook_blocks offloaders.

How diffusion-pipe is loaded and driven, what is bypassed and every shim: the docstring of
diffusion_pipe_harness.py. Needs scripts/fetch-trainers (else the tests skip, saying so) and
the packages in python/requirements-trainers.txt.

    PYTHONPATH=build/python .venv/bin/python -m pytest -q tests/trainers/test_diffusion_pipe.py
"""

import pytest
import torch

torch.set_num_threads(1)  # tiny models: more threads only contend (10x slower on 2 busy cores)

import blockswap  # noqa: E402

import diffusion_pipe_harness as harness  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

CHECKPOINTING = [None, "non-reentrant", "reentrant"]


def _ids(value):
    return "no-checkpointing" if value is None else str(value)


# K for each model: 1, about N//2, and the largest diffusion-pipe's enable_block_swap accepts.
#   Wan, Qwen-Image: N = 5 blocks; `blocks_to_swap <= num_blocks - 2` (models/wan/wan.py:391,
#     models/qwen_image.py:496): K = 1, 2, 3.
#   Flux: 4 double and 7 single blocks; K total swaps K//2 double and (K - K//2)*2 + 1 single
#     blocks, each at most its list's N - 2 (models/flux.py:412-420): K = 1 (0 double, 3 single),
#     2 (1, 3), 4 (2, 5); K = 5 would ask for 7 single blocks.
KS = {"wan": [1, 2, 3], "flux": [1, 2, 4], "qwen_image": [1, 2, 3]}


def expected_per_list(kind, k):
    if kind == "flux":
        return (k // 2, (k - k // 2) * 2 + 1)
    return (k,)


@pytest.fixture(scope="module")
def dp(trainer_root):
    """diffusion-pipe's modules, imported from its extracted tree (or a skip saying why)."""
    root = trainer_root("diffusion-pipe")
    for name in ("deepspeed", "einops", "easydict", "toml", "imageio", "ftfy"):
        pytest.importorskip(name, reason=f"diffusion-pipe imports {name}: pip install "
                            "--no-build-isolation -r python/requirements-trainers.txt")
    yield harness.load(root)
    harness.unload()  # the process group, which accelerate (musubi-tuner's tests) would see


@pytest.fixture(scope="module")
def runs(dp, tmp_path_factory):
    """Runs by (kind, blocks_to_swap, checkpointing): each made once for the module (the
    references are shared by every K)."""
    cache = {}
    offloader_class = harness.emulated_offloader_class()

    def get(kind, k, checkpointing):
        key = (kind, k, checkpointing)
        if key not in cache:
            tmp = tmp_path_factory.mktemp(f"{kind}-{k}-{_ids(checkpointing)}")
            cache[key] = harness.train(dp, kind, blocks_to_swap=k, checkpointing=checkpointing,
                                       tmp_path=tmp,
                                       offloader_class=offloader_class if k else None)
        return cache[key]

    return get


def assert_exact(expected, got, what):
    problems, worst = harness.compare(expected, got)
    assert not problems, (f"{what}: with blockswap differs from diffusion-pipe without block "
                          f"swapping (max abs difference {worst:.3g}):\n  "
                          + harness.summarize(problems))


def assert_bytes_moved(run, what):
    assert run.h2d_bytes and all(b > 0 for b in run.h2d_bytes), (
        f"{what}: blockswap moved no bytes host-to-device in some step: h2d_bytes per step "
        f"{run.h2d_bytes}")


CASES = [(kind, k, c) for kind in ("wan", "flux", "qwen_image") for c in CHECKPOINTING
         for k in KS[kind]]


@pytest.mark.parametrize("kind,k,checkpointing", CASES,
                         ids=[f"{kind}-K{k}-{_ids(c)}" for kind, k, c in CASES])
def test_lora_training_with_eval_between_steps_is_exact(runs, kind, k, checkpointing):
    """train.py's loop: enable_block_swap(K), to_layers() in deepspeed's PipelineModule (with
    train.py's checkpoint function around each layer), LoRA, AdamW with weight decay, eval
    passes between steps with and without disable_block_swap, then prepare_block_swap_training:
    bitwise the run without block swapping."""
    what = f"diffusion-pipe {kind}, K={k}, {_ids(checkpointing)}"
    expected = runs(kind, 0, checkpointing)
    got = runs(kind, k, checkpointing)
    assert got.block_swap == expected_per_list(kind, k), (
        f"{what}: the offloaders swap {got.block_swap} blocks, expected "
        f"{expected_per_list(kind, k)} (diffusion-pipe's enable_block_swap)")
    assert got.offloaders and all(isinstance(o, blockswap.ModelOffloader)
                                  for o in got.offloaders)
    assert_exact(expected, got, what)
    assert_bytes_moved(got, what)


# The last Qwen-Image block's text stream (its encoder_hidden_states output) feeds nothing: the
# FinalLayer (models/qwen_image.py:586-605) reads only hidden_states. The LoRA parameters that feed
# only that output (to_add_out, txt_mlp) get no gradient: `.grad` stays None, and AdamW skips
# them, weight decay included.
UNUSED = ("attn.to_add_out.lora_", "txt_mlp.net.0.proj.lora_", "txt_mlp.net.2.lora_")


def _last_block_unused(names):
    last = f"{harness.QWEN_BLOCKS}.block."  # layer 0 is InitialLayer: block i is layer i + 1
    return sorted(n for n in names if n.startswith(last) and any(u in n for u in UNUSED))


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant"], ids=_ids)
@pytest.mark.parametrize("k", [1, 3])
def test_qwen_image_lora_feeding_only_an_unused_output_keeps_no_gradient(runs, k,
                                                                        checkpointing):
    """Without blockswap the last block's text-stream LoRA has `.grad is None` after every
    backward (reentrant checkpointing gives zeros there without blockswap too, so it is left
    out), so weight decay never moves it; with blockswap it must be the same."""
    expected = runs("qwen_image", 0, checkpointing)
    got = runs("qwen_image", k, checkpointing)
    unused = _last_block_unused(expected.grads[0])
    assert len(unused) == 6, f"the harness expected 6 such LoRA tensors, found {unused}"
    for step, grads in enumerate(expected.grads):
        assert all(grads[n] is None for n in unused), "the reference itself has gradients"
    wrong = [f"step {step} {n}: .grad is a tensor (max |grad| "
             f"{grads[n].abs().max().item():.3g}), None without blockswap"
             for step, grads in enumerate(got.grads) for n in unused if grads[n] is not None]
    moved = [f"{n}: max abs difference "
             f"{harness.max_diff(expected.adapters[n], got.adapters[n]):.3g}"
             for n in unused if not torch.equal(expected.adapters[n], got.adapters[n])]
    assert not wrong and not moved, (
        f"Qwen-Image K={k} {_ids(checkpointing)}: LoRA that feeds only the last block's unused "
        "text output gets gradients with blockswap (weight decay then moves it):\n  "
        + "\n  ".join(wrong + [f"adapter after AdamW: {m}" for m in moved]))


def test_compile_option(dp, tmp_path):
    """train.py's `compile = true`: `pipeline_model.compile(dynamic=True)` over the
    PipelineModule whose layers call the verbs (train.py:620-621): exact against the same
    compiled model without block swapping. One small case: Wan, K=2, 2 steps with an eval pass
    between them, dynamo's "eager" backend (its tracing and graph breaks, no code generator;
    about 10-20 s a run here). torch's default backend, inductor, took 143 s for one 3-step run
    (3 eval passes) on this 2-core machine, and its code is not bitwise the eager model's
    (1e-5), so it is left out. dynamo's defaults are kept: its recompile limit stops compiling
    the TransformerLayer after 8 variants, as in diffusion-pipe with more blocks."""
    offloader_class = harness.emulated_offloader_class()
    common = dict(checkpointing=None, compile=True, compile_backend="eager", steps=2,
                  evals=((1, False),))
    try:
        expected = harness.train(dp, "wan", blocks_to_swap=0, tmp_path=tmp_path / "ref",
                                 **common)
        got = harness.train(dp, "wan", blocks_to_swap=2, tmp_path=tmp_path / "swap",
                            offloader_class=offloader_class, **common)
    finally:
        torch._dynamo.reset()
    assert_exact(expected, got, "diffusion-pipe wan, compile, K=2")
    assert_bytes_moved(got, "diffusion-pipe wan, compile, K=2")


# diffusers' own QwenImageTransformer2DModel, its forward looping over the blocks, with
# hook_blocks=True offloaders (docs/python.md, "Trainers, diffusers' model classes, ...").

@pytest.mark.parametrize("gradient_checkpointing", [False, True],
                         ids=["no-checkpointing", "enable_gradient_checkpointing"])
@pytest.mark.parametrize("k", [1, 3])
def test_diffusers_qwen_image_padding_mask_hook_blocks(k, gradient_checkpointing):
    """A padding encoder_hidden_states_mask, a peft LoRA, AdamW with weight decay, an eval pass
    between steps: exact, and the last block's text-stream LoRA (its output is discarded by the
    model) keeps `.grad is None` as without blockswap."""
    what = f"diffusers QwenImageTransformer2DModel K={k}" + (
        " with gradient checkpointing" if gradient_checkpointing else "")
    expected = harness.train_diffusers(harness.diffusers_qwen(gradient_checkpointing))
    model = harness.diffusers_qwen(gradient_checkpointing)
    offloaders = harness.hook_blocks_offloaders(model, k)
    try:
        got = harness.train_diffusers(model, offloaders)
    finally:
        for o in offloaders:
            o.close()
    unused = harness.unused_text_stream_lora(expected.grads[0])
    assert len(unused) == 6 and all(expected.grads[0][n] is None for n in unused), (
        f"the reference should leave no gradient on {unused}")
    assert_exact(expected, got, what)
    assert_bytes_moved(got, what)


# diffusers' regional compilation, as its docs show it: compile_repeated_blocks(fullgraph=True).

DYNAMO_MESSAGE = "compiler.disable()"  # dynamo: "Skip calling `torch.compiler.disable()`d function"


@pytest.mark.parametrize("order", ["compile-then-offload", "offload-then-compile"])
def test_diffusers_regional_compile_fullgraph(order):
    """Blocks compiled with fullgraph=True and hook_blocks offloaders: either it trains swapped
    and exactly (against the same compiled model without blockswap), or blockswap refuses with
    its own error naming `fullgraph` -- never dynamo's "Skip calling torch.compiler.disable()d
    function" from inside a compiled block. Backend "aot_eager": dynamo and AOTAutograd as
    inductor sees them, without inductor's code generator (minutes on this machine)."""
    compile_kwargs = dict(fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    model = harness.diffusers_qwen()
    offloaders = []
    try:
        if order == "compile-then-offload":
            model.compile_repeated_blocks(**compile_kwargs)
            offloaders = harness.hook_blocks_offloaders(model, 2)
        else:
            offloaders = harness.hook_blocks_offloaders(model, 2)
            model.compile_repeated_blocks(**compile_kwargs)
        got = harness.train_diffusers(model, offloaders, steps=2, eval_after=())
    except Exception as e:  # noqa: BLE001 -- which exception is what the test is about
        message = f"{type(e).__module__}.{type(e).__name__}: {e}"
        assert isinstance(e, blockswap.Error) and "fullgraph" in str(e) and (
            DYNAMO_MESSAGE not in str(e)), (
            "blocks compiled with fullgraph=True under hook_blocks offloaders: expected either an "
            "exact run or blockswap's own error naming fullgraph, got\n" + message[:1500])
        return
    finally:
        for o in offloaders:
            o.close()
        torch._dynamo.reset()
    reference = harness.diffusers_qwen()
    reference.compile_repeated_blocks(**compile_kwargs)
    try:
        expected = harness.train_diffusers(reference, steps=2, eval_after=())
    finally:
        torch._dynamo.reset()
    assert_exact(expected, got, f"compile_repeated_blocks(fullgraph=True), {order}, K=2")
    assert_bytes_moved(got, f"compile_repeated_blocks(fullgraph=True), {order}, K=2")
