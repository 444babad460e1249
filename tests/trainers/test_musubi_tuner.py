"""kohya-ss/musubi-tuner's own training and generate scripts, with blockswap.ModelOffloader
substituted the way a user would (one import: see musubi_harness.py, whose docstring lists what
runs as musubi's own code, the user's change, every shim and why, and what is still written
here), compared bitwise against the same musubi-tuner scripts without block swap.

Every test asserts the correct behaviour: the run with blockswap gives the very same losses,
LoRA gradients, LoRA weights after AdamW steps (the file musubi saves) and sampled latents
(torch.equal; the message gives the max abs differences), and its swapped blocks really moved
(h2d bytes > 0 in every step or pass that swaps) and really were off the device
(offloader.is_resident).

Run: PYTHONPATH=build/python .venv/bin/python -m pytest -q tests/trainers/test_musubi_tuner.py
(-s prints a table: model, mode, K, max abs difference, h2d bytes per step.)
"""
import pytest
import torch

import musubi_harness as H

blockswap = pytest.importorskip(
    "blockswap", reason="blockswap is not importable: build it, and run with PYTHONPATH=build/python")

WAN_N = 6       # Wan 2.1 / 2.2: K = 1, N//2, N-1
QWEN_N = 4      # Qwen-Image (--num_layers 4): K = 1, N//2, N-1
# FLUX: 4 double + 8 single blocks; enable_block_swap(K) swaps (K//2, (K-K//2)*2+1) of them, and
# musubi refuses K beyond 4 here (each list at most N-2): K = 1 -> (0, 3), 2 -> (1, 3), 4 -> (2, 5).
# Wan 2.2's two experts: --timestep_boundary 500 with --seed 1 gives the experts low, high, high,
# low over the 4 steps (asserted), so swap_high_low_weights exchanges them twice.
EXPERTS = [False, True, True, False]
WAN22 = dict(steps=4, high_low=True, seed=1)

_REPORT = []


# ------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def mt(trainer_root):
    """musubi-tuner's scripts, with blockswap.ModelOffloader in place of its own."""
    mt = H.load_musubi(trainer_root("musubi-tuner"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # the emulated device's copy thread gets the other core
    H.freeze_gc()
    try:
        with pytest.MonkeyPatch.context() as mp, H.tiny_models(mt):
            # The user's change (musubi_harness.py docstring): create_offloader reads this name.
            mp.setattr(mt.cou, "ModelOffloader", blockswap.ModelOffloader)
            yield mt
    finally:
        torch.set_num_threads(threads)
        H.unfreeze_gc()
    if _REPORT:
        print("\n\nmusubi-tuner with blockswap, against musubi-tuner without block swap:")
        print(f"{'model':<11} {'mode':<50} {'K':>3} {'max abs diff':>13}  h2d bytes per step/pass")
        for row in _REPORT:
            print(f"{row[0]:<11} {row[1]:<50} {row[2]:>3} {row[3]:>13}  {row[4]}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """data(name) -> the folder of that architecture's DiT file(s), caches and dataset config,
    written once; each run writes its outputs in a folder of its own under it."""
    dirs = {}

    def get(name):
        if name not in dirs:
            dirs[name] = tmp_path_factory.mktemp(f"musubi-{name}")
        return dirs[name]
    return get


def _arch(mt, name):
    if name == "wan21":
        return H.Wan(mt, WAN_N, "2.1")
    if name == "wan22":
        return H.Wan(mt, WAN_N, "2.2")
    if name == "flux":
        return H.Flux(mt)
    if name == "qwen":
        return H.Qwen(mt, QWEN_N)
    raise ValueError(name)


_BASELINES = {}


def _baseline(run, mt, data, name, **kw):
    """The run without block swap (no --blocks_to_swap: musubi-tuner's scripts alone), once per
    configuration."""
    key = (run.__name__, name, tuple(sorted(kw.items())))
    if key not in _BASELINES:
        _BASELINES[key] = run(mt, _arch(mt, name), 0, data(name), **kw)
    return _BASELINES[key]


def _baseline_train(mt, data, name, **kw):
    return _baseline(H.train, mt, data, name, **kw)


def _baseline_generate(mt, data, name, **kw):
    return _baseline(H.generate, mt, data, name, **kw)


def _check(arch, mode, k, base, swap, *, training=True):
    """Exact, and bytes moved, and blocks off the device; a row for the table either way."""
    worst, differ = H.compare(base, swap)
    swapping = H.swapped(swap.offloaders)
    steps = swap.h2d_per_step if training else swap.sample_h2d
    per = ", ".join(str(b) for b in steps)
    if swap.sample_h2d and training:
        per += "; sampling: " + ", ".join(str(b) for b in swap.sample_h2d)
    _REPORT.append((arch.name, mode, k, "exact" if not differ else f"{worst:.3g}", per))
    problems = []
    if differ:
        problems.append(f"{len(differ)} of {len(base.values)} values differ from musubi-tuner "
                        "without block swap: " + "; ".join(differ[:8]))
    if not swapping:
        problems.append(f"no offloader swaps anything (blocks_to_swap of each: "
                        f"{[o.blocks_to_swap for o in swap.offloaders]})")
    if any(b <= 0 for b in steps):
        problems.append(f"h2d bytes per {'step' if training else 'pass'}: {steps} (each must "
                        "be > 0)")
    if any(b <= 0 for b in swap.sample_h2d):
        problems.append(f"h2d bytes per sampling pass: {swap.sample_h2d} (each must be > 0)")
    if swapping and not all(swap.off_after_prepare):
        problems.append(f"blocks off the device after prepare, per swapping offloader: "
                        f"{swap.off_after_prepare} (each list must be non-empty)")
    for i, (off_prepare, off_during) in enumerate(swap.off_during_sampling):
        if not (off_during and all(off_prepare)):
            problems.append(f"sampling {i}: swapped blocks off the device after "
                            f"switch_block_swap_for_inference: {off_prepare}; some block off "
                            f"during the pass: {off_during}")
    if swap.off_during_pass is False:
        problems.append("every block was resident at every block's start during the pass")
    assert not problems, f"{arch.name} {mode} K={k}:\n  " + "\n  ".join(problems)


GC = {"none": {}, "gc": dict(gradient_checkpointing=True),
      "gc+cpu_offload": dict(gradient_checkpointing=True, cpu_offload=True)}


# ------------------------------------------------------------------------------ training

@pytest.mark.parametrize("name,k,gc", [
    *[("wan21", k, gc) for k in (1, WAN_N // 2, WAN_N - 1) for gc in GC],
    *[("flux", k, "none") for k in (1, 2, 4)], ("flux", 2, "gc"), ("flux", 4, "gc+cpu_offload"),
    *[("qwen", k, "none") for k in (1, QWEN_N // 2, QWEN_N - 1)], ("qwen", 2, "gc"),
    ("qwen", 3, "gc+cpu_offload"),
])
def test_lora_training(mt, data, name, k, gc):
    """The training script's main() (trainer_base's order: load, freeze, enable_block_swap(K,
    from_args(supports_backward=True)), move, the LoRA network, gradient checkpointing, AdamW,
    accelerator.prepare, move + prepare_block_swap_before_forward once, train() / eval()), then
    3 steps without another prepare. K = N-1 is what musubi-tuner accepts for Wan and
    Qwen-Image."""
    arch = _arch(mt, name)
    base = _baseline_train(mt, data, name, **GC[gc])
    swap = H.train(mt, arch, k, data(name), **GC[gc])
    _check(arch, f"LoRA training, {gc}", k, base, swap)


@pytest.mark.parametrize("name,k,gc", [
    *[("wan21", k, "none") for k in (1, WAN_N // 2, WAN_N - 1)], ("wan21", 3, "gc"),
    ("flux", 1, "none"), ("flux", 4, "none"), ("qwen", 1, "none"), ("qwen", 3, "gc"),
])
def test_sampling_between_steps(mt, data, name, k, gc):
    """--sample_at_first --sample_every_n_steps 2: trainer_base.sample_images before step 1 and
    after step 2 (switch_block_swap_for_inference, the script's do_inference under no_grad in
    eval mode, several passes with CFG where the script uses it, switch_block_swap_for_training),
    and training goes on."""
    arch = _arch(mt, name)
    base = _baseline_train(mt, data, name, sample=True, **GC[gc])
    swap = H.train(mt, arch, k, data(name), sample=True, **GC[gc])
    assert len(swap.sample_h2d) == 2, f"sampling passes: {len(swap.sample_h2d)} (2 expected)"
    _check(arch, f"LoRA training + sampling between steps, {gc}", k, base, swap)


@pytest.mark.parametrize("k", [1, WAN_N // 2])
def test_fp8_scaled_training(mt, data, k):
    """--fp8_base --fp8_scaled: load_wan_model's fp8 path (load_safetensors_with_lora_and_fp8
    with fp8_optimization, apply_fp8_monkey_patch, load_state_dict(assign=True)) before the
    block swap, then LoRA training on the fp8 base."""
    arch = _arch(mt, "wan21")
    base = _baseline_train(mt, data, "wan21", fp8=True)
    swap = H.train(mt, arch, k, data("wan21"), fp8=True)
    assert any(p.dtype == torch.float8_e4m3fn for p in swap.model.blocks.parameters())
    _check(arch, "LoRA training, fp8 scaled", k, base, swap)


def _experts(run):
    assert run.experts == EXPERTS, (
        f"experts per step (True: high noise): {run.experts}, expected {EXPERTS} -- the seed no "
        "longer gives an expert switch in both directions")


@pytest.mark.parametrize("k", [1, WAN_N // 2])
def test_wan22_expert_switch(mt, data, k):
    """Wan 2.2, two experts (--dit_high_noise): WanNetworkTrainer.load_transformer gives the
    high-noise model its own block swap and keeps its state_dict; call_dit's
    swap_high_low_weights exchanges the experts by state_dict() + load_state_dict(...,
    strict=True, assign=True) on the blocks blockswap holds, without calling prepare again.
    Steps: low, high, high, low."""
    arch = _arch(mt, "wan22")
    base = _baseline_train(mt, data, "wan22", **WAN22)
    swap = H.train(mt, arch, k, data("wan22"), **WAN22)
    _experts(base)
    _experts(swap)
    _check(arch, "LoRA training, expert switch (assign=True)", k, base, swap)


def test_wan22_expert_switch_and_sampling(mt, data):
    """As above, with --sample_at_first --sample_every_n_steps 2: sampling after step 2 (the
    high-noise expert's step), where do_inference switches to the low-noise expert after
    switch_block_swap_for_inference, without a prepare; training goes on (call_dit switches back
    to the high-noise expert) after switch_block_swap_for_training."""
    arch = _arch(mt, "wan22")
    k = WAN_N // 2
    base = _baseline_train(mt, data, "wan22", sample=True, **WAN22)
    swap = H.train(mt, arch, k, data("wan22"), sample=True, **WAN22)
    _experts(swap)
    # sampling at first, after step 2 (the high-noise expert active: do_inference switches to
    # the low-noise one), after step 4 and at the end of epoch 2 (3 cached items, 4 steps)
    assert swap.sample_experts == [False, True, False, False], (
        f"expert active as each sampling began (True: high): {swap.sample_experts}")
    _check(arch, "LoRA training, expert switch + sampling", k, base, swap)


def test_stats_keep_counting_across_an_expert_switch(mt, data):
    """stats()["h2d_bytes"] is a counter that only reset_stats() sets back to 0: across the
    experts' load_state_dict(assign=True), after which blockswap takes the new Parameters,
    it must go on counting, never fall back (a trainer logging bytes per step from
    differences of stats() would log negative bytes)."""
    arch = _arch(mt, "wan22")
    swap = H.train(mt, arch, WAN_N // 2, data("wan22"), cumulative=True, **WAN22)
    _experts(swap)
    c = swap.h2d_cumulative
    assert all(b > a for a, b in zip([0] + c, c)), (
        f"stats()['h2d_bytes'] after each step (low, high, high, low expert; never reset): {c}")


@pytest.mark.parametrize("first,second", [(WAN_N // 2, WAN_N // 2), (1, WAN_N - 1)])
def test_enable_block_swap_twice(mt, data, first, second):
    """enable_block_swap called a second time on the same model (musubi builds a new offloader
    over the same blocks and drops the first): the model must train exactly, through the
    second offloader, with the second K."""
    arch = _arch(mt, "wan21")
    base = _baseline_train(mt, data, "wan21")
    swap = H.train(mt, arch, first, data("wan21"), enable_again_with=second)
    assert [o.blocks_to_swap for o in swap.offloaders] == [second]
    _check(arch, f"LoRA training, enable_block_swap({first}) then ({second})", second, base,
           swap)


# ------------------------------------------------------------------------------ inference

@pytest.mark.parametrize("name,k", [
    *[("wan21", k) for k in (1, WAN_N // 2, WAN_N - 1)], ("flux", 2), ("flux", 4),
    ("qwen", 1), ("qwen", QWEN_N - 1),
])
def test_generate_scripts_order(mt, data, name, k):
    """The generate scripts themselves (wan_generate_video.process_batch_prompts: load_dit_model
    enables the block swap (supports_backward=False), moves and prepares while the weights
    still require grad, and only then eval().requires_grad_(False); two prompts on that model
    with no prepare between them. flux_kontext_generate_image / qwen_image_generate_image:
    generate() twice on one shared model, the second time after the script's move +
    prepare_block_swap_before_forward)."""
    arch = _arch(mt, name)
    base = _baseline_generate(mt, data, name)
    swap = H.generate(mt, arch, k, data(name))
    _check(arch, "inference, generate script", k, base, swap, training=False)


@pytest.mark.parametrize("name,k", [("wan21", WAN_N // 2), ("wan21", WAN_N - 1), ("flux", 4),
                                    ("qwen", QWEN_N - 1)])
def test_generate_frozen_first(mt, data, name, k):
    """Inference with the model frozen before enable_block_swap (not musubi's order): the
    generate script with its loader's model frozen."""
    arch = _arch(mt, name)
    base = _baseline_generate(mt, data, name)
    swap = H.generate(mt, arch, k, data(name), freeze_first=True)
    _check(arch, "inference, frozen before enable_block_swap", k, base, swap, training=False)


@pytest.mark.parametrize("k", [1, WAN_N - 1])
def test_generate_skip_layer_guidance(mt, data, k):
    """wan_generate_video.py --slg_mode original --slg_layers 1,4 (run_sampling): each step a
    third pass with skip_block_indices, in which the skipped blocks are submitted without being
    waited for or run (musubi's Wan forward, lines 889-901)."""
    arch = _arch(mt, "wan21")
    base = _baseline_generate(mt, data, "wan21", slg_layers=(1, 4))
    swap = H.generate(mt, arch, k, data("wan21"), slg_layers=(1, 4))
    _check(arch, "inference, skip-layer guidance (slg 1,4)", k, base, swap, training=False)


@pytest.mark.parametrize("freeze_first", [False, True], ids=["generate-order", "frozen-first"])
def test_fp8_scaled_generate(mt, data, freeze_first):
    """wan_generate_video.py --fp8_scaled: load_wan_model's fp8 path, then the block swap."""
    arch = _arch(mt, "wan21")
    k = WAN_N // 2
    base = _baseline_generate(mt, data, "wan21", fp8=True)
    swap = H.generate(mt, arch, k, data("wan21"), fp8=True, freeze_first=freeze_first)
    assert any(p.dtype == torch.float8_e4m3fn for p in swap.model.blocks.parameters())
    order = "frozen first" if freeze_first else "generate script's order"
    _check(arch, f"inference, fp8 scaled, {order}", k, base, swap, training=False)


# ------------------------------------------------------------- LoRAStreamOffloader's place

@pytest.mark.parametrize("mode", ["training", "inference"])
def test_blockswap_in_place_of_lora_stream_offloader(mt, data, monkeypatch, mode):
    """--block_swap_h2d_only: create_offloader (custom_offloading_utils.py lines 127-139) builds
    LoRAStreamOffloader(block_type, blocks, num_blocks, blocks_to_swap, supports_backward,
    device, ring_size=..., use_pinned_memory=..., debug=...). That class is CUDA-only (it
    asserts device.type == 'cuda'); blockswap.ModelOffloader in its place must accept those
    keywords and train exactly (BlockSwapConfig.from_args requires gradient checkpointing with
    h2d_only in training: --gradient_checkpointing --block_swap_h2d_only --block_swap_ring_size 2
    --use_pinned_memory_for_block_swap). Inference as krea2_generate_image.py (lines 133-143) runs
    it: frozen first, BlockSwapConfig(device, supports_backward=False, h2d_only=True, ...) --
    here wan_generate_video with that BlockSwapConfig."""
    monkeypatch.setattr(mt.cou, "LoRAStreamOffloader", blockswap.ModelOffloader)
    arch = _arch(mt, "wan21")
    k = WAN_N // 2
    if mode == "training":
        base = _baseline_train(mt, data, "wan21", gradient_checkpointing=True)
        swap = H.train(mt, arch, k, data("wan21"), gradient_checkpointing=True, extra_argv=(
            "--block_swap_h2d_only", "--block_swap_ring_size", "2",
            "--use_pinned_memory_for_block_swap"))
        _check(arch, "LoRA training, gc, h2d_only (LoRAStreamOffloader)", k, base, swap)
    else:
        base = _baseline_generate(mt, data, "wan21")
        swap = H.generate(mt, arch, k, data("wan21"), h2d_only=True, pinned=True)
        _check(arch, "inference, h2d_only (LoRAStreamOffloader)", k, base, swap, training=False)
