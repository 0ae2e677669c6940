"""GPU hardware presets (links, latencies, GPU speed, HBM) and the one parser of ``--cluster`` / ``--cluster-preset``.

A :class:`~moeplace.placement.Cluster` is a topology (N nodes x G GPUs) plus the performance numbers of the time
model; those numbers are one :class:`Hardware` record. A :class:`ClusterPreset` is a GPU system: its G and its
Hardware, nothing duplicated; choose the number of nodes when you use one (``preset.cluster(4)``).

``--cluster`` everywhere goes through :func:`parse_cluster`: ``NxG`` (generic links: the ``Cluster`` defaults),
a preset name (one node of it), or ``N`` / ``NxG`` with ``--cluster-preset`` (N nodes of the preset; with ``NxG``
the preset's links and GPU on G GPUs per node, which may differ from the preset's own G: a shape its links
describe, priced per GPU; :func:`cluster_note` says so). Digits are ASCII only (``４x２`` is refused, not read as 4x2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the CLI reads the presets without numpy
    from moeplace.placement import Cluster


@dataclass(frozen=True)
class Hardware:
    """Per-GPU performance of a GPU system (numbers per direction); the non-topology fields of a Cluster."""

    intra_bw: float  # bytes/s per GPU inside a node (scale-up: NVLink / Infinity Fabric)
    inter_bw: float  # bytes/s per GPU between nodes (scale-out NIC per GPU)
    intra_latency: float  # seconds per message (alpha) inside a node
    inter_latency: float  # seconds per message between nodes
    expert_flops: float  # achieved FLOP/s per GPU on expert GEMMs (an assumption: about half of dense peak)
    hbm_bw: float  # bytes/s of HBM per GPU (vendor spec sheet; docs/PRESETS.md gives each source)
    compute_overhead: float = 5e-6  # seconds per expert-compute kernel (launch and tail; an assumption)

    def cluster(self, num_nodes: int, gpus_per_node: int) -> Cluster:
        """A ``num_nodes`` x ``gpus_per_node`` cluster of this hardware."""
        from moeplace.placement import Cluster

        return Cluster(num_nodes, gpus_per_node, **{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def of(cls, cluster: Cluster) -> Hardware:
        """The hardware record of ``cluster`` (its links and speeds, without N and G)."""
        return cls(**{f.name: getattr(cluster, f.name) for f in fields(cls)})


HARDWARE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Hardware))


@dataclass(frozen=True)
class ClusterPreset:
    """A GPU system: GPUs per node and their hardware."""

    name: str  # preset key, e.g. "h200-8"
    gpus_per_node: int  # G
    hardware: Hardware
    note: str = ""  # where the numbers come from

    def cluster(self, num_nodes: int) -> Cluster:
        return self.hardware.cluster(num_nodes, self.gpus_per_node)


GB = 1e9


def _hw(intra_gb: float, inter_gb: float, intra_lat: float, inter_lat: float, flops: float, hbm_gb: float
        ) -> Hardware:
    return Hardware(intra_gb * GB, inter_gb * GB, intra_lat, inter_lat, flops, hbm_gb * GB)


CLUSTER_PRESETS: dict[str, ClusterPreset] = {c.name: c for c in (
    ClusterPreset("h100-8", 8, _hw(450, 50, 3e-6, 10e-6, 400e12, 3350),
                  "DGX/HGX H100: NVLink 4 900 GB/s bidirectional; one 400 Gb/s ConnectX-7 NDR NIC per GPU"),
    ClusterPreset("h200-8", 8, _hw(450, 50, 3e-6, 10e-6, 400e12, 4800),
                  "HGX H200: same NVLink 4 and 400 Gb/s NDR per GPU as H100; more HBM"),
    ClusterPreset("h800-8", 8, _hw(200, 50, 3e-6, 10e-6, 400e12, 3350),
                  "H800 (DeepSeek's training cluster): NVLink 400 GB/s bidirectional, 400 Gb/s IB per GPU"),
    ClusterPreset("a100-8", 8, _hw(300, 25, 3e-6, 10e-6, 150e12, 2039),
                  "DGX A100: NVLink 3 600 GB/s bidirectional; one 200 Gb/s HDR NIC per GPU"),
    ClusterPreset("b200-8", 8, _hw(900, 50, 3e-6, 10e-6, 1000e12, 8000),
                  "HGX B200: NVLink 5 1.8 TB/s bidirectional; 400 Gb/s NIC per GPU (800 Gb/s with CX-8: use inter_bw)"),
    ClusterPreset("gb200-nvl72", 72, _hw(900, 100, 3e-6, 10e-6, 1000e12, 8000),
                  "GB200 NVL72: 72 GPUs in one NVLink domain; 800 Gb/s ConnectX-8 per GPU between racks"),
    ClusterPreset("mi300x-8", 8, _hw(448, 50, 4e-6, 10e-6, 500e12, 5300),
                  "AMD MI300X platform: 7 Infinity Fabric links x 64 GB/s per direction; 400 Gb/s NIC per GPU"),
)}


def get_cluster_preset(name: str) -> ClusterPreset:
    try:
        return CLUSTER_PRESETS[str(name).lower()]
    except KeyError:
        raise ValueError(f"cluster preset {name!r}: expected one of {sorted(CLUSTER_PRESETS)}") from None


_SHAPE = re.compile(r"\s*([0-9]{1,7})\s*[xX*]\s*([0-9]{1,7})\s*", re.ASCII)
_NODES = re.compile(r"\s*([0-9]{1,7})\s*", re.ASCII)


def parse_cluster(spec: str, preset: str | None = None) -> Cluster:
    """The cluster ``--cluster SPEC [--cluster-preset PRESET]`` names (the module docstring gives the forms).

    ValueError naming the spec and the forms expected otherwise (full-width or other non-ASCII digits included).
    """
    from moeplace.placement import Cluster

    s = str(spec)
    cp = None if preset is None else get_cluster_preset(preset)
    shape, nodes = _SHAPE.fullmatch(s), _NODES.fullmatch(s)
    if cp is None:
        if s.strip().lower() in CLUSTER_PRESETS:
            return CLUSTER_PRESETS[s.strip().lower()].cluster(1)
        if shape is None:
            hint = " (or NODES with --cluster-preset)" if nodes else ""
            raise ValueError(f"cluster {spec!r}: expected NODESxGPUS with ASCII digits (e.g. 4x2) or a cluster preset "
                             f"({', '.join(sorted(CLUSTER_PRESETS))}){hint}")
        return Cluster(int(shape.group(1)), int(shape.group(2)))
    if nodes is not None:
        return cp.cluster(int(nodes.group(1)))
    if shape is not None:  # any G: the preset's links and GPU, priced per GPU, on the shape asked for
        return cp.hardware.cluster(int(shape.group(1)), int(shape.group(2)))
    if s.strip().lower() == cp.name:
        return cp.cluster(1)
    raise ValueError(f"cluster {spec!r} with --cluster-preset {cp.name}: expected NODES (e.g. 4) or "
                     f"NODESxGPUS (e.g. 4x{cp.gpus_per_node}) with ASCII digits")


def cluster_note(spec: str, preset: str | None) -> str | None:
    """The line to print when ``--cluster NxG --cluster-preset P`` asks for G GPUs per node where the preset's
    system has another number (its links and GPU are used per GPU); None otherwise (or for a spec parse_cluster
    refuses, which says why itself)."""
    if preset is None:
        return None
    shape = _SHAPE.fullmatch(str(spec))
    cp = get_cluster_preset(preset)
    if shape is None or int(shape.group(2)) == cp.gpus_per_node:
        return None
    n, g = int(shape.group(1)), int(shape.group(2))
    return (f"note: --cluster {n}x{g} --cluster-preset {cp.name}: {n} nodes of {g} GPUs with {cp.name}'s links and "
            f"GPU (the preset's system has {cp.gpus_per_node} GPUs per node; per-GPU NVLink and NIC rates are "
            "kept)")

