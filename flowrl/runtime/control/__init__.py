"""Job control: the training job for every placement (``job``, ``partitioned``, ``auto``), its
pre-flight and RunSpec, recovery, the launcher's torchrun agent and run health. Imports
``runtime.step`` and ``runtime.io``; neither imports it (pyproject's runtime layers contract)."""
