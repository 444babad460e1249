"""blockswap.stage_loads: what a pipeline stage's blocks cost in loads per step."""
from . import _C

InvalidArgumentError = _C.InvalidArgumentError

__all__ = ["stage_loads"]


def stage_loads(schedule, stages, stage, micro_batches, blocks, blocks_to_swap,
                training_rotating_slots=0):
    """Blocks that stage ``stage`` of ``stages`` loads in one step of ``micro_batches``
    micro-batches under ``schedule`` (``"gpipe"`` or ``"1f1b"``, as
    ``torch.distributed.pipelining`` runs them), for a stage of ``blocks`` blocks with
    ``blocks_to_swap`` swapped and ``training_rotating_slots`` (the ModelOffloader keyword; 0:
    the seed's layout), from the steady state. Each micro-batch's forward and backward load 2K;
    every forward that follows a forward, and every backward that follows a backward, loads R
    more (R = min(K, N-K) in the seed's layout). docs/distributed.md, "Pipeline stages"."""
    from ._offloader import _integer
    if not isinstance(schedule, str):
        raise InvalidArgumentError(f"stage_loads: schedule must be 'gpipe' or '1f1b', got "
                                   f"{schedule!r}")
    values = [_integer("stage_loads: ", name, value) for name, value in (
        ("stages", stages), ("stage", stage), ("micro_batches", micro_batches),
        ("blocks", blocks), ("blocks_to_swap", blocks_to_swap),
        ("training_rotating_slots", training_rotating_slots))]
    return _C.stage_loads(schedule.lower(), *values)
