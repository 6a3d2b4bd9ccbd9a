"""Peers: the other machines of a run, as one machine's commands see them.

On one machine there are none, and every method of ``Peers`` does nothing:
the one-machine path calls them and knows nothing of clusters.  In a cluster
the controller (``cluster.controller.Controller``) and each node master
(``cluster.node.NodeMaster``) implement them.
"""


class Peers:
    """No other machine: what a one-machine run has.

    Attributes:
        layout: the run's ``cluster.layout.Layout`` when it spans machines, else None.
        copies: whether other machines hold copies of every Data (then Data is
            written only through its API, which mirrors each write).
    """

    layout = None
    copies = False

    def forward(self, cmd, data):
        """Send the bytes of command ``cmd``, just posted here, to the other machines."""

    def between(self, name=None):
        """Before public call ``name``: admit machines that asked to join (where machines come and go)."""

    def watch(self, callback):
        """Call ``callback(event, machine, layout)`` when machines join or are lost (none here)."""

    def finish(self, check):
        """After this machine's end barrier: wait for the other machines' share of the command.

        Returns their ranks' failures, ``{rank: (traceback text, exception or None)}``.
        """
        return None

    def survive(self, rt, exc, seq, local_ok):
        """Return the error to raise if the run goes on after ``exc`` (a lost machine), else None.

        ``seq`` is the command that met it; ``local_ok`` whether this process's
        own share of it finished.  None: the run ends (the caller abandons it).
        """
        return None

    def mirror(self, cmd, payload, attachment):
        """Run ``cmd`` on the other machines' leaders only, ``attachment`` (bytes) after it.

        How a write to a Data reaches the other machines' copies (DATA_SYNC):
        what each leader does is the command's ``node`` step.
        """

    def send_data(self, machine, buffer):
        """Send ``buffer`` to ``machine`` as the data of the command in flight."""
        raise RuntimeError("no other machine to send data to")

    def late_ranks(self):
        """The global ranks of machines that have not finished the current command."""
        return []

    def poll(self):
        """Raise if another machine was lost or failed (called while this machine waits)."""

    def end(self):
        """After a failure the run cannot survive: have every other machine end."""

    def close(self):
        """At the run's end, after the last command."""


ALONE = Peers()
