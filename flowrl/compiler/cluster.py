"""A cluster you may not have: the hardware description ``flowrl plan cluster=<name>`` plans for.

The presets are ``conf/cluster/<name>.yaml`` (each number with its vendor source in a comment);
this dataclass is their schema. Units: FLOP/s, bytes, bytes/s, all *one direction* per GPU (or per
node for ``internode_bw``), peak values from the datasheets. What the hardware reaches in
practice is the cost model's business (``flowrl/compiler/cost.py`` ``CALIBRATION``), not this one's.

No torch, no engine: a cluster is planned on a laptop.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ClusterConfig:
    """One homogeneous GPU cluster (``cluster=<name>``: ``conf/cluster/<name>.yaml``).

    Attributes:
        name: the preset's name (printed in the plan).
        gpu: the GPU model, e.g. ``H200 SXM 141GB``.
        gpus_per_node: GPUs in one NVLink domain (one node).
        nodes: nodes of the cluster; world size = nodes × gpus_per_node.
        peak_bf16_flops: dense (no sparsity) BF16 tensor-core peak of one GPU, FLOP/s.
        hbm_bytes: HBM capacity of one GPU, bytes.
        hbm_bw: HBM bandwidth of one GPU, bytes/s.
        nvlink_bw: NVLink bandwidth of one GPU to the others of its node, one direction, bytes/s.
        internode_bw: network bandwidth of one node to the other nodes, one direction, bytes/s
            (the sum over its NICs).
        host_bw: GPU <-> host (PCIe) bandwidth of one GPU, one direction, bytes/s.

    Raises:
        ValueError: a count below 1 or a non-positive rate, naming the ``cluster.<field>``.
    """

    name: str
    gpu: str
    gpus_per_node: int
    nodes: int
    peak_bf16_flops: float
    hbm_bytes: float
    hbm_bw: float
    nvlink_bw: float
    internode_bw: float
    host_bw: float

    def __post_init__(self) -> None:
        for f in ("gpus_per_node", "nodes"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"cluster.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("peak_bf16_flops", "hbm_bytes", "hbm_bw", "nvlink_bw", "internode_bw", "host_bw"):
            if not float(getattr(self, f)) > 0:
                raise ValueError(f"cluster.{f} must be > 0, got {getattr(self, f)}")

    @property
    def world(self) -> int:
        """GPUs of the cluster."""
        return self.gpus_per_node * self.nodes

    def link_bw(self, gpus: int) -> float:
        """Bytes/s one GPU of a group of ``gpus`` GPUs (packed onto the fewest nodes) exchanges
        with the rest of the group in a ring collective: NVLink inside one node; across nodes the
        node's network share per GPU (internode_bw / gpus_per_node), the slowest hop of the ring."""
        if gpus <= self.gpus_per_node:
            return self.nvlink_bw
        return min(self.nvlink_bw, self.internode_bw / self.gpus_per_node)

    def between_pools_bw(self, a: int, b: int) -> float:
        """Bytes/s of a pipelined broadcast from a pool of ``a`` GPUs to one of ``b`` GPUs: NVLink
        when both fit in one node, else a node's network bandwidth (NCCL runs one ring per NIC,
        so a broadcast crosses a node boundary at the sum of the node's NICs)."""
        if a + b <= self.gpus_per_node:
            return self.nvlink_bw
        return min(self.nvlink_bw, self.internode_bw)


__all__ = ["ClusterConfig"]
