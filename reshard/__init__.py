"""reshard: reshape Megatron-Core checkpoints across TP/PP/EP and convert between formats."""

__version__ = "0.1.0"
