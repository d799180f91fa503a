"""Megatron-Core GPT training for Nightwatch.

Kept import-light on purpose: the supervisor imports `contracts.checkpoints` to read
checkpoint metadata and must not pay for torch. Heavy modules are imported where used.
"""
