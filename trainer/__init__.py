"""A minimal Megatron-Core training loop (`python -m reshard.trainer`) and the pieces it shares with the test
fixtures: CPU compatibility, model building, optimizer, data pipeline and checkpointing."""
