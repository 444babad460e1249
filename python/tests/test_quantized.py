"""Base weights in float8 with their scales, as the trainers hold them, swapped: musubi-tuner's
--fp8_scaled (fp8 weights, per-tensor or per-channel scale buffers, upcast in forward),
diffusion-pipe's float8 base weights (upcast in forward), torchao's Float8Tensor and a wrapper
subclass like ComfyUI's QuantizedTensor (inner data and scales, Note [wrapper subclasses]):
bitwise equal to the same model without swapping, Parameters kept, fp8 moving half the bytes."""

import types

import pytest
import torch

from real_models import BLOCK_LISTS, assert_bitwise, build, infer, inputs, prepare, swap, train


def scaled_fp8_forward(self, x):
    """musubi-tuner's patched Linear forward: the fp8 weight upcast and scaled."""
    weight = self.weight.to(x.dtype) * self.scale_weight.to(x.dtype)
    return torch.nn.functional.linear(x, weight, self.bias)


def upcast_forward(self, x):
    """diffusion-pipe's float8 base weights: upcast in forward, no scale."""
    return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


def block_linears(model, kind):
    for name in BLOCK_LISTS[kind]:
        for block in getattr(model, name):
            for path, module in block.named_modules():
                if type(module) is torch.nn.Linear and "lora_" not in path:
                    yield module


def to_fp8(model, kind, dtype=torch.float8_e4m3fn, scale=None):
    """Every Linear of the blocks with an fp8 weight: scale None (upcast only), "tensor" or
    "channel" (a scale_weight buffer that stays resident, as musubi-tuner keeps it)."""
    top = torch.finfo(dtype).max
    for linear in block_linears(model, kind):
        w = linear.weight.detach()
        if scale is None:
            linear.weight = torch.nn.Parameter(w.to(dtype), requires_grad=False)
            linear.forward = types.MethodType(upcast_forward, linear)
            continue
        amax = w.abs().amax(dim=1, keepdim=True) if scale == "channel" else w.abs().amax()
        s = (amax / top).clamp(min=1e-12)
        linear.weight = torch.nn.Parameter((w / s).to(dtype), requires_grad=False)
        linear.register_buffer("scale_weight", s.to(w.dtype))
        linear.forward = types.MethodType(scaled_fp8_forward, linear)
    return model


FP8 = [(torch.float8_e4m3fn, "tensor"), (torch.float8_e4m3fn, "channel"),
       (torch.float8_e5m2, "channel"), (torch.float8_e4m3fn, None)]


@pytest.mark.parametrize("dtype,scale", FP8)
@pytest.mark.parametrize("kind", ["flux", "wan"])
def test_fp8_base_weights_train_lora_and_infer_exactly(kind, dtype, scale):
    # The adapters are made first, in float32 (peft would make them fp8 like their base).
    reference = to_fp8(build(kind), kind, dtype, scale)
    model = to_fp8(build(kind), kind, dtype, scale)
    weights = [linear.weight for linear in block_linears(model, kind)]
    offloaders = swap(model, kind, 2)
    assert_bitwise(train(reference, kind), train(model, kind, offloaders))
    for offloader in offloaders:
        offloader.set_forward_only(True)
    assert torch.equal(infer(reference, kind), infer(model, kind, offloaders))
    for offloader in offloaders:
        offloader.close()
    # The Parameters are the model's own, with their dtype and values.
    assert all(a is b for a, b in zip([l.weight for l in block_linears(model, kind)], weights))
    assert all(w.dtype == dtype for w in weights)
    assert_bitwise([linear.weight for linear in block_linears(reference, kind)], weights)


def test_an_fp8_block_moves_half_the_bytes_of_the_bf16_one():
    """A Wan block wide enough that its linear weights dominate, as in the real models."""
    import diffusers
    loads = {}
    for name in ("bf16", "fp8"):
        torch.manual_seed(0)
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=256, ffn_dim=512, num_layers=4,
            rope_max_seq_len=32).to(torch.bfloat16).requires_grad_(False)
        if name == "fp8":
            to_fp8(model, "wan", scale="channel")
        [offloader] = swap(model, "wan", 2, supports_backward=False)
        for _ in range(2):  # the second pass: the swapped blocks' loads only
            offloader.reset_stats()
            with torch.no_grad():
                prepare([offloader])
                model(**inputs("wan", dtype=torch.bfloat16), return_dict=False)
        stats = offloader.stats()
        loads[name] = stats["h2d_bytes"] / stats["moves"]
        block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        assert block <= loads[name] < block + 256 * len(list(model.blocks[0].parameters()))
        offloader.close()
    assert 0.49 < loads["fp8"] / loads["bf16"] < 0.52, loads


class QuantizedTensor(torch.Tensor):
    """A wrapper subclass like ComfyUI's: int8-like fp8 data and a per-channel scale inside,
    no storage of its own; every op but the aliasing ones sees the dequantized weight."""

    @staticmethod
    def __new__(cls, qdata, scale, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype,
                                                   device=qdata.device, requires_grad=False)

    def __init__(self, qdata, scale, dtype):
        self._qdata, self._scale, self._dtype = qdata, scale, dtype

    def __repr__(self):
        return f"QuantizedTensor({self._qdata.dtype}, scale {tuple(self._scale.shape)})"

    def __tensor_flatten__(self):
        return ["_qdata", "_scale"], {"dtype": self._dtype}

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return QuantizedTensor(inner["_qdata"], inner["_scale"], context["dtype"])

    def dequantize(self):
        return self._qdata.to(self._dtype) * self._scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            return QuantizedTensor(func(args[0]._qdata), func(args[0]._scale), args[0]._dtype)
        unwrap = lambda t: t.dequantize() if isinstance(t, QuantizedTensor) else t  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args),
                    **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def to_wrapper(model, kind):
    for linear in block_linears(model, kind):
        w = linear.weight.detach()
        scale = (w.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
        linear.weight = torch.nn.Parameter(
            QuantizedTensor((w / scale).to(torch.float8_e4m3fn), scale, w.dtype),
            requires_grad=False)
    return model


def to_torchao(model, kind):
    from torchao.quantization import Float8WeightOnlyConfig, quantize_
    linears = set(block_linears(model, kind))
    quantize_(model, Float8WeightOnlyConfig(), filter_fn=lambda m, fqn: m in linears)
    return model


@pytest.mark.parametrize("quantize", [to_wrapper, to_torchao], ids=["wrapper", "torchao"])
@pytest.mark.parametrize("kind", ["flux", "qwen"])
def test_wrapper_subclass_weights_swap_their_inner_tensors(kind, quantize):
    reference, model = quantize(build(kind), kind), quantize(build(kind), kind)
    weights = [linear.weight for linear in block_linears(model, kind)]
    assert all(type(w).__name__ in ("QuantizedTensor", "Float8Tensor") for w in weights)
    inner = [(w.__tensor_flatten__()[0], w) for w in weights]
    offloaders = swap(model, kind, 2)
    assert_bitwise(train(reference, kind), train(model, kind, offloaders))
    for offloader in offloaders:
        offloader.set_forward_only(True)
    assert torch.equal(infer(reference, kind), infer(model, kind, offloaders))
    # The scales travel with their block: the swapped bytes are the inner data and scales.
    stats = offloaders[0].stats()
    assert stats["h2d_bytes"] > 0
    for offloader in offloaders:
        offloader.close()
    # The Parameters are the model's own objects.
    assert all(a is b for a, b in zip([l.weight for l in block_linears(model, kind)], weights))
    for (names, w), r in zip(inner, block_linears(reference, kind)):
        for name in names:
            assert torch.equal(getattr(w, name), getattr(r.weight, name)), name


def test_a_trainable_wrapper_subclass_is_refused_and_nothing_changes():
    import blockswap
    model = to_wrapper(build("wan", lora=False), "wan")
    weight = model.blocks[1].attn1.to_q.weight
    weight.requires_grad_(True)
    qdata = weight._qdata
    with pytest.raises(blockswap.InvalidArgumentError, match="to_q.weight.*of block 1.*frozen"):
        blockswap.ModelOffloader("blocks", list(model.blocks), 4, 2, True, torch.device("cpu"),
                                 False)
    assert model.blocks[1].attn1.to_q.weight is weight and weight._qdata is qdata
