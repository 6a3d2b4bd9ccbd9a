"""Inputs: Data objects in shared memory (``synk.data``), Data produced where it is used, and
which rows each rank and machine reads."""
