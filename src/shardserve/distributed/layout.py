"""The rank grid: one frozen object that says where every global rank sits and who its peers are.

Ranks are numbered with the tensor index varying fastest, then context, pipeline and data:

    rank = ((dp_index * pp + pp_index) * cp + cp_index) * tp + tp_index

so a tensor group is a run of adjacent ranks and stays inside one machine (as in Megatron, vLLM
and SGLang); nodes take contiguous blocks of ranks. Each group kind below lists every group of
that kind; every rank must create every group, in the same order, or the ranks that did wait
forever for the one that did not. `Layout.all_groups()` is that order, and nothing else decides it.

- tensor:   same (dp, pp, cp), varying tp.  Splits heads, MLP columns, the vocabulary.
- context:  same (dp, pp, tp), varying cp.  Splits a long prompt's tokens (ring attention).
- pipeline: same (dp, cp, tp), varying pp.  Passes activations stage to stage.
- data:     same (pp, cp, tp), varying dp.  Replicas of the model.
- control:  same dp: one engine replica's ranks, which must agree on every scheduling step.
- expert:   with ep > 1 the MoE layers of a pipeline stage span its dp * cp * tp ranks (with
            several replicas only under data-parallel attention); ep re-divides that span into
            moe_tp = span / ep tensor slices of the experts, and an expert group holds the ranks at
            one moe_tp position (size ep), the ranks that exchange tokens all-to-all. With ep = 1
            MoE layers use the tensor group.
- moe_tp:   with ep > 1, moe_tp adjacent ranks of the span that split each of their experts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

GROUP_KINDS = ("tensor", "context", "pipeline", "data", "control", "expert", "moe_tp")


class LayoutError(ValueError):
    """Sizes that cannot work; the message names the flag to change."""


@dataclass(frozen=True)
class Coords:
    dp: int
    pp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    nnodes: int = 1
    # Data-parallel attention: the dp replicas step in lockstep and their MoE layers form one
    # expert-parallel span (SGLang's --enable-dp-attention); otherwise replicas never meet.
    dp_attention: bool = False

    @classmethod
    def from_sizes(cls, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, nnodes: int = 1,
                   dp_attention: bool = False, cp: int = 1) -> Layout:
        """The grid the user's flags describe. With `dp_attention`, `tp` counts every rank (SGLang's
        meaning): dp replicas of tp / dp ranks each, and the MoE layers' experts split over all tp
        ranks (ep defaults to tp)."""
        if cp > 1 and (ep > 1 or dp_attention):
            raise LayoutError(f"--cp-size {cp} with {'--enable-dp-attention' if dp_attention else '--ep-size'} is "
                              f"not supported: context parallelism runs with tensor, pipeline and data parallelism")
        if not dp_attention:
            return cls(tp=tp, pp=pp, dp=dp, ep=ep, nnodes=nnodes, cp=cp)
        if dp < 2:
            raise LayoutError("--enable-dp-attention needs --dp-size > 1 (the number of attention replicas)")
        if tp % dp:
            raise LayoutError(f"--enable-dp-attention: --dp-size {dp} must divide --tp-size {tp} (the ranks the "
                              f"replicas share)")
        if pp > 1:
            raise LayoutError(f"--enable-dp-attention with --pp-size {pp} is not supported: replicas step in "
                              f"lockstep, one forward each per step")
        ep = tp if ep == 1 else ep
        if ep != tp:
            raise LayoutError(f"--enable-dp-attention: --ep-size {ep} must equal --tp-size {tp} (experts split "
                              f"whole over every rank; experts also split within a rank group are not built yet)")
        return cls(tp=tp // dp, pp=pp, dp=dp, ep=ep, nnodes=nnodes, dp_attention=True)

    def __post_init__(self) -> None:
        for flag, value in (("--tp-size", self.tp), ("--pp-size", self.pp), ("--dp-size", self.dp),
                            ("--cp-size", self.cp), ("--ep-size", self.ep), ("--nnodes", self.nnodes)):
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{flag} must be an integer >= 1, got {value!r}")
        if self.world % self.nnodes:
            raise LayoutError(f"--nnodes {self.nnodes} does not divide the {self.world} ranks "
                              f"({self._product_text()})")
        if self.dp_attention and (self.dp < 2 or self.pp > 1 or self.ep != self.moe_span):
            raise LayoutError(f"data-parallel attention needs dp > 1, pp 1 and ep = dp x cp x tp "
                              f"({self._product_text()}, ep {self.ep})")
        if self.ep > 1 and self.moe_span % self.ep:
            raise LayoutError(f"--ep-size {self.ep} does not divide the {self.moe_span} ranks the MoE layers span "
                              f"(dp {self.dp} x cp {self.cp} x tp {self.tp})")

    # ------------------------------------------------------------------ sizes

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nnodes

    @property
    def moe_span(self) -> int:
        """Ranks one pipeline stage's MoE layers span when ep > 1."""
        return self.dp * self.cp * self.tp

    @property
    def moe_tp(self) -> int:
        return self.moe_span // self.ep if self.ep > 1 else self.tp

    def _product_text(self) -> str:
        return f"dp {self.dp} x pp {self.pp} x cp {self.cp} x tp {self.tp}"

    def check_world(self, world: int, source: str) -> None:
        """A launcher told the world size another way (torchrun's WORLD_SIZE) must agree."""
        if world != self.world:
            raise LayoutError(f"{source} is {world} but the layout has {self.world} ranks ({self._product_text()})")

    def check_model(self, num_layers: int, num_heads: int, num_experts: int) -> None:
        if self.pp > num_layers:
            raise LayoutError(f"--pp-size {self.pp} exceeds the model's {num_layers} layers")
        if self.tp > num_heads:
            raise LayoutError(f"--tp-size {self.tp} exceeds the model's {num_heads} attention heads")
        if self.dp_attention and num_experts == 0:
            raise LayoutError("--enable-dp-attention needs a mixture-of-experts model (for a dense model, "
                              "--dp-size alone runs independent replicas)")
        if self.ep > 1 and num_experts == 0:
            raise LayoutError(f"--ep-size {self.ep} needs a mixture-of-experts model")
        if self.ep > num_experts > 0:
            raise LayoutError(f"--ep-size {self.ep} exceeds the model's {num_experts} experts")

    # ------------------------------------------------------------------ one rank

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank} is outside the {self.world} ranks")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        dp, pp = divmod(rest, self.pp)
        return Coords(dp, pp, cp, tp)

    def rank_of(self, c: Coords) -> int:
        return ((c.dp * self.pp + c.pp) * self.cp + c.cp) * self.tp + c.tp

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    @property
    def independent_replicas(self) -> bool:
        """Replicas that never meet (dp > 1 without data-parallel attention): each is its own
        torch.distributed world, so one can be stopped and started again while the others serve."""
        return self.dp > 1 and not self.dp_attention

    def replica_ranks(self, replica: int) -> range:
        """The global ranks of one data-parallel replica (data is the outermost index)."""
        per = self.pp * self.cp * self.tp
        return range(replica * per, (replica + 1) * per)

    def groups_of(self, rank: int) -> dict[str, tuple[int, ...]]:
        """For each group kind, the members of the group `rank` belongs to."""
        return {kind: next(g for g in self.all_groups(kind) if rank in g) for kind in GROUP_KINDS}

    # ------------------------------------------------------------------ every group

    def all_groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every group of one kind, in creation order, members ascending."""
        if kind in ("expert", "moe_tp"):
            return self._moe_groups(kind)
        vary = {"tensor": ("tp",), "context": ("cp",), "pipeline": ("pp",), "data": ("dp",),
                "control": ("pp", "cp", "tp")}[kind]
        sizes = {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}
        fixed = [a for a in ("dp", "pp", "cp", "tp") if a not in vary]
        groups = []
        for outer in itertools.product(*(range(sizes[a]) for a in fixed)):
            members = []
            for inner in itertools.product(*(range(sizes[a]) for a in vary)):
                at = dict(zip(fixed, outer)) | dict(zip(vary, inner))
                members.append(self.rank_of(Coords(**at)))
            groups.append(tuple(sorted(members)))
        return sorted(groups)

    def _moe_groups(self, kind: str) -> list[tuple[int, ...]]:
        if self.ep == 1:  # MoE layers use the tensor group; these kinds are single ranks
            return [(r,) for r in range(self.world)]
        groups = []
        for stage in range(self.pp):
            span = sorted(r for r in range(self.world) if self.coords(r).pp == stage)
            width = self.moe_tp
            if kind == "moe_tp":
                groups += [tuple(span[i : i + width]) for i in range(0, len(span), width)]
            else:
                groups += [tuple(span[i::width]) for i in range(width)]
        return sorted(groups)

    def creation_order(self, within: range | None = None) -> list[tuple[str, tuple[int, ...]]]:
        """(kind, members) for every group of more than one rank, in the one order all ranks use;
        with `within`, only the groups wholly inside those ranks (one replica's world)."""
        return [(kind, g) for kind in GROUP_KINDS for g in self.all_groups(kind)
                if len(g) > 1 and (within is None or all(r in within for r in g))]


@dataclass(frozen=True)
class RankSpec:
    """Where one scheduler process sits: its global rank in the layout, and the rendezvous
    address (host:port) every rank of the grid meets at. `device_index` picks the GPU where the
    launcher knows better than the layout's local rank (Ray's GPUs for the rank's node)."""

    rank: int = 0
    layout: Layout = Layout()
    master: str = ""
    device_index: int | None = None

    @property
    def local_rank(self) -> int:
        return self.layout.local_rank(self.rank) if self.device_index is None else self.device_index
