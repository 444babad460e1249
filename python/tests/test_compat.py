"""The torch versions blockswap supports (2.7 to 2.14) are checked at import, before the
compiled module loads, and the module refuses a torch other than the one it was built for."""

import os
import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint

import blockswap
from blockswap import _compat


def import_with_torch_version(version):
    """Imports blockswap in a fresh interpreter whose torch claims to be `version`."""
    code = f"import torch; torch.__version__ = {version!r}; import blockswap"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120)


def test_the_module_says_which_torch_it_was_built_for():
    assert blockswap._C.torch_version.split("+")[0] == torch.__version__.split("+")[0]


def test_a_torch_older_than_2_7_is_one_clear_import_error():
    result = import_with_torch_version("2.6.0+cpu")
    assert result.returncode != 0
    assert "ImportError: blockswap needs torch 2.7 to 2.14; this is torch 2.6.0+cpu" in result.stderr


def test_another_torch_than_the_one_it_was_built_for_is_refused_with_the_command_to_rebuild():
    built = torch.__version__.split("+")[0]
    major, minor = built.split(".")[:2]
    other = f"{major}.{int(minor) + 1}.0"
    result = import_with_torch_version(other)
    assert result.returncode != 0
    assert f"blockswap was built against torch {built}, and this is torch {other}" in result.stderr
    assert "pip install --no-build-isolation" in result.stderr


def test_numbers_in_the_compiled_modules_messages_are_formatted():
    # A module whose C++ runtime is half its own and half torch's (a compiler that links
    # libstdc++ statically, as the GPU machine's does, without Note [one C++ runtime per module])
    # loses the numbers of its messages, or crashes formatting them.
    blocks = [torch.nn.Linear(8, 8).requires_grad_(False) for _ in range(4)]
    with blockswap.ModelOffloader("b", blocks, 4, 2, False, torch.device("cpu"), False) as o:
        o.prepare_block_devices_before_forward()
        try:
            o._impl.wait_for_block(17)
        except blockswap.Error as e:
            assert "block index 17 is out of range for 4 blocks" in str(e)
        else:
            raise AssertionError("wait_for_block(17) did not raise")


# saved_tensors_hooks_active is torch's _top_saved_tensors_default_hooks from 2.8 on; torch 2.7
# has none, and _saved_tensors_hooks_pushed reads the stack another way. Both run on every torch.
@pytest.mark.parametrize("active", [_compat.saved_tensors_hooks_active,
                                    _compat._saved_tensors_hooks_pushed],
                         ids=["saved_tensors_hooks_active", "torch 2.7's way"])
def test_saved_tensor_hooks_on_top_are_seen_and_left_as_they_were(active):
    autograd = torch._C._autograd
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    packed = []

    def seen():
        answer = active()
        if top is not None:
            assert answer == (top(False) is not None)
        return answer

    def pack(t):
        packed.append(t)
        return t

    x = torch.randn(4, requires_grad=True)
    assert not seen()
    with torch.autograd.graph.save_on_cpu():
        assert seen()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            assert seen()
            x.exp()  # the hooks on top still apply after the question
            assert len(packed) == 1
        assert seen()
    assert not seen()
    inside = []

    def body(h):
        inside.append(seen())
        return h.sin().sin()

    torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False).sum().backward()
    torch.utils.checkpoint.checkpoint(body, x, use_reentrant=True).sum().backward()
    # the non-reentrant checkpoint's forward and recompute run under its hooks; the reentrant
    # one pushes none
    assert inside == [True, True, False, False]
    assert not seen()
    with torch.autograd.graph.disable_saved_tensors_hooks("the user's message"):
        assert not seen()
        assert autograd._saved_tensors_hooks_get_disabled_error_message() == "the user's message"
        with pytest.raises(RuntimeError, match="the user's message"):
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t).__enter__()
    assert autograd._saved_tensors_hooks_get_disabled_error_message() is None
