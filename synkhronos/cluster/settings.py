"""Cluster settings from the environment: each one read here, and only here.

``SYNK_LISTEN``, ``SYNK_JOIN`` and the secret are parsed in ``elastic.env``
(where a launch is recognised); the rest of the cluster's knobs are below.
``fork_plan`` checks every value before anything starts.
"""

import os


def heartbeat_limit_s():
    """Seconds of silence after which a node master counts as stopped (``SYNK_HEARTBEAT_S``)."""
    return float(os.environ.get("SYNK_HEARTBEAT_S", "5"))


def ends_on_machine_loss():
    """Whether a lost machine ends the run (``SYNK_ON_MACHINE_LOSS=end``) rather than not."""
    return os.environ.get("SYNK_ON_MACHINE_LOSS", "continue") == "end"


def join_timeout_s():
    """How long a machine waits to be admitted, or fork() for its machines (``SYNK_JOIN_TIMEOUT_S``)."""
    return float(os.environ.get("SYNK_JOIN_TIMEOUT_S", "600"))


def controller_host():
    """The controller's address as the other machines reach it (``SYNK_CONTROLLER_HOST``), or None."""
    return os.environ.get("SYNK_CONTROLLER_HOST") or None
