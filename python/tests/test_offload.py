"""blockswap.offload, the one line, as a user who read docs/python.md calls it: a diffusers
model (LoRA training and inference) and whole diffusers pipelines (FLUX with CLIP and T5, Wan
with UMT5) within a budget on the emulated device, bitwise equal to the same run without
blockswap, with bytes really moved; the plan, explicit K, the budget that does not fit, and
close() giving back the model as it was."""

import pytest
import torch

import blockswap
from real_models import adapters, base_weights, build, inputs, train
import tiny_pipelines

CPU = torch.device("cpu")


def model_bytes(module):
    return sum(t.numel() * t.element_size() for t in list(module.parameters())
               + list(module.buffers()))


def test_lora_training_through_one_line_is_exact_and_moves_blocks():
    reference, model = build("flux"), build("flux")
    expected = train(reference, "flux")
    # A budget of two thirds of the model: both lists swap, within one budget.
    budget = model_bytes(model) * 2 // 3
    with blockswap.offload(model, device_budget=budget, device="cpu") as handle:
        assert handle.plan.training  # adapters require grad
        names = [x.name for x in handle.plan.lists]
        assert names == ["transformer_blocks", "single_transformer_blocks"]
        assert any(x.blocks_to_swap > 0 for x in handle.plan.lists)
        assert handle.plan.device_bytes <= budget
        got = train(model, "flux")  # no prepare calls: offload's hook does it
        stats = handle.stats()
        moved = sum(stats[n]["h2d_bytes"] for n in handle.offloaders)
        assert moved > 0
        assert handle.device.memory()["peak_device_bytes"] <= budget
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    # After close() the model runs plain, its weights as they were.
    assert all(p.device == CPU for p in model.parameters())
    assert torch.equal(infer_plain(model), infer_plain(reference))


def infer_plain(model):
    with torch.no_grad():
        return model(**inputs("flux", 5), return_dict=False)[0]


def test_inference_of_a_frozen_model_plans_forward_only_and_is_exact():
    reference, model = build("wan", lora=False), build("wan", lora=False)
    budget = blockswap.plan_offload(model, device_budget="1GB",
                                    device="cpu").smallest_budget_bytes
    handle = blockswap.offload(model, device_budget=budget, device="cpu")
    assert handle.plan.lists[0].blocks_to_swap == len(model.blocks) - 1
    assert not handle.plan.training
    for seed in (1, 2):
        with torch.no_grad():
            want = reference(**inputs("wan", seed), return_dict=False)[0]
            got = model(**inputs("wan", seed), return_dict=False)[0]
        assert torch.equal(want, got)
    assert handle.stats()["blocks"]["h2d_bytes"] > 0
    handle.close()
    handle.close()  # twice is fine


def test_the_plan_says_what_it_chose_and_explicit_k_is_kept():
    model = build("flux")
    plan = blockswap.plan_offload(model, device_budget=model_bytes(model) // 2, device="cpu")
    text = str(plan)
    assert "transformer_blocks" in text and "single_transformer_blocks" in text
    assert "swapped" in text and "the smallest that fits" in text
    handle = blockswap.offload(model, device="cpu",
                               blocks_to_swap={"transformer_blocks": 2,
                                               "single_transformer_blocks": 1})
    assert [o.blocks_to_swap for o in handle.offloaders.values()] == [2, 1]
    handle.close()


def test_a_budget_that_cannot_fit_names_itself_and_the_smallest_and_changes_nothing():
    model = build("flux")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(blockswap.OutOfMemoryError) as e:
        blockswap.offload(model, device_budget=1000, device="cpu")
    message = str(e.value)
    assert "device_budget=" in message and "smallest budget that fits" in message
    smallest = blockswap.plan_offload(model, device_budget=10**12,
                                      device="cpu").smallest_budget_bytes
    assert f"({smallest} bytes" in message
    # The smallest is enough.
    blockswap.offload(model, device_budget=smallest, device="cpu").close()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_mistakes_are_errors_that_say_what_to_do():
    model = build("flux")
    with pytest.raises(blockswap.InvalidArgumentError, match="unknown option"):
        blockswap.offload(model, device_budget="1GB", device="cpu", blocks_to_sawp=3)
    with pytest.raises(blockswap.InvalidArgumentError, match="shared_device"):
        blockswap.offload(model, device_budget="1GB", device="cpu",
                          shared_device=blockswap.open_device("cpu"))
    with pytest.raises(blockswap.InvalidArgumentError, match="is not a size"):
        blockswap.offload(model, device_budget="lots", device="cpu")
    with pytest.raises(blockswap.InvalidArgumentError, match="give a dict by list name"):
        blockswap.offload(model, device="cpu", blocks_to_swap=2)
    with pytest.raises(blockswap.InvalidArgumentError, match="not block lists here"):
        blockswap.offload(model, device="cpu", blocks_to_swap={"blocks": 2})
    with pytest.raises(blockswap.InvalidArgumentError, match="no block list"):
        blockswap.offload(torch.nn.Linear(4, 4), device_budget="1GB", device="cpu")
    with pytest.raises(blockswap.InvalidArgumentError, match="needs device_budget"):
        blockswap.offload(model, device="cpu")
    with pytest.raises(blockswap.InvalidArgumentError, match="less than 2"):
        blockswap.offload(model, device_budget=2**64, device="cpu")
    with pytest.raises(blockswap.InvalidArgumentError, match="must be an int, got True"):
        blockswap.offload(model, device="cpu", blocks_to_swap={"transformer_blocks": True})
    with pytest.raises(blockswap.InvalidArgumentError, match="names no list"):
        blockswap.offload(model, device="cpu", blocks_to_swap={})
    with pytest.raises(blockswap.InvalidArgumentError, match="host_budget_bytes needs weights_file"):
        blockswap.offload(model, device="cpu", host_budget_bytes=1000,  # was ignored (a tester)
                          blocks_to_swap={"transformer_blocks": 2, "single_transformer_blocks": 2})
    with pytest.raises(blockswap.InvalidArgumentError, match="each block streams in one list"):
        blockswap.offload(model, device_budget="1GB", device="cpu",
                          block_lists=["transformer_blocks", "transformer_blocks"])
    # A module that is offloaded already is refused; closing the first frees it.
    first = blockswap.offload(model, device="cpu", blocks_to_swap={"transformer_blocks": 1})
    assert str(blockswap.plan_offload(model, device_budget="1GB", device="cpu")) # changes nothing
    with pytest.raises(blockswap.Error, match="already managed"):
        blockswap.offload(model, device="cpu", blocks_to_swap={"transformer_blocks": 1})
    first.close()
    blockswap.offload(model, device="cpu", blocks_to_swap={"transformer_blocks": 1}).close()


def test_a_size_string_is_read_as_its_unit():
    model = build("flux")
    gb = blockswap.plan_offload(model, device_budget="1GB", device="cpu")
    gib = blockswap.plan_offload(model, device_budget="1GiB", device="cpu")
    assert (gb.budget_bytes, gib.budget_bytes) == (10**9, 2**30)


def streamed(handle):
    return {name: stats["h2d_bytes"] for name, stats in handle.stats().items()}


def test_a_flux_pipeline_in_one_call_gives_the_same_images_and_streams_its_text_encoders():
    reference, pipe = tiny_pipelines.flux(), tiny_pipelines.flux()
    want = [tiny_pipelines.flux_image(reference, seed) for seed in (0, 1)]
    smallest = blockswap.plan_offload(pipe, device_budget="1GB",
                                      device="cpu").smallest_budget_bytes
    everything = blockswap.plan_offload(pipe, device_budget="1GB", device="cpu").device_bytes
    budget = (smallest + everything) // 2
    with blockswap.offload(pipe, device_budget=budget, device="cpu") as handle:
        names = {x.name for x in handle.plan.lists}
        assert names == {"transformer.transformer_blocks",
                         "transformer.single_transformer_blocks",
                         "text_encoder.encoder.layers",
                         "text_encoder_2.encoder.block"}
        assert handle.plan.placed == ["vae"]
        got = [tiny_pipelines.flux_image(pipe, seed) for seed in (0, 1)]
        moved = streamed(handle)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    # The denoiser and a text encoder both streamed (the planner swaps where it saves most).
    assert moved.get("transformer.transformer_blocks", 0) + moved.get(
        "transformer.single_transformer_blocks", 0) > 0
    assert sum(moved.values()) > 0
    assert torch.equal(tiny_pipelines.flux_image(pipe, 0), want[0])  # plain again


def test_text_encoders_stream_when_the_budget_is_tight():
    pipe = tiny_pipelines.flux()
    want = tiny_pipelines.flux_image(tiny_pipelines.flux())
    smallest = blockswap.plan_offload(pipe, device_budget=10**12,
                                      device="cpu").smallest_budget_bytes
    with blockswap.offload(pipe, device_budget=smallest, device="cpu") as handle:
        assert all(x.blocks_to_swap > 0 for x in handle.plan.lists)
        got = tiny_pipelines.flux_image(pipe)
        moved = streamed(handle)
    assert torch.equal(want, got)
    assert moved["text_encoder_2.encoder.block"] > 0
    assert moved["text_encoder.encoder.layers"] > 0


def test_a_wan_pipeline_in_one_call_gives_the_same_video():
    reference, pipe = tiny_pipelines.wan(), tiny_pipelines.wan()
    want = tiny_pipelines.wan_video(reference)
    smallest = blockswap.plan_offload(pipe, device_budget=10**12,
                                      device="cpu").smallest_budget_bytes
    with blockswap.offload(pipe, device_budget=smallest, device="cpu") as handle:
        assert {x.name for x in handle.plan.lists} == {"transformer.blocks",
                                                       "text_encoder.encoder.block"}
        got = tiny_pipelines.wan_video(pipe)
        moved = streamed(handle)
    assert torch.equal(want, got)
    assert all(bytes_ > 0 for bytes_ in moved.values())


def test_the_plan_of_a_model_on_the_meta_device():
    with torch.device("meta"):
        model = build("flux", lora=False)
    plan = blockswap.plan_offload(model, device_budget=model_bytes(model) // 2, device="cpu")
    assert plan.device_bytes <= model_bytes(model) // 2
    assert sum(x.blocks_to_swap for x in plan.lists) > 0


def test_adapters_and_their_gradients_stay_exact_with_offloaded_activations():
    reference, model = build("flux"), build("flux")
    expected = train(reference, "flux", steps=2)
    with blockswap.offload(model, device_budget=model_bytes(model) // 2, device="cpu",
                           offload_activations=True, activation_threshold_bytes=0) as handle:
        got = train(model, "flux", steps=2)
        assert all(s["activation_offloaded_bytes"] > 0 for s in handle.stats().values())
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    assert all(not p.requires_grad or p.grad is None or p.grad.device == CPU
               for p in adapters(model))
    assert base_weights(model).keys() == base_weights(reference).keys()


def test_a_model_as_loaded_infers_frozen_and_gets_its_flags_back():
    # from_pretrained leaves every parameter requiring grad: offload infers, freezing them
    # while it holds the model, and close() gives the flags back.
    reference, model = build("wan", lora=False), build("wan", lora=False)
    model.requires_grad_(True)
    handle = blockswap.offload(model, device_budget="1GB", device="cpu", blocks_to_swap=2)
    assert not handle.plan.training
    assert not any(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(reference(**inputs("wan", 1), return_dict=False)[0],
                           model(**inputs("wan", 1), return_dict=False)[0])
    assert handle.stats()["blocks"]["h2d_bytes"] > 0
    handle.close()
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(blockswap.InvalidArgumentError, match="no parameter of the block lists"):
        blockswap.offload(model, device_budget="1GB", device="cpu", supports_backward=True)
    assert all(p.requires_grad for p in model.parameters())


class Chain(torch.nn.Module):
    """Blocks in a ModuleList, an alias list of the same blocks, and a head."""

    def __init__(self, alias=False, tied=False):
        super().__init__()
        torch.manual_seed(3)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        if alias:
            self.alias = torch.nn.ModuleList(list(self.blocks))
        self.head = torch.nn.Linear(16, 16)
        if tied:
            self.head.weight = self.blocks[0].weight
        self.requires_grad_(False)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def test_an_alias_list_is_one_list_and_a_tied_weight_is_refused():
    x = torch.randn(2, 16)
    want = Chain()(x)
    model = Chain(alias=True)
    with blockswap.offload(model, device="cpu", device_budget="1GB",
                           blocks_to_swap=2) as handle:
        assert [x.name for x in handle.plan.lists] == ["blocks"]
        assert torch.equal(model(x), want)
        assert handle.stats()["blocks"]["h2d_bytes"] > 0
    with pytest.raises(blockswap.InvalidArgumentError, match="shares a tensor with a block"):
        blockswap.offload(Chain(tied=True), device="cpu", device_budget="1GB")


def test_a_copy_or_a_pickle_of_an_offloaded_model_is_a_plain_model():
    import copy
    import io
    x = torch.randn(2, 16)
    model = Chain()
    want = model(x)
    with blockswap.offload(model, device="cpu", device_budget="1GB", blocks_to_swap=2):
        copied = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        assert torch.equal(model(x), want)
    buffer.seek(0)
    for plain in (copied, torch.load(buffer, weights_only=False)):
        assert torch.equal(plain(x), want)


def test_a_meta_model_whose_fixed_parts_hold_no_values_is_refused_before_anything_moves():
    with torch.device("meta"):
        model = Chain()
    with pytest.raises(blockswap.InvalidArgumentError, match="meta device"):
        blockswap.offload(model, device="cpu", device_budget="1GB")
    assert all(p.is_meta for p in model.parameters())


def test_a_pipeline_reads_its_transformer_from_the_sharded_checkpoint_users_have(tmp_path):
    # diffusers' own sharded format (an index JSON and its shards), the blocks read from it
    # at every load (host_budget_bytes=0): the same images, and bytes really read from disk.
    want = tiny_pipelines.flux_image(tiny_pipelines.flux())
    folder = tmp_path / "transformer"
    tiny_pipelines.flux().transformer.save_pretrained(folder, max_shard_size="200KB")
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").exists()
    assert len(list(folder.glob("*.safetensors"))) >= 3
    pipe = tiny_pipelines.flux()
    smallest = blockswap.plan_offload(pipe, device_budget="1GB",
                                      device="cpu").smallest_budget_bytes
    with blockswap.offload(pipe, device_budget=smallest, device="cpu",
                           weights_file={"transformer": folder}, host_budget_bytes=0) as handle:
        got = tiny_pipelines.flux_image(pipe)
        stats = handle.stats()
    assert torch.equal(want, got)
    for name in ("transformer.transformer_blocks", "transformer.single_transformer_blocks"):
        assert stats[name]["disk_bytes"] > 0, name
    assert stats["text_encoder_2.encoder.block"].get("disk_bytes", 0) == 0
