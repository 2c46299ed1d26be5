import os

# OpenMP threads that finish a parallel region sleep instead of spinning (libgomp reads this when
# torch loads, so it is set before any flowrl module imports torch; your own setting wins). On a
# shared CPU spinning threads take the cores other processes need: a training step took 3.3-5.5x
# less time with passive waiting (benchmarks/results/threads_cpu.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
