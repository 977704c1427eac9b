"""Initialise a parallelised model on each rank's own shards, from the seed, one tensor at a time.

The trainer builds the model on the meta device, parallelises it (tensor parallelism and FSDP
turn its parameters into DTensors that hold this rank's shard) and materialises it with
``to_empty``. :func:`init_model` then fills it, without any rank ever holding the whole model
and without communication:

* every tensor (parameter or buffer) is initialised on its own, in name order: it alone is
  materialised at full size, every other tensor of the model is swapped for a meta
  placeholder, the global generator is seeded from ``(seed, name)`` (:func:`tensor_seed`) and
  the model's own ``init_weights()`` runs. Meta tensors draw no random numbers and cost
  nothing, so the full tensor gets exactly the distribution the model's init code gives it,
  from a random stream of its own;
* this rank keeps its shard of it (``distribute_tensor`` without a source rank: a local
  slice, whatever the placements: FSDP, TP's strided qkv shards, HSDP, replicated), and the
  full tensor is dropped before the next one.

So the weights depend only on the seed, the tensor names (the clean names of the state dict:
no FSDP, compile or checkpointing prefixes) and the device type (CPU and CUDA generators
differ), never on the parallelism, the world size or the order in which tensors are visited, and a tensor's value does not change when others are
skipped: a resume skips what its checkpoint restores (everything, for a run's own checkpoint)
and a seed checkpoint leaves only the parts it lacks (a new head) to be initialised. No rank
holds more than one full tensor (the largest weight matrix) on top of its shards.

The price is one ``init_weights()`` pass per tensor over an otherwise meta model, whose writes
to meta tensors are skipped (:class:`_MetaWritesAreNoOps`): about 20 ms per tensor for ViT-H+
on one CPU core, 12 s for its 554 tensors (beside some 35 s to draw its 0.84 billion values on
that core; on a GPU the full tensors are drawn on the device).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

# Module names that wrappers insert between a model's modules (torch.compile, activation
# checkpointing); the state dict's clean names leave them out.
WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module")


def clean_name(name: str) -> str:
    """``blocks.0._checkpoint_wrapped_module._orig_mod.attn.qkv.weight`` ->
    ``blocks.0.attn.qkv.weight`` (the name under which the state dict knows the tensor)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of the tensor ``name`` for ``training.seed`` = ``seed``: a hash of
    both, so that neighbouring names and seeds give unrelated streams."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class ModelTensor:
    """One parameter or buffer of the model, with every place where it is registered (a
    tensor shared by two modules is one entry)."""

    name: str
    tensor: torch.Tensor
    slots: list[tuple[nn.Module, str, str]] = field(default_factory=list)  # (module, table, key)

    @property
    def local(self) -> torch.Tensor:
        return self.tensor.to_local() if isinstance(self.tensor, DTensor) else self.tensor

    def put(self, value: torch.Tensor) -> None:
        """Register ``value`` in every slot of this tensor (parameters as ``nn.Parameter``)."""
        for module, table, key in self.slots:
            if table == "_parameters" and not isinstance(value, nn.Parameter):
                value = nn.Parameter(value, requires_grad=self.tensor.requires_grad)
            getattr(module, table)[key] = value


def model_tensors(model: nn.Module) -> list[ModelTensor]:
    """Every parameter and buffer (persistent or not) of ``model``, by clean name."""
    found: dict[int, ModelTensor] = {}
    for module_name, module in model.named_modules():
        for table in ("_parameters", "_buffers"):
            for key, tensor in getattr(module, table).items():
                if tensor is None:
                    continue
                entry = found.get(id(tensor))
                if entry is None:
                    name = clean_name(f"{module_name}.{key}" if module_name else key)
                    entry = found[id(tensor)] = ModelTensor(name, tensor)
                entry.slots.append((module, table, key))
    return sorted(found.values(), key=lambda e: e.name)


class _MetaWritesAreNoOps(TorchFunctionMode):
    """In-place writes to meta tensors (``normal_``, ``nn.init.trunc_normal_``, ``fill_``) return
    at once: they have no values to write, and some meta kernels cost milliseconds a call (a
    Python reference implementation), which one ``init_weights()`` pass per tensor would pay
    for every other tensor of the model."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        name = getattr(func, "__name__", "")
        if (isinstance(target, torch.Tensor) and name.endswith("_") and not name.startswith("__")
                and target.is_meta):
            return target
        return func(*args, **kwargs)


def _keep_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``target`` (a DTensor: its local shard)."""
    if isinstance(target, DTensor):
        # No source rank: every rank holds the same full tensor and slices its own part.
        shard = distribute_tensor(full, target.device_mesh, target.placements,
                                  src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)


@torch.no_grad()
def init_model(model: nn.Module, seed: int, skip: Iterable[str] = ()) -> list[str]:
    """Initialise every tensor of ``model`` whose clean name is not in ``skip`` (see the
    module docstring); returns the names initialised. ``model`` has an ``init_weights()`` and
    holds allocated (``to_empty``) plain tensors or DTensors."""
    skip = set(skip)
    entries = model_tensors(model)
    todo = [e for e in entries if e.name not in skip]
    if not todo:
        return []
    if not callable(getattr(model, "init_weights", None)):
        raise TypeError(f"{type(model).__name__} has no init_weights() to initialise it with")
    placeholders = {e.name: torch.empty(e.tensor.shape, dtype=e.tensor.dtype, device="meta")
                    for e in entries}
    for e in entries:
        e.put(placeholders[e.name])
    try:
        for e in todo:
            device = e.local.device
            full = torch.empty(e.tensor.shape, dtype=e.tensor.dtype, device=device)
            e.put(full)
            forked = [device.index or 0] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=forked), _MetaWritesAreNoOps():
                torch.manual_seed(tensor_seed(seed, e.name))
                model.init_weights()
            e.put(placeholders[e.name])
            _keep_shard(e.tensor, full)
            del full
    finally:
        for e in entries:
            e.put(e.tensor)
    return [e.name for e in todo]
