"""Megatron-Core GPT training for Nightwatch.

Kept import-light on purpose: the worker imports `megatron_runs.train` to build its task and
must not pay for torch until training starts. Heavy modules are imported where used.
"""
