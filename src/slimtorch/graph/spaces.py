"""Channel spaces and groups: the bookkeeping under :mod:`slimtorch.graph.channels`.

A *space* is a set of channels that some layer made; spaces that must be pruned together are united
(union-find) into a :class:`ChannelGroup`. Every weight dimension a space reaches is a :class:`Slice`: channel
``c`` owns entries ``offset + c*factor ... + factor`` of that dimension. Attention heads and fused q/k/v
projections change the unit of a space after the fact (:meth:`Spaces.regroup`, :meth:`Spaces.partition`);
slices recorded before are moved to the new unit when the groups are read out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Segment:
    """``count`` channels of space ``space``, each spanning ``factor`` consecutive entries of the axis."""

    space: int
    count: int
    factor: int = 1


@dataclass(frozen=True)
class Layout:
    axis: int
    segments: tuple[Segment, ...]

    @property
    def size(self) -> int:
        return sum(s.count * s.factor for s in self.segments)


@dataclass(frozen=True)
class Slice:
    """Channel ``c`` of the group owns entries ``offset + c*factor ... + factor`` of ``key``'s ``dim``."""

    key: str
    dim: int
    offset: int = 0
    factor: int = 1
    role: str = "out"
    """"out": the weight that makes the channel; "in": a weight that reads it; "norm": a norm's vector."""

    def indices(self, channels: torch.Tensor) -> torch.Tensor:
        run = torch.arange(self.factor)
        return (self.offset + channels.unsqueeze(1) * self.factor + run).reshape(-1)


@dataclass
class ChannelGroup:
    """Channels that are pruned together: keep channel ``c`` everywhere or remove it everywhere."""

    size: int
    slices: list[Slice] = field(default_factory=list)
    reason: str | None = None
    """Why the group cannot be pruned (it reaches the output, an unknown op ...); None: prunable."""

    @property
    def prunable(self) -> bool:
        return self.reason is None and self.size > 1

    def keys(self, role: str | None = None) -> list[str]:
        return sorted({s.key for s in self.slices if role is None or s.role == role})


class Spaces:
    """Union-find over channel spaces, with the slices and freeze reasons each space collects."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.size: list[int] = []
        self.slices: dict[int, list[Slice]] = {}
        self.reason: dict[int, str] = {}
        self.alias: dict[int, list[tuple[int, int, int]]] = {}
        """root -> [(space, start, run)]: the root's channels from ``start`` on are that space's channels,
        each ``run`` of the root's: one entry for heads (``regroup``), several for a ``split``"""

    def new(self, size: int, reason: str | None = None) -> int:
        self.parent.append(len(self.parent))
        self.size.append(size)
        if reason:
            self.reason[len(self.parent) - 1] = reason
        return len(self.parent) - 1

    def find(self, space: int) -> int:
        while self.parent[space] != space:
            self.parent[space] = self.parent[self.parent[space]]
            space = self.parent[space]
        return space

    def union(self, a: int, b: int) -> None:
        a, b = self.find(a), self.find(b)
        if a == b:
            return
        if self.size[a] != self.size[b]:
            self.freeze(a, "channels of different sizes meet")
            self.freeze(b, "channels of different sizes meet")
        self.parent[b] = a

    def freeze(self, space: int, reason: str) -> None:
        self.reason.setdefault(space, reason)

    def attach(self, layout: Layout, key: str | None, dim: int, role: str) -> None:
        """Record that ``key``'s ``dim`` runs along ``layout``'s channel axis."""
        if key is None:
            return
        offset = 0
        for segment in layout.segments:
            self.slices.setdefault(segment.space, []).append(Slice(key, dim, offset, segment.factor, role))
            offset += segment.count * segment.factor

    def regroup(self, space: int, run: int) -> int:
        """A new space whose channel ``h`` is channels ``h*run ... + run`` of ``space``'s group (a head of
        ``run`` features); what the group collected so far is pruned a whole head at a time from now on."""
        root = self.find(space)
        heads = self.new(self.size[root] // run)
        self.alias[root] = [(heads, 0, run)]
        return heads

    def partition(self, space: int, sizes: list[int]) -> list[int]:
        """New spaces for consecutive pieces of ``space``'s group (``split`` of a fused q/k/v projection)."""
        root = self.find(space)
        pieces, start = [], 0
        for size in sizes:
            pieces.append(self.new(size))
            self.alias.setdefault(root, []).append((pieces[-1], start, 1))
            start += size
        return pieces

    def place(self, space: int, piece: Slice) -> list[tuple[int, Slice]]:
        """Where a slice recorded on ``space`` ends up once regroupings and partitions are followed."""
        root = self.find(space)
        if root not in self.alias:
            return [(root, piece)]
        placed = []
        for target, start, run in self.alias[root]:
            moved = Slice(
                piece.key, piece.dim, piece.offset + start * piece.factor, piece.factor * run, piece.role
            )
            placed += self.place(target, moved)
        return placed

    def roots(self, space: int) -> list[int]:
        """The groups a space ends up in (several after a partition)."""
        root = self.find(space)
        if root not in self.alias:
            return [root]
        return [r for target, _, _ in self.alias[root] for r in self.roots(target)]

    def groups(self) -> list[ChannelGroup]:
        by_root: dict[int, ChannelGroup] = {}
        for space in range(len(self.parent)):
            for piece in self.slices.get(space, []):
                for root, moved in self.place(space, piece):
                    by_root.setdefault(root, ChannelGroup(self.size[root])).slices.append(moved)
        for space, reason in self.reason.items():
            for root in self.roots(space):
                group = by_root.setdefault(root, ChannelGroup(self.size[root]))
                group.reason = group.reason or reason
        return [g for g in by_root.values() if g.slices]
