"""What blockswap.offload plans before it changes anything: the block lists of a module or of a
diffusers pipeline's components, their packed sizes, what stays on the device, and the K of
each list that fits one device budget (the C++ planner, blockswap/core/planner.hpp).

Note [finding block lists]
A block list is a ``torch.nn.ModuleList`` of two or more modules of one class that hold
parameters: diffusers' ``transformer_blocks`` and ``blocks``, transformers' ``encoder.block``
(T5, UMT5), ``encoder.layers`` (CLIP) and ``layers`` (Qwen2.5-VL). The search stops at the first
list on each path, so a list inside a block (a T5 block's ``layer``) is part of its block. A
model whose forward calls a list's blocks out of order, or one more than once a pass, is not a
chain of blocks: name the lists to stream (``block_lists=``) and leave that one out.
"""

import operator as _operator
import re as _re

import torch as _torch

from . import _block_tensors, _compat

_C = _compat.load_extension()
InvalidArgumentError = _C.InvalidArgumentError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10,
          "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(name, value):
    """Bytes from an int or a string with a unit: '24GB' (10^9), '22.5 GiB' (2^30)."""
    if isinstance(value, str):
        match = _re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = match and _UNITS.get(match.group(2).lower())
        if unit is None:
            raise InvalidArgumentError(f"{name}={value!r} is not a size: give bytes (an int) or "
                                       "a number with a unit, such as '24GB' or '22.5GiB'")
        return parse_bytes(name, int(float(match.group(1)) * unit))
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be bytes (an int) or a size such as '24GB', "
                                   f"got {value!r}")
    try:
        value = _operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be bytes (an int) or a size such as '24GB', "
                                   f"got {value!r}") from None
    if value <= 0 or value >= 2**63:
        raise InvalidArgumentError(f"{name} must be more than 0 bytes and less than 2**63, got "
                                   f"{value}")
    return value


def gib(n):
    """Bytes as a person reads them: 81440 -> '79.5 KiB'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n} B"


def is_pipeline(target):
    """A diffusers pipeline (or anything shaped like one): not a module, with a components
    dict."""
    return not isinstance(target, _torch.nn.Module) and isinstance(
        getattr(target, "components", None), dict)


def find_block_lists(module):
    """[(path, ModuleList)] of the module's block lists (Note [finding block lists])."""
    found = []

    def visit(path, m):
        if isinstance(m, _torch.nn.ModuleList) and len(m) >= 2 and len(
                {type(b) for b in m}) == 1 and all(any(True for _ in b.parameters()) for b in m):
            found.append((path, m))
            return
        for name, child in m.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", module)
    return found


def _bytes(tensor):
    return tensor.numel() * tensor.element_size()


class BlockList:
    """One list the plan streams: where it is, its blocks' packed sizes and its K."""

    def __init__(self, component, path, blocks, block_bytes):
        self.component = component  # the pipeline component's name; "" for a module
        self.path = path  # inside the component
        self.blocks = blocks
        self.block_bytes = block_bytes
        self.blocks_to_swap = 0
        self.device_bytes = 0
        self.moved_bytes = 0

    @property
    def name(self):
        return f"{self.component}.{self.path}" if self.component else self.path


class OffloadPlan:
    """The block lists, their K, and the device memory they and the fixed parts take."""

    def __init__(self, device, budget_bytes, training, lists, fixed_bytes, smallest_bytes,
                 placed):
        self.device = device
        self.budget_bytes = budget_bytes  # None: no budget (K given)
        self.training = training
        self.lists = lists
        self.fixed_bytes = fixed_bytes  # weights that never move: on the device all along
        self.decode_buffers = False  # compress="on": fixed_bytes holds each list's decode buffers
        self.decode_buffer_bytes = 0  # those buffers' bytes, which the offloaders allocate
        self.smallest_budget_bytes = smallest_bytes
        self.placed = placed  # components placed whole on the device (a pipeline's VAE)
        self.device_bytes = 0
        self.moved_bytes = 0

    def __str__(self):
        mode = "training" if self.training else "inference"
        budget = gib(self.budget_bytes) if self.budget_bytes else "no budget"
        unit = "step" if self.training else "pass"
        width = max([len(x.name) for x in self.lists] + [10])
        lines = [f"blockswap plan on {self.device}, {mode}, device budget {budget} "
                 f"(the smallest that fits: {gib(self.smallest_budget_bytes)})",
                 f"  {'on the device':<{width}}  {gib(self.fixed_bytes)}: everything outside "
                 "the block lists, and the lists' trainable parameters and buffers"
                 + ("; with compress='on', each list's two decode buffers" if self.decode_buffers
                    else "")
                 + (f"; placed whole: {', '.join(self.placed)}" if self.placed else "")]
        for x in self.lists:
            largest = max(x.block_bytes)
            lines.append(f"  {x.name:<{width}}  {len(x.block_bytes)} blocks of up to "
                         f"{gib(largest)}: {x.blocks_to_swap} swapped, slots "
                         f"{gib(x.device_bytes)}, {gib(x.moved_bytes)} moved a {unit}")
        lines.append(f"  {'total':<{width}}  {gib(self.device_bytes)} on the device, "
                     f"{gib(self.moved_bytes)} over the link a {unit}")
        return "\n".join(lines)

    __repr__ = __str__


def _components(target):
    """[(name, module)]: a module alone (name ""), or a pipeline's module components."""
    if not is_pipeline(target):
        if not isinstance(target, _torch.nn.Module):
            raise InvalidArgumentError(f"blockswap.offload takes a torch.nn.Module or a "
                                       f"diffusers pipeline, not a {type(target).__name__}")
        return [("", target)]
    return [(name, m) for name, m in target.components.items()
            if isinstance(m, _torch.nn.Module)]


def _streams(name):
    """Whether a pipeline component's block lists stream: not the VAE's (its blocks differ in
    size and run once an image; it is placed whole, as the small parts are)."""
    return not name.startswith("vae")


def _chosen_lists(components, block_lists):
    """[(component, path, ModuleList)]: found, or those the user named."""
    found = [(c, path, lst) for c, m in components if _streams(c) or len(components) == 1
             for path, lst in find_block_lists(m)]
    if block_lists is None:
        return found
    if isinstance(block_lists, str):
        block_lists = [block_lists]
    by_name = {f"{c}.{p}" if c else p: (c, p, lst) for c, p, lst in found}
    chosen = []
    for name in block_lists:
        if name in by_name:
            chosen.append(by_name[name])
            continue
        component, _, path = name.partition(".") if len(components) > 1 else ("", "", name)
        module = dict(components).get(component)
        try:
            lst = module.get_submodule(path) if module is not None else None
        except AttributeError:
            lst = None
        if not isinstance(lst, _torch.nn.ModuleList) or len(lst) == 0:
            raise InvalidArgumentError(f"block_lists: '{name}' is not a ModuleList of blocks here"
                                       f"; the block lists found are {sorted(by_name)}")
        chosen.append((component, path, lst))
    return chosen


def _distinct(chosen, named):
    """The lists, each block in one only. A list found again under another name (an alias
    ModuleList of the very same blocks) is dropped; a list named twice, or lists that share
    some of their blocks, are an error."""
    owner, kept = {}, []  # block id -> the name of the list it is in
    for component, path, lst in chosen:
        name = f"{component}.{path}" if component else path
        ids = {id(b) for b in lst}
        shared = {owner[i] for i in ids if i in owner}
        if not shared:
            kept.append((component, path, lst))
            owner.update((i, name) for i in ids)
            continue
        other = next(iter(shared))
        alias = len(shared) == 1 and ids == {i for i, n in owner.items() if n == other}
        if named or not alias:
            raise InvalidArgumentError(
                f"block list '{name}' holds blocks of '{other}' too: each block streams in "
                "one list only; name each list once (block_lists=)")
    return kept


def _aligned(nbytes):
    """As core/layout.hpp's align_up: device buffers are aligned to 256 bytes."""
    return (nbytes + 255) // 256 * 256


def plan(target, device_budget, device, training, blocks_to_swap, block_lists,
         decode_buffers=False):
    """The OffloadPlan (changes nothing). The tensors may be on the meta device.
    ``decode_buffers``: compressed weights (compress="on"): each list's two decode buffers (Note
    [a decode step] in load_pipeline.cpp), each at most its largest block's bytes, stay on the
    device beside the slots (counted in ``fixed``)."""
    components = _components(target)
    budget = None if device_budget is None else parse_bytes("device_budget", device_budget)
    chosen = _distinct(_chosen_lists(components, block_lists), block_lists is not None)
    if not chosen:
        raise InvalidArgumentError(
            "blockswap.offload found no block list (a ModuleList of two or more blocks of one "
            "class) in " + (", ".join(c for c, _ in components) or type(target).__name__)
            + ": name them with block_lists=, or use blockswap.ModelOffloader on the blocks")
    lists, fixed, seen = [], 0, set()
    for component, path, lst in chosen:
        tensors = [_block_tensors.block_tensors(b, path, i) for i, b in enumerate(lst)]
        sizes = _C.packed_block_bytes(tensors, _torch.device("cpu"))
        lists.append(BlockList(component, path, lst, sizes))
        for parameters, buffers in tensors:  # what stays on the device: never packed
            for t in [p for _, p in parameters if p.requires_grad] + [b for _, b in buffers]:
                if id(t) not in seen:
                    seen.add(id(t))
                    fixed += _bytes(t)
    in_blocks = {id(t): x.name for x in lists for b in x.blocks
                 for t in (*b.parameters(), *b.buffers())}
    for m in outside_lists(components, chosen):
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None and id(t) in in_blocks:
                raise InvalidArgumentError(
                    f"a {type(m).__name__} outside the block lists shares a tensor with a block "
                    f"of '{in_blocks[id(t)]}': a swapped block's weights are not on the device "
                    "when the rest runs; untie them, or leave that list out (block_lists=)")
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                fixed += _bytes(t)
    sizes = [x.block_bytes for x in lists]
    decode_buffer_bytes = (sum(2 * _aligned(max(x, default=0)) for x in sizes)
                           if decode_buffers else 0)
    fixed += decode_buffer_bytes
    if not any(any(x) for x in sizes):
        raise InvalidArgumentError(
            "blockswap.offload: no parameter of the block lists is frozen, and blockswap swaps "
            "frozen weights: for LoRA, freeze the base weights (model.requires_grad_(False)) "
            "before adding the adapters; for inference, pass supports_backward=False; for full "
            "fine-tuning, use blockswap.ModelOffloader with a blockswap.FusedAdamW")
    smallest = _C.smallest_budget(sizes, training, fixed)
    placed = [c for c, _ in components if not _streams(c)] if len(components) > 1 else []
    result = OffloadPlan(str(device), budget, training, lists, fixed, smallest, placed)
    result.decode_buffers = bool(decode_buffers)
    result.decode_buffer_bytes = decode_buffer_bytes
    if blocks_to_swap is not None:
        ks = _given_ks(blocks_to_swap, lists)
        chosen_plan = _C.plan_for(sizes, ks, training, fixed)
        if budget is not None and chosen_plan["device_bytes"] > budget:
            raise _C.OutOfMemoryError(
                f"blocks_to_swap={blocks_to_swap!r} needs {gib(chosen_plan['device_bytes'])} of "
                f"the device, over device_budget={gib(budget)}: swap more blocks, or leave "
                "blocks_to_swap out and let the planner choose")
    else:
        if budget is None:
            raise InvalidArgumentError("blockswap.offload needs device_budget (bytes, or a size "
                                       "such as '24GB') or blocks_to_swap")
        if budget < smallest:
            raise _C.OutOfMemoryError(
                f"device_budget={gib(budget)} ({budget} bytes) cannot hold this model: the "
                f"smallest budget that fits is {gib(smallest)} ({smallest} bytes: every block "
                f"list at its most swapped blocks, plus {gib(fixed)} that stays on the device)")
        chosen_plan = _C.plan_swaps(sizes, budget, training, fixed)
    for x, p in zip(lists, chosen_plan["lists"]):
        x.blocks_to_swap, x.device_bytes, x.moved_bytes = (
            p["blocks_to_swap"], p["device_bytes"], p["moved_bytes"])
    result.device_bytes = chosen_plan["device_bytes"]
    result.moved_bytes = chosen_plan["moved_bytes"]
    return result


def outside_lists(components, chosen):
    """Every module of the components that is not inside a chosen block list: whose own
    parameters and buffers stay on the device."""
    inside = {id(m) for _, _, lst in chosen for block in lst for m in block.modules()}
    inside.update(id(lst) for _, _, lst in chosen)
    seen = set()
    for _, module in components:
        for m in module.modules():
            if id(m) not in inside and id(m) not in seen:
                seen.add(id(m))
                yield m


def _given_ks(blocks_to_swap, lists):
    """K per list from an int (one list) or a dict by list name."""
    if isinstance(blocks_to_swap, dict):
        unknown = set(blocks_to_swap) - {x.name for x in lists}
        if unknown:
            raise InvalidArgumentError(f"blocks_to_swap names {sorted(unknown)}, which are not "
                                       f"block lists here: {[x.name for x in lists]}")
        if not blocks_to_swap:
            raise InvalidArgumentError("blocks_to_swap={} names no list: give a K for one or "
                                       f"more of {[x.name for x in lists]}, or a device_budget")
        return [_k(f"blocks_to_swap[{x.name!r}]", blocks_to_swap.get(x.name, 0)) for x in lists]
    if len(lists) != 1:
        raise InvalidArgumentError(f"blocks_to_swap={blocks_to_swap!r} for {len(lists)} block "
                                   f"lists: give a dict by list name, {[x.name for x in lists]}")
    return [_k("blocks_to_swap", blocks_to_swap)]


def _k(name, value):
    """A K: an int (numpy's and torch's too), not a bool."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    try:
        return _operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}") from None
