"""The device mesh: how the world of ranks splits into data-parallel and tensor-parallel groups.

Mesh dimensions, outermost first: ``dp_replicate`` (DDP, or the replicate dim of HSDP),
``dp_shard`` (FSDP), ``tp`` (tensor parallel). Dimensions of size 1 are dropped. The
data-parallel rank (which slice of the global batch a rank loads) combines both dp dims.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.errors import UserError


class ParallelismError(UserError, ValueError):
    """A parallelism setting that does not fit the world size."""


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    def __post_init__(self):
        self._resolve()

    def _resolve(self) -> None:
        for name, value in (("data_parallel_replicate_degree", self.dp_replicate),
                            ("tensor_parallel_degree", self.tp)):
            if value < 1:
                raise ParallelismError(f"training.{name}={value} must be >= 1")
        if self.dp_shard == -1:
            rest = self.world_size // (self.dp_replicate * self.tp)
            if rest * self.dp_replicate * self.tp != self.world_size:
                raise ParallelismError(self._mismatch())
            self.dp_shard = rest
        if self.dp_shard < 1 or self.dp_replicate * self.dp_shard * self.tp != self.world_size:
            raise ParallelismError(self._mismatch())

    def _mismatch(self) -> str:
        return (
            f"parallel degrees do not fit the world size {self.world_size}: "
            f"data_parallel_replicate_degree={self.dp_replicate} x "
            f"data_parallel_shard_degree={self.dp_shard} x tensor_parallel_degree={self.tp} "
            f"must equal the number of processes (set data_parallel_shard_degree = -1 to use "
            f"the rest)"
        )

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard == 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def describe(self) -> str:
        if self.world_size == 1:
            return "single process"
        parts = []
        if self.hsdp_enabled:
            parts.append(f"HSDP {self.dp_replicate}x{self.dp_shard}")
        elif self.fsdp_enabled:
            parts.append(f"FSDP {self.dp_shard}")
        elif self.ddp_enabled:
            parts.append(f"DDP {self.dp_replicate}")
        if self.tp_enabled:
            parts.append(f"TP {self.tp}")
        return " + ".join(parts)

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Build the device mesh (None for a single process)."""
        if self.world_size == 1:
            return None
        dims = [(n, d) for n, d in (("dp_replicate", self.dp_replicate),
                                    ("dp_shard", self.dp_shard), ("tp", self.tp)) if d > 1]
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims),
                                mesh_dim_names=tuple(n for n, _ in dims))
        dp_names = tuple(n for n, _ in dims if n.startswith("dp"))
        if len(dp_names) > 1:
            mesh[dp_names]._flatten(mesh_dim_name="dp")
        return mesh

    def dp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The (flattened) data-parallel mesh, over which gradients are averaged."""
        if mesh is None or self.dp_degree == 1:
            return None
        if self.hsdp_enabled:
            return mesh["dp"]
        return mesh["dp_shard" if self.fsdp_enabled else "dp_replicate"]

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        dp = self.dp_mesh(mesh)
        return 0 if dp is None else dp.get_local_rank()
