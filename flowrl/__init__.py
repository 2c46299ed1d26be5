import os

# OpenMP threads that finish a parallel region sleep instead of spinning (libgomp reads this when
# torch loads, so it is set before any flowrl module imports torch; your own setting wins). On a
# shared CPU the spinning threads take the cores other processes need: a training step was 1.4-3x
# faster with passive waiting beside busy neighbours (benchmarks/results/threads_cpu.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
