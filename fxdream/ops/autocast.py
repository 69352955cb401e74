"""Whether autocast casts the inputs of ops on a device: a whole op sits below autocast, so it
is kept whole only where nothing would cast what it is given."""
from __future__ import annotations

import torch


def autocast_on(device: torch.device | str) -> bool:
    """Whether autocast is enabled for tensors on ``device``. False for a device autocast has no
    mode for (meta, where ``torch.is_autocast_enabled`` raises): nothing there is cast."""
    kind = device if isinstance(device, str) else device.type
    try:
        return torch.is_autocast_enabled(kind)
    except RuntimeError:
        return False
