"""Starting the default process group so that it survives torchrun's elastic restarts.

Under ``torchrun --max_restarts N`` a worker that dies makes the agent restart every worker,
which then rendezvous again on the agent's TCP store. The store keeps the keys of the earlier
round, and a new gloo (or NCCL) group that finds them connects to the dead workers' addresses
("connectFullMesh failed ... Connection refused"). Each round therefore keeps its keys under its
own prefix (``TORCHELASTIC_RESTART_COUNT``); groups made later (the device mesh's, the
asynchronous checkpoint's) inherit it through the default store.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_process_group(device: torch.device, timeout_seconds: float) -> None:
    """The default group for ``device`` (NCCL on CUDA, else gloo) from torchrun's environment."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_seconds)
    device_id = device if device.type == "cuda" else None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    dist.init_process_group(backend, store=dist.PrefixStore(f"torchtitan/restart{restart}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout, device_id=device_id)
