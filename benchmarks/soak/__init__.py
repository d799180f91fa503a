"""The chaos soak (benchmarks/chaos_soak.py): seeded faults against Nightwatch and a baseline.

Pure parts (`schedule`, `progress`, `score`) are plain functions tested without services; the
rest drives the real stack (`services`, `faults`, `nightwatch`, `baseline`).
"""
