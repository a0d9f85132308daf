"""Loss scales that make N data-parallel processes compute exactly the single-process gradient
(shared by every training objective)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def global_scales(valid: torch.Tensor) -> tuple[float, float]:
    """The VAT op averages over this process's blocks (CE) and valid positions (VH); DDP then
    averages over processes. These factors turn that into the average over the *global* batch,
    so N processes compute exactly the single-process gradient (1.0 when alone). ``valid``:
    bool[blocks, positions] of this process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return 1.0, 1.0
    local = torch.stack([valid.any(1).sum(), valid.sum()]).double()
    total = local.clone()
    dist.all_reduce(total)
    world = dist.get_world_size()
    return float(local[0] * world / total[0]), float(local[1] * world / total[1])
