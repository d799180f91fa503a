"""The code that runs inside a SLURM (or local) task: rank setup, registration, training."""
