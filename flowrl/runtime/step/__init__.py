"""Step execution on one rank: the executor, the tensor store and its device rule, the refill
loop, the engine factory (``resources``), the weight-sync check and greedy evaluation. Imports
``runtime.io``, never ``runtime.control``."""
