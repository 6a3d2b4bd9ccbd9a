"""Clusters: one controller and one node master per MPI process (DESIGN.md, decision 9).

``mpiexec -n N python train.py`` starts the script N times.  In ``fork()``
each copy first forks its own local ranks, exactly as on one machine, and only
then initialises MPI (forking after ``MPI_Init`` is unsafe; the local ranks
never touch MPI).  MPI rank 0 becomes the controller: ``fork()`` returns
there and the program goes on.  Every other MPI process becomes a node
master: it serves the controller's commands and exits when the controller
closes, so the user's code after ``fork()`` never runs there.

Two worlds share this package.  Under a launcher (mpiexec, mpirun, srun)
MPI carries the messages between machines; where machines come and go (no
launcher, ``SYNK_LISTEN``/``SYNK_JOIN``) ZeroMQ and gloo do, and what only
that world uses is in ``elastic/``.  One module per job:

- ``launchers``: how this process was started (one ``Launcher`` class per launcher, in
  ``ROUTES``: whether it is present, where in its job this process is);
- ``launch``: MPI's start and end under that launcher, how a node master exits;
- ``slurm``: this process's place as a task of an srun step, from Slurm's variables;
- ``settings``: the cluster's settings from the environment (heartbeats, loss, joins);
- ``rendezvous``: how the processes find each other in ``fork()`` (MPI, the layout, sentinels);
- ``layout``: where the ranks are (``Layout``, ``layout()``, the LAYOUT command);
- ``link``: the link between machines' contract (``LinkBase``: tags, pickled messages,
  bounded waits), kept by every carrier;
- ``mpi_link``: that link over MPI point-to-point messages (``MpiLink``);
- ``controller``: the controller's side of every command (forward, reports);
- ``node``: the node master's side (``NodeSide``: serve commands, report, hold Data copies);
- ``reports``: what a node master reports after each command, and its packed form;
- ``recovery``: going on with the machines left after one is lost (ULFM);
- ``sentinel``: each node master's sentinel process and the heartbeats it sends;
- ``heartbeats``: the controller's end of the sentinels' connections (``Heartbeats``);
- ``doorbell``: waking an idle node master through its sentinel;
- ``auth``: the job's secret and the HMAC proof that a peer holds it (sentinels, joiners);
- ``elastic/``: machines that come and go: ``env`` (their settings), ``door`` (the
  controller's side), ``knocks`` (strangers at the door), ``join`` (a node master's
  side), ``zmq_link`` (the link over ZeroMQ).
"""
