"""chgnet's CHGNet from chgnet's own source, without pymatgen, ase or nvidia_smi (not installed).

The model, its layers, its composition model and its graph converter are the package's code
(:mod:`tests.wild.package_code`): the modules that import only torch and NumPy are imported, the classes
of modules that import pymatgen at the top are executed from their source. What pymatgen would provide is
the structure handed to the converter: :class:`Crystal` gives the converter the few things it reads
(species, coordinates, lattice, and the periodic neighbour list, computed here with NumPy).
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import math
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch
from torch import Tensor, nn

from tests.wild import package_code


@dataclass(frozen=True)
class _Species:
    Z: int


@dataclass(frozen=True)
class _Site:
    specie: _Species


@dataclass(frozen=True)
class _Lattice:
    matrix: np.ndarray


class Crystal:
    """A periodic crystal, as much of a pymatgen ``Structure`` as chgnet's converter reads.

    Example:
        >>> salt = Crystal.cubic(5.64, [11, 11, 11, 11, 17, 17, 17, 17], ROCKSALT)
        >>> len(salt), salt.composition.formula
        (8, 'Z11 4 Z17 4')
    """

    def __init__(self, lattice: np.ndarray, numbers: Sequence[int], frac_coords: np.ndarray) -> None:
        self.lattice = _Lattice(np.asarray(lattice, dtype=np.float64))
        self.frac_coords = np.asarray(frac_coords, dtype=np.float64) % 1.0
        self.sites = [_Site(_Species(int(z))) for z in numbers]
        counts = {z: list(numbers).count(z) for z in dict.fromkeys(numbers)}
        self.composition = _Composition(" ".join(f"Z{z} {n}" for z, n in counts.items()))

    @classmethod
    def cubic(cls, a: float, numbers: Sequence[int], frac_coords: Sequence[Sequence[float]]) -> Crystal:
        return cls(np.eye(3) * a, numbers, np.asarray(frac_coords))

    def __len__(self) -> int:
        return len(self.sites)

    def __iter__(self):
        return iter(self.sites)

    def get_neighbor_list(
        self, r: float, sites: Sequence[_Site], numerical_tol: float = 1e-8
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every (centre, neighbour, image) pair closer than ``r``, as pymatgen's
        ``Structure.get_neighbor_list`` returns them: the atom itself at distance 0 excluded."""
        matrix = self.lattice.matrix
        # enough images in each direction to cover r: r over the distance between opposite faces
        volume = abs(np.linalg.det(matrix))
        reach = [
            math.ceil(r * np.linalg.norm(np.cross(matrix[i - 2], matrix[i - 1])) / volume) for i in range(3)
        ]
        images = np.array(list(itertools.product(*(range(-n, n + 1) for n in reach))), dtype=np.int64)
        cart = self.frac_coords @ matrix
        centres, neighbours, offsets, distances = [], [], [], []
        for image in images:
            shifted = cart + image @ matrix
            gap = np.linalg.norm(shifted[None, :, :] - cart[:, None, :], axis=-1)
            i, j = np.nonzero((gap < r) & (gap > numerical_tol))
            centres.append(i)
            neighbours.append(j)
            offsets.append(np.repeat(image[None], len(i), axis=0))
            distances.append(gap[i, j])
        order = np.argsort(np.concatenate(centres), kind="stable")
        return (
            np.concatenate(centres)[order],
            np.concatenate(neighbours)[order],
            np.concatenate(offsets)[order].astype(np.float64),
            np.concatenate(distances)[order],
        )


@dataclass(frozen=True)
class _Composition:
    formula: str


ROCKSALT = [
    [0, 0, 0],
    [0.5, 0.5, 0],
    [0.5, 0, 0.5],
    [0, 0.5, 0.5],
    [0.5, 0, 0],
    [0, 0.5, 0],
    [0, 0, 0.5],
    [0.5, 0.5, 0.5],
]
DIAMOND = [
    [0, 0, 0],
    [0.5, 0.5, 0],
    [0.5, 0, 0.5],
    [0, 0.5, 0.5],
    [0.25, 0.25, 0.25],
    [0.75, 0.75, 0.25],
    [0.75, 0.25, 0.75],
    [0.25, 0.75, 0.75],
]
PEROVSKITE = [[0, 0, 0], [0.5, 0.5, 0.5], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]]


def crystals(seed: int = 7) -> list[Crystal]:
    """Six textbook crystals, each atom moved up to 0.05 A off its site (structures a relaxation or a
    molecular-dynamics step would see): NaCl, MgO, Si, SrTiO3, bcc Fe, fcc Cu."""
    rng = np.random.default_rng(seed)
    made = [
        Crystal.cubic(5.64, [11] * 4 + [17] * 4, ROCKSALT),
        Crystal.cubic(4.21, [12] * 4 + [8] * 4, ROCKSALT),
        Crystal.cubic(5.43, [14] * 8, DIAMOND),
        Crystal.cubic(3.905, [38, 22, 8, 8, 8], PEROVSKITE),
        Crystal.cubic(2.87, [26, 26], [[0, 0, 0], [0.5, 0.5, 0.5]]),
        Crystal.cubic(3.61, [29] * 4, ROCKSALT[:4]),
    ]
    return [
        Crystal(
            c.lattice.matrix,
            [s.specie.Z for s in c],
            c.frac_coords + rng.uniform(-0.05, 0.05, c.frac_coords.shape) / c.lattice.matrix[0, 0],
        )
        for c in made
    ]


# -- the package's classes -----------------------------------------------------------------------------------
@functools.cache
def classes() -> dict[str, type]:
    """CHGNet, its BatchedGraph and its CrystalGraphConverter, from chgnet 0.4.2's source."""
    functions = package_code.module("chgnet.model.functions")
    layers = package_code.module("chgnet.model.layers")
    encoders = package_code.module("chgnet.model.encoders")
    crystalgraph = package_code.module("chgnet.graph.crystalgraph")
    graph = package_code.definitions(  # imports chgnet.utils (nvidia_smi) only to save graphs as JSON
        "chgnet",
        "graph/graph.py",
        ["Node", "Edge", "UndirectedEdge", "DirectedEdge", "Graph"],
        {"sys": sys, "ABC": __import__("abc").ABC, "abstractmethod": __import__("abc").abstractmethod},
    )
    converter = package_code.definitions(
        "chgnet",
        "graph/converter.py",
        ["CrystalGraphConverter"],
        # make_graph None: the compiled fast converter imports chgnet.utils; the legacy one is the same graph
        {
            "np": np,
            "torch": torch,
            "nn": nn,
            "gc": __import__("gc"),
            "sys": sys,
            "warnings": warnings,
            "CrystalGraph": crystalgraph.CrystalGraph,
            "TORCH_DTYPE": crystalgraph.TORCH_DTYPE,
            "make_graph": None,
            **graph,
        },
    )["CrystalGraphConverter"]
    common = {
        "torch": torch,
        "nn": nn,
        "Tensor": Tensor,
        "np": np,
        "Structure": Crystal,
        "CrystalGraph": crystalgraph.CrystalGraph,
    }
    composition = package_code.definitions(
        "chgnet",
        "model/composition_model.py",
        ["CompositionModel", "AtomRef"],
        {
            **common,
            "collections": __import__("collections"),
            "GatedMLP": functions.GatedMLP,
            "find_activation": functions.find_activation,
        },
    )
    model = package_code.definitions(
        "chgnet",
        "model/model.py",
        ["CHGNet", "BatchedGraph"],
        {
            **common,
            "math": math,
            "os": os,
            "Sequence": Sequence,
            "dataclass": dataclass,
            "Literal": Literal,
            "get_args": get_args,
            "PredTask": package_code.module("chgnet").PredTask,
            "CrystalGraphConverter": converter,
            "TORCH_DTYPE": crystalgraph.TORCH_DTYPE,
            "AtomRef": composition["AtomRef"],
            "AngleEncoder": encoders.AngleEncoder,
            "AtomEmbedding": encoders.AtomEmbedding,
            "BondEncoder": encoders.BondEncoder,
            "MLP": functions.MLP,
            "GatedMLP": functions.GatedMLP,
            "find_normalization": functions.find_normalization,
            **{
                name: getattr(layers, name)
                for name in ("AtomConv", "BondConv", "AngleUpdate", "GraphPooling", "GraphAttentionReadOut")
            },
            "determine_device": None,  # only CHGNet.load uses it
        },
    )
    return {**model, "CrystalGraphConverter": converter}


def build(model_args: dict) -> nn.Module:
    """``CHGNet(**model_args)`` as ``CHGNet.from_dict`` builds it, without its greeting on stdout and the
    warning that the compiled graph converter is not there."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return classes()["CHGNet"](**model_args).eval()


def graphs(model_args: dict, seed: int = 7) -> list:
    """:func:`crystals` through chgnet's graph converter with the model's cutoffs."""
    convert = classes()["CrystalGraphConverter"](
        atom_graph_cutoff=model_args["atom_graph_cutoff"],
        bond_graph_cutoff=model_args["bond_graph_cutoff"],
        algorithm="legacy",
    )
    return [convert(crystal) for crystal in crystals(seed)]
