"""compress="on" where the system will not pin the host copies (a low ``ulimit -l``, WSL;
open_device("cpu", pinnable_bytes=0) here): the pageable blocks are compressed too, staged
through the pinned buffers compressed and decoded on the device. Bitwise the model without
blockswap: FLUX inference in bfloat16 (every block compressed) and LoRA training."""

import torch

import blockswap
from real_models import assert_bitwise, build, swap, train
from test_compress import infer


def test_pageable_blocks_are_compressed_and_inference_is_bitwise():
    dtype = torch.bfloat16
    expected = [infer(build("flux", dtype=dtype), "flux", seed=s, dtype=dtype) for s in (1, 2)]
    model = build("flux", dtype=dtype)
    device = blockswap.open_device("cpu", pinnable_bytes=0)
    offloaders = swap(model, "flux", 2, device=device, supports_backward=False, compress="on")
    assert_bitwise([infer(model, "flux", offloaders, seed=s, dtype=dtype) for s in (1, 2)],
                   expected)
    assert device.host_memory()["pageable_host_bytes"] > 0
    for o in offloaders:
        assert o.compression()["blocks"] == o.num_blocks, o.compression()
        assert o.stats()["staged_bytes"] > 0
        assert o.stats()["decoded_bytes"] > o.stats()["compressed_bytes"] > 0
        o.close()


def test_lora_training_with_compressed_pageable_blocks_is_bitwise():
    expected = train(build("flux"), "flux")
    model = build("flux")
    device = blockswap.open_device("cpu", pinnable_bytes=0)
    offloaders = swap(model, "flux", 2, device=device, compress="on")
    assert_bitwise(train(model, "flux", offloaders), expected)
    assert sum(o.compression()["blocks"] for o in offloaders) > 0
    assert all(o.stats()["staged_bytes"] > 0 for o in offloaders)
