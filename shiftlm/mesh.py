"""ParallelConfig -> Mesh: this rank's coordinates and its named process groups.

Rank layout (docs/design.md "Rank layout"), order dp, pp, cp, sp, tp, TP innermost:

    rank = (((dp * PP + pp) * CP + cp) * SP + sp) * TP + tp

Groups: `tp` (TP consecutive ranks), `sp` (stride TP), `cp` (context parallelism, ring attention;
stride SP*TP), `pp` (stride CP*SP*TP), `dp` (stride PP*CP*SP*TP), `dp_sp` (every rank that holds
the same weights: dp x cp x sp), `ep` / `edp` / `etp` (the experts' own layout, folded over each stage's
dp x cp x sp x tp ranks: `expert_group_ranks`), and `shift`: the SP*TP ranks of one (dp, pp, cp) slice. In the shift
group rank (sp, tp) holds shard index `j = tp*SP + sp` ("head order"): full-TP shard j is sub-slice `sp` of TP shard `tp`. The group's own
rank order is sorted global rank, which is *not* head order, so `shard_index` is computed here and
never read from the group.

The device is chosen here, once per process (`choose_device`, the only code that asks whether CUDA is
there), and the backend with it: NCCL for CUDA tensors, gloo for CPU ones. `Mesh.device` is where
every tensor of the engine is created (docs/architecture.md, "Devices").
"""

from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shiftlm.comm.group import CommGroup
from shiftlm.errors import ConfigError
from shiftlm.parallel import ParallelConfig

DEVICES = ("auto", "cuda", "cpu")
BACKEND_OF = {"cuda": "nccl", "cpu": "gloo"}

AXES = ("dp", "pp", "cp", "sp", "tp")


@dataclass(frozen=True)
class Coords:
    dp: int
    pp: int
    sp: int
    tp: int
    cp: int = 0  # last so that positional Coords(dp, pp, sp, tp) keeps its meaning


def rank_of(config: ParallelConfig, dp: int, pp: int, sp: int, tp: int, cp: int = 0) -> int:
    return (((dp * config.pp + pp) * config.cp + cp) * config.sp + sp) * config.tp + tp


def coords_of(config: ParallelConfig, rank: int) -> Coords:
    tp = rank % config.tp
    sp = rank // config.tp % config.sp
    cp = rank // (config.tp * config.sp) % config.cp
    pp = rank // (config.tp * config.sp * config.cp) % config.pp
    dp = rank // (config.tp * config.sp * config.cp * config.pp)
    return Coords(dp=dp, pp=pp, sp=sp, tp=tp, cp=cp)


def group_ranks(config: ParallelConfig, axes: tuple[str, ...]) -> list[list[int]]:
    """Every group that varies `axes` (in that nesting order) with the other axes fixed."""
    sizes = {a: getattr(config, a) for a in AXES}
    fixed = [a for a in AXES if a not in axes]
    groups = []
    for fixed_values in itertools.product(*(range(sizes[a]) for a in fixed)):
        base = dict(zip(fixed, fixed_values))
        ranks = []
        for varying in itertools.product(*(range(sizes[a]) for a in axes)):
            ranks.append(rank_of(config, **base, **dict(zip(axes, varying))))
        groups.append(ranks)
    return groups


def token_rank(config: ParallelConfig, coords: Coords) -> int:
    """f = (dp*CP + cp)*SP + sp: a rank's place among the dp x cp x sp ranks that see different tokens."""
    return (coords.dp * config.cp + coords.cp) * config.sp + coords.sp


def stage_rank(config: ParallelConfig, coords: Coords) -> int:
    """r = f*TP + tp: a rank's place among the DP*CP*SP*TP ranks of its pipeline stage."""
    return token_rank(config, coords) * config.tp + coords.tp


def expert_coords(config: ParallelConfig, coords: Coords) -> tuple[int, int, int]:
    """(edp, ep, etp) of a rank: its stage rank cut as r = (edp*EP + ep)*ETP + etp (docs/moe.md)."""
    r, etp, ep = stage_rank(config, coords), config.expert_tp, config.ep
    return r // (etp * ep), r // etp % ep, r % etp


def expert_group_ranks(config: ParallelConfig, name: str) -> list[list[int]]:
    """Megatron-Core's MoE parallel folding: for each pp, the stage's ranks in order r = f*TP + tp
    are re-cut as r = (edp*EP + ep)*ETP + etp. `etp` groups vary etp (ETP consecutive ranks: the tp
    group when ETP = TP), `ep` groups vary ep, and `edp` (expert data parallel: the ranks holding the
    same expert shards, whose gradients are summed) varies edp. With ETP = TP, token rank f is ep
    rank f % EP of ep group f // EP."""
    varying = {"edp": 0, "ep": 1, "etp": 2}[name]
    groups: dict[tuple, list[int]] = {}
    for rank in range(config.world_size):
        c = coords_of(config, rank)
        key = list(expert_coords(config, c))
        key[varying] = -1
        groups.setdefault((c.pp, *key), []).append(rank)
    return list(groups.values())


def choose_device(requested: str = "auto", local_world: int | None = None) -> tuple[torch.device, str]:
    """This process's device and the collective backend for its tensors, checked before any collective.

    `auto`: the GPU `LOCAL_RANK` (made current) when CUDA is visible, else the CPU. Asking for `cuda`
    without CUDA, or more local ranks (`local_world`, else torchrun's LOCAL_WORLD_SIZE) than visible
    GPUs, is a `ConfigError` naming the fix. Under an initialised process group the device follows its
    backend (NCCL: the current GPU; gloo: the CPU)."""
    if requested not in DEVICES:
        raise ConfigError(f"device {requested!r} is not one of {', '.join(DEVICES)}: pick one")
    if dist.is_available() and dist.is_initialized():
        kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
        if requested not in ("auto", kind):
            raise ConfigError(
                f"device {requested} asked, but the process group runs {dist.get_backend()} ({kind}): "
                f"start the ranks with the {BACKEND_OF[requested]} backend or ask for device {kind}"
            )
        index = torch.cuda.current_device() if kind == "cuda" else None
        return torch.device(kind, index), dist.get_backend()
    visible = visible_gpus()
    if requested == "cpu" or (requested == "auto" and not visible):
        return torch.device("cpu"), "gloo"
    if not visible:
        raise ConfigError(
            "device cuda (NCCL) asked but no CUDA GPU is visible (torch.cuda.is_available() is False): "
            "use device cpu (gloo), or run on a GPU node with a CUDA build of PyTorch"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    if max(local_rank + 1, local_world) > visible:
        raise ConfigError(
            f"{local_world} ranks on this node need {local_world} GPUs but {visible} are visible: "
            f"use torchrun --nproc-per-node {visible} (and a layout of that many ranks per node), "
            "or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank), "nccl"


def visible_gpus() -> int:
    """How many CUDA GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_name(device: torch.device) -> str:
    """The GPU's name (the hardware catalog's key for its peak), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def check_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse (one line) a dtype the device cannot compute in: bf16 on a GPU older than Ampere."""
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"bf16 asked but {torch.cuda.get_device_name(device)} has no bf16: use float16 or float32 "
            "(serve --dtype float16; train --train.dtype=fp32)"
        )


def process_group_device() -> torch.device:
    """The device the initialised process group's backend moves (CPU without one)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Mesh:
    """This rank's view of a DP x PP x CP x SP x TP layout.

    Construct it on every rank in the same order (creating groups is collective). With a world of
    one, or before torch.distributed is initialised with a one-rank layout, every group has size 1
    and no process group is created. `timeout` bounds every collective on the groups (the backend's
    default, 30 minutes on gloo, when None): a server whose workers idle between requests wants longer.
    `device` (from `choose_device`) is where this rank's tensors live; by default the one the process
    group's backend moves (NCCL: the current GPU), else the CPU.
    """

    def __init__(
        self,
        config: ParallelConfig,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: datetime.timedelta | None = None,
        device: torch.device | str | None = None,
    ):
        self.device = torch.device(device) if device is not None else process_group_device()
        initialized = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if initialized else 1
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        config.check_world_size(world_size)
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.coords = coords_of(config, rank)
        axes_of = {
            "tp": ("tp",),
            "sp": ("sp",),
            "cp": ("cp",),
            "pp": ("pp",),
            "dp": ("dp",),
            "shift": ("tp", "sp"),
            # the data-parallel replicas of a parameter shard: ranks that hold the same weights and see
            # different tokens (Ulysses and ring attention split tokens too), so their gradients are summed
            "dp_sp": ("dp", "cp", "sp"),
        }
        self.groups: dict[str, CommGroup] = {}
        layout = [(name, ranks) for name, axes in axes_of.items() for ranks in group_ranks(config, axes)]
        if config.experts_apart:
            names = ("ep", "edp") if config.expert_tp == config.tp else ("ep", "edp", "etp")
            layout += [(name, ranks) for name in names for ranks in expert_group_ranks(config, name)]
        for name, ranks in layout:
            # new_group must be called by every rank for every group, in the same order
            pg = (
                dist.new_group(sorted(ranks), timeout=timeout)
                if initialized and world_size > 1 and len(ranks) > 1
                else None
            )
            if rank in ranks:
                self.groups[name] = CommGroup(name, tuple(sorted(ranks)), pg, rank)
        if not config.experts_apart:  # every expert here; expert gradients are summed like any other's
            self.groups["ep"] = CommGroup("ep", (rank,), None, rank)
            self.groups["edp"] = self.groups["dp_sp"]
        if config.expert_tp == config.tp:  # expert TP = TP: the same group object (moe.SparseMoE tests it)
            self.groups["etp"] = self.groups["tp"]

    def close(self) -> None:
        """Destroy the process groups this mesh created, after its last collective: each gloo group
        holds threads (which wake while idle) and sockets until it is destroyed, and a process may
        build many meshes (a notebook's training runs). The mesh is unusable afterwards."""
        for pg in {id(g.pg): g.pg for g in self.groups.values() if g.pg is not None}.values():
            dist.destroy_process_group(pg)

    tp = property(lambda self: self.groups["tp"])
    sp = property(lambda self: self.groups["sp"])
    cp = property(lambda self: self.groups["cp"])
    pp = property(lambda self: self.groups["pp"])
    dp = property(lambda self: self.groups["dp"])
    shift = property(lambda self: self.groups["shift"])
    dp_sp = property(lambda self: self.groups["dp_sp"])
    ep = property(lambda self: self.groups["ep"])
    edp = property(lambda self: self.groups["edp"])
    etp = property(lambda self: self.groups["etp"])

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group (which experts it holds)."""
        return expert_coords(self.config, self.coords)[1]

    @property
    def shard_index(self) -> int:
        """j = tp*SP + sp: this rank's head block in the shift group (full-TP shard index)."""
        return self.coords.tp * self.config.sp + self.coords.sp

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.config.pp - 1

    def __str__(self) -> str:
        c = self.config
        cp = f"-CP({c.cp})" if c.cp > 1 else ""
        return f"DP({c.dp})-PP({c.pp}){cp}-SP({c.sp})-TP({c.tp}) rank {self.rank}"

    __repr__ = __str__
