"""Collectives on shared variables: broadcast, scatter, gather, all_gather, reduce,
all_reduce, set_value, get_value, get_lengths, get_shapes."""
