"""The device mesh: how the world of ranks splits into data-parallel, context-parallel and
tensor-parallel groups.

Mesh dimensions, outermost first: ``dp_replicate`` (DDP, or the replicate dim of HSDP),
``dp_shard`` (FSDP), ``cp`` (context parallel: the ranks of a group hold the same samples and
split their token sequences), ``tp`` (tensor parallel). Dimensions of size 1 are dropped. The
data-parallel rank (which slice of the global batch a rank loads) combines both dp dims.
FSDP shards the weights and reduces the gradients over ``dp_shard`` x ``cp`` (flattened as
``dp_shard_cp``), and the loss is summed over ``dp_replicate`` x ``dp_shard`` x ``cp``
(``dp_cp``): each CP rank computes the loss of its part of the samples.
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
    cp: int = 1

    def __post_init__(self):
        self._resolve()

    def _resolve(self) -> None:
        for name, value in (("data_parallel_replicate_degree", self.dp_replicate),
                            ("tensor_parallel_degree", self.tp),
                            ("context_parallel_degree", self.cp)):
            if value < 1:
                raise ParallelismError(f"training.{name}={value} must be >= 1")
        others = self.dp_replicate * self.tp * self.cp
        if self.dp_shard == -1:
            rest = self.world_size // others
            if rest * others != self.world_size:
                raise ParallelismError(self._mismatch())
            self.dp_shard = rest
        if self.dp_shard < 1 or self.dp_shard * others != self.world_size:
            raise ParallelismError(self._mismatch())

    def _mismatch(self) -> str:
        return (
            f"parallel degrees do not fit the world size {self.world_size}: "
            f"data_parallel_replicate_degree={self.dp_replicate} x "
            f"data_parallel_shard_degree={self.dp_shard} x context_parallel_degree={self.cp} x "
            f"tensor_parallel_degree={self.tp} must equal the number of processes (set data_parallel_shard_degree = -1 to use "
            f"the rest)"
        )

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP over ``dp_shard`` x ``cp`` (context parallelism always reduces with FSDP)."""
        return self.dp_shard * self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def loss_degree(self) -> int:
        """The number of ranks whose loss terms add up to the global batch's: dp x cp."""
        return self.dp_degree * self.cp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def describe(self) -> str:
        if self.world_size == 1:
            return "single process"
        parts = []
        if self.hsdp_enabled and self.dp_shard > 1:
            parts.append(f"HSDP {self.dp_replicate}x{self.dp_shard}")
        elif self.dp_shard > 1:
            parts.append(f"FSDP {self.dp_shard}")
        elif self.dp_replicate > 1:
            parts.append(f"DDP {self.dp_replicate}")
        if self.cp_enabled:
            parts.append(f"CP {self.cp}")
        if self.tp_enabled:
            parts.append(f"TP {self.tp}")
        return " + ".join(parts)

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Build the device mesh (None for a single process)."""
        if self.world_size == 1:
            return None
        dims = [(n, d) for n, d in (("dp_replicate", self.dp_replicate),
                                    ("dp_shard", self.dp_shard), ("cp", self.cp),
                                    ("tp", self.tp)) if d > 1]
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims),
                                mesh_dim_names=tuple(n for n, _ in dims))
        names = [n for n, _ in dims]
        flattened = (("dp", ("dp_replicate", "dp_shard")), ("dp_shard_cp", ("dp_shard", "cp")),
                     ("dp_cp", ("dp_replicate", "dp_shard", "cp")))
        for flat, parts in flattened:
            present = tuple(n for n in parts if n in names)
            if len(present) > 1:
                mesh[present]._flatten(mesh_dim_name=flat)
        return mesh

    def _one_name(self, mesh: DeviceMesh, parts: tuple[str, ...], flat: str) -> str | None:
        present = [n for n in parts if n in (mesh.mesh_dim_names or ())]
        return None if not present else present[0] if len(present) == 1 else flat

    def fsdp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The mesh FSDP shards over: ``dp_shard`` x ``cp`` (with ``dp_replicate`` as the
        replicate dim of HSDP); None without FSDP."""
        if mesh is None or not self.fsdp_enabled:
            return None
        shard = self._one_name(mesh, ("dp_shard", "cp"), "dp_shard_cp")
        return mesh["dp_replicate", shard] if self.hsdp_enabled else mesh[shard]

    def loss_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The mesh over which loss terms are summed: data-parallel and context-parallel."""
        if mesh is None or self.loss_degree == 1:
            return None
        return mesh[self._one_name(mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp")]

    def cp_rank(self, mesh: DeviceMesh | None) -> int:
        return mesh["cp"].get_local_rank() if self.cp_enabled else 0

    def dp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The (flattened) data-parallel mesh, over which gradients are averaged."""
        if mesh is None or self.dp_degree == 1:
            return None
        # the dims of size > 1 among dp_replicate and dp_shard (HSDP with CP can have dp_shard 1)
        return mesh[self._one_name(mesh, ("dp_replicate", "dp_shard"), "dp")]

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        dp = self.dp_mesh(mesh)
        return 0 if dp is None else dp.get_local_rank()
