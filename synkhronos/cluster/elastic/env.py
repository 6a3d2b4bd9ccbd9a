"""Machines that come and go: the controller's and node masters' settings (SYNK_LISTEN/SYNK_JOIN).

Read by ``launchers.launched``; used by ``rendezvous`` and ``elastic``.
"""

from typing import NamedTuple


class Elastic(NamedTuple):
    """This process's place in a cluster whose machines come and go (cluster/elastic/).

    The controller runs with ``SYNK_LISTEN=[HOST:]PORT``; each node master,
    started on its own, with ``SYNK_JOIN=HOST:PORT``; both hold the job's
    secret (``SYNK_SECRET`` or ``SYNK_SECRET_FILE``).
    """

    rank: int           # 0: the controller; -1: a node master (its machine number comes at join)
    size: int           # machines the controller's fork() waits for (SYNK_MACHINES), itself included
    local_index: int    # always 0: one node master per machine
    local_count: int    # always 1
    host: str           # where the controller listens (SYNK_LISTEN) or is (SYNK_JOIN)
    port: int
    secret: bytes


SECRET_MIN_BYTES = 16


def elastic_launch(env):
    """The ``Elastic`` this process was started as (``SYNK_LISTEN`` or ``SYNK_JOIN``), or None.

    Raises:
        ValueError: both set, an address without a port, or no secret of at
            least ``SECRET_MIN_BYTES`` bytes.
    """
    listen, join = env.get("SYNK_LISTEN"), env.get("SYNK_JOIN")
    if not listen and not join:
        return None
    if listen and join:
        raise ValueError("fork: set SYNK_LISTEN (the controller) or SYNK_JOIN (a node master), "
                         "not both")
    where = listen or join
    host, _, port = where.rpartition(":")
    if not port.isdigit() or (join and not host):
        raise ValueError(f"fork: {'SYNK_LISTEN' if listen else 'SYNK_JOIN'} must be "
                         f"{'[HOST:]PORT' if listen else 'HOST:PORT'}; got {where!r}")
    secret = env.get("SYNK_SECRET", "").encode()
    path = env.get("SYNK_SECRET_FILE")
    if not secret and path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"fork: SYNK_SECRET_FILE {path!r} cannot be read ({exc})") from None
    if len(secret) < SECRET_MIN_BYTES:
        raise ValueError(f"fork: machines that come and go need the job's secret, at least "
                         f"{SECRET_MIN_BYTES} bytes, in SYNK_SECRET or a file named by "
                         "SYNK_SECRET_FILE (the same on every machine)")
    machines = env.get("SYNK_MACHINES", "1")
    if not machines.isdigit() or int(machines) < 1:
        raise ValueError(f"fork: SYNK_MACHINES must be a number of machines >= 1; got {machines!r}")
    return Elastic(0 if listen else -1, int(machines), 0, 1, host, int(port), secret)
