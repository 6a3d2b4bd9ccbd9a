"""The runtime: the one process-global state, commands and the control block, the worker loop,
liveness, the janitor, shared memory, devices, profiling and the fork plan."""
