"""Functions: ``synk.function``, the ``Function`` the user calls, a call's plan and its run on
every rank, ``distribute()``, overlapped training steps."""
