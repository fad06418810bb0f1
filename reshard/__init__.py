"""reshard: reshape Megatron-Core checkpoints across TP/PP/EP and convert between formats."""

import os
import sys

__version__ = "0.1.0"

# Our worker threads each run small matrix products (checksums); OpenBLAS's own threads would spin on
# the same cores, doubling a conversion's CPU time (benchmarks/README.md, "Measurements behind defaults"). The setting only
# takes effect if numpy is not loaded yet, and a user's own OPENBLAS_NUM_THREADS wins.
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
