"""Data-parallel glue (docs/distributed.md): the node's ranks sharing one host copy of the
swapped weights through torch.distributed's store, and DistributedDataParallel told to leave
those weights alone."""

from . import _compat

_C = _compat.load_extension()


def is_process_group(value):
    """Whether `value` is a torch.distributed process group."""
    import torch.distributed as dist
    return dist.is_available() and isinstance(value, dist.ProcessGroup)


def node_sharing(process_group):
    """The job's store, and this rank's place among its node's ranks: the arguments of
    Options.share_node (C++ Options::node_sharing)."""
    import socket
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise _C.InvalidArgumentError("process_group needs torch.distributed initialized "
                         "(torch.distributed.init_process_group) first")
    ranks = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(ranks, (socket.gethostname(), dist.get_rank()), group=process_group)
    hosts = [host for host, _ in ranks]
    me = dist.get_rank(process_group)
    local_rank = sum(1 for r in range(me) if hosts[r] == hosts[me])
    local_world_size = sum(1 for h in hosts if h == hosts[me])
    store = _compat.default_store()
    # A subgroup meets through the default group's store too: its keys name it.
    group = ""
    if len(ranks) != dist.get_world_size():
        import hashlib
        group = hashlib.sha1(repr(sorted(r for _, r in ranks)).encode()).hexdigest()[:16]

    def node_set(key, value):
        store.set(key, value)

    def node_get(key):
        return store.get(key).decode()

    return node_set, node_get, local_rank, local_world_size, group


def node_memory_use():
    """The node-shared host memory this process maps (process_group), from /proc/self/smaps:
    a dict of ``private_bytes`` (pages only this process maps), ``shared_bytes`` (pages other
    processes map too) and ``proportional_bytes`` (this process's share of all of them)."""
    return _C.node_memory_use()


def exclude_from_ddp(offloader, model):
    """ModelOffloader.exclude_from_ddp: the swapped frozen weights of `offloader`, by their
    names in `model`, added to what DistributedDataParallel ignores."""
    frozen = {id(p) for block in offloader.blocks for p in block.parameters()
              if not p.requires_grad}
    names = [name for name, p in model.named_parameters() if id(p) in frozen]
    if len(names) != len(frozen):
        raise ValueError(f"[{offloader.block_type}] {len(frozen) - len(names)} swapped weight(s) "
                         "are not parameters of the model given: pass the module you wrap "
                         "in DistributedDataParallel")
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    _compat.ddp_ignore(model, ignored + [n for n in names if n not in ignored])
