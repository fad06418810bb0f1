"""Helpers that build and run real Megatron-Core models (used by the test fixtures)."""
