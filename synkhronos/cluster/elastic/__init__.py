"""Machines that come and go: no launcher, ZeroMQ between the leaders, gloo for their collectives.

The controller runs with ``SYNK_LISTEN=[HOST:]PORT``; each node master is
started on its own with ``SYNK_JOIN=HOST:PORT``, both with the job's secret
(docs/elastic.md).  The rest of ``cluster/`` (the controller's and the node
master's sides, sentinels and heartbeats, layouts) serves both worlds; what
only this one uses is here, one module per job:

- ``env``: ``SYNK_LISTEN`` / ``SYNK_JOIN`` / the secret, read by ``launch`` (no ZeroMQ, no torch);
- ``door``: the controller's side: ``fork()``'s entry, the door and its thread, admitting,
  catching up, regrouping, dropping a lost machine;
- ``knocks``: strangers at that door: challenge, HMAC proof, refusal, in bounded memory;
- ``join``: a node master's side: joining, following the controller's membership changes;
- ``zmq_link``: the link between the leaders over ZeroMQ (``link.LinkBase``'s carrier here).

Nothing is imported here: ``launch`` reads ``env`` where ZeroMQ and torch
may be missing, and the other modules are imported only where machines
come and go (``rendezvous``).
"""
