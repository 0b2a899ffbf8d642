"""The engine's torch-free core: sequences, the scheduler, block bookkeeping, config, outputs."""
