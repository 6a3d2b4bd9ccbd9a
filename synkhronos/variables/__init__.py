"""Shared variables: collectives, reductions, values in single ranks, checkpoints."""
