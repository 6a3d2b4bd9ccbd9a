"""Clusters: one controller and one node master per MPI process (DESIGN.md, decision 9).

``mpiexec -n N python train.py`` starts the script N times.  In ``fork()``
each copy first forks its own local ranks, exactly as on one machine, and only
then initialises MPI (forking after ``MPI_Init`` is unsafe; the local ranks
never touch MPI).  MPI rank 0 becomes the controller: ``fork()`` returns
there and the program goes on.  Every other MPI process becomes a node
master: it serves the controller's commands and exits when the controller
closes, so the user's code after ``fork()`` never runs there.

One module per job:

- ``launch``: whether mpiexec started us, MPI's start and end, how a node master exits;
- ``layout``: where the ranks are (``Layout``, ``layout()``, the LAYOUT command);
- ``link``: MPI point-to-point messages between machines (tags, sends, receives);
- ``sentinel``: each node master's sentinel process and the heartbeats it sends;
- ``controller``: the controller's side of every command (forward, reports);
- ``node``: the node master's side (serve commands, report, hold Data copies);
- ``rendezvous``: how the processes find each other in ``fork()``.
"""
