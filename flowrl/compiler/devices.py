"""Throughput profiles of the device kinds the cost model knows (``placement.auto.device``).

Its own module because both the placement config (which checks the name) and the cost model
(which reads the numbers) need it, and cost.py imports placement.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

INF = float("inf")


@dataclass(frozen=True)
class DeviceProfile:
    """Throughput defaults of one device kind.

    Attributes:
        flops: effective FLOP/s of one device on dense matmuls (peak × an assumed utilisation).
        mem_bw: effective bytes/s of weight reads while decoding (bounds small-batch decode).
        link_bw: bytes/s between two devices of the job (weight broadcast, transfers).
        host_bw: bytes/s device <-> host (offload/onload); inf = a swap moves nothing (CPU).
        memory: bytes of one device (None = host RAM, not checked).
    """

    name: str
    flops: float
    mem_bw: float
    link_bw: float
    host_bw: float
    memory: Optional[int] = None


DEVICES: dict[str, DeviceProfile] = {
    # calibrated on benchmarks/results/default_job_cpu.md (SmolLM2-135M fp32, B=16, R≈200 on 2
    # cores: update ≈ 30 s → 1.5e11 FLOP/s; rollout ≈ 32 s → 3.4e9 B/s of weights per token step);
    # gloo over loopback TCP ≈ 1 GB/s.
    "cpu": DeviceProfile("cpu", flops=1.5e11, mem_bw=3.4e9, link_bw=1e9, host_bw=INF),
    # H200 SXM: 989 TFLOP/s dense bf16 at 40% MFU; 4.8 TB/s HBM3e at 70%; NVLink 4 broadcast bus
    # bandwidth ≈ 300 GB/s; PCIe 5 x16 ≈ 50 GB/s to host; 141 GB HBM.
    "h200": DeviceProfile("h200", flops=989e12 * 0.4, mem_bw=4.8e12 * 0.7, link_bw=3e11,
                          host_bw=5e10, memory=141 * 10**9),
}
