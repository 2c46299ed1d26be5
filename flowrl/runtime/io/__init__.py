"""What crosses a rank's boundary: checkpoints, the run directory, metrics, the process group and
its collectives, pool-to-pool transport, the files left for the launcher. Imports neither
``runtime.step`` nor ``runtime.control``."""
