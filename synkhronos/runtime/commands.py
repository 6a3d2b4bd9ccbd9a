"""Commands: the Command enum, the table of handlers, and how each command travels.

A module that owns a command registers its handler with ``@handler`` and
says there, beside it, how the command travels in a cluster: whether the
machines' ranks leave results the controller collects, whether it stays on
the machine that posts it, and what a node master does with it before
posting it to its ranks.  The worker loop and the node master look the
command up in ``COMMANDS`` and name none.
"""

import enum
import pickle
from typing import Callable, NamedTuple, Optional


class Command(enum.IntEnum):
    """Every command a rank can run; handlers register under these."""

    QUIT = 0
    GROW_MESSAGE = 1
    DATA_ALLOC = 2
    DATA_FREE = 3
    DISTRIBUTE = 4
    CALL = 5
    BUILD = 6           # functions built at their first call, built ahead of it
    BROADCAST = 10
    SCATTER = 11
    GATHER = 12
    ALL_GATHER = 13
    REDUCE = 14
    ALL_REDUCE = 15
    SET_VALUE = 16
    GET_VALUE = 17
    GET_SHAPES = 18
    PROFILE = 19
    SAVE_STATE = 30
    LOAD_STATE = 31
    OVERLAP_STEP = 32
    LAYOUT = 40         # cluster: every rank learns its global rank
    DATA_SYNC = 41      # cluster: node masters copy written Data contents
    DATA_PRODUCE = 42   # cluster: every machine makes its rows of a Data
    DATA_SEND = 43      # cluster: each machine is sent the rows of a call's input it uses
    DATA_MAP = 44       # cluster: a machine's ranks map its part of a Data


class CommandSpec(NamedTuple):
    """A registered command: its handler and how it travels.

    Attributes:
        run: ``run(rt, payload)``, on every rank of every machine (None: ranks
            never run it; only node masters' ``node`` step does).
        message: the command's NamedTuple, or None.
        to_wire: the message's ``to_wire`` (a compact form), or None.
        from_wire: the message's ``from_wire``, or None.
        collected: cluster: each machine's ranks leave results (``Backend.contribute``)
            that its node master sends to the controller.
        combine: cluster: ``combine(rt, payload, entries)`` turns a machine's
            collected ``[(rank, arrays, weight)]`` into what travels (e.g. one partial
            per machine), or None: they travel per rank.
        local: stays on the machine that posts it (never forwarded to other machines).
        node: cluster: ``node(machine, payload)`` runs in a node master before the
            command is posted to its ranks and returns the payload to post, or None
            to post nothing (``machine`` is the node master: ``cluster.node.NodeSide``).
        final: the last command: a rank exits once it has run it.
        label: ``label(rt, payload)``, the name a profile gives one run of it.
        prepare: ``prepare(rt, payload)`` returns a runner (no arguments) that does
            what ``run(rt, payload)`` does, prepared once for a message the leader
            posts again and again (``Control.keep``), or None where it cannot be
            prepared; a worker runs the runner while its Data mappings stay
            (``Registry.epoch``).
    """

    run: Optional[Callable]
    message: Optional[type] = None
    to_wire: Optional[Callable] = None
    from_wire: Optional[Callable] = None
    collected: bool = False
    combine: Optional[Callable] = None
    local: bool = False
    node: Optional[Callable] = None
    final: bool = False
    label: Optional[Callable] = None
    prepare: Optional[Callable] = None


COMMANDS = {}


def register(cmd, run, message=None, *, collected=False, combine=None, local=False, node=None,
             final=False, label=None, prepare=None):
    """Register ``run(rt, payload)`` as the handler of ``cmd``; see ``CommandSpec``.

    ``message``, the command's NamedTuple, travels as a plain tuple (pickling
    a named tuple costs microseconds per call) and is rebuilt on arrival: by
    its ``from_wire`` (made with ``to_wire``) where it has one, else ``_make``.
    """
    COMMANDS[cmd] = CommandSpec(
        run, message, getattr(message, "to_wire", None), getattr(message, "from_wire", None),
        collected, combine, local, node, final, label, prepare)


def handler(cmd, message=None, **travel):
    """Decorate the handler of ``cmd``: ``register(cmd, fn, message, **travel)``."""
    def deco(fn):
        register(cmd, fn, message, **travel)
        return fn
    return deco


def label(cmd, rt, payload):
    """The name a profile gives one run of ``cmd``."""
    spec = COMMANDS.get(cmd)
    if spec is not None and spec.label is not None:
        return spec.label(rt, payload)
    return cmd.name.lower()


def encode(cmd, payload, frees=None):
    """Return the bytes that carry ``cmd`` with ``payload`` (and ids of dropped Data objects)."""
    spec = COMMANDS.get(cmd)
    if spec is not None and spec.message is not None and type(payload) is spec.message:
        payload = tuple(payload) if spec.to_wire is None else spec.to_wire(payload)
    return pickle.dumps((int(cmd), payload, frees), protocol=pickle.HIGHEST_PROTOCOL)


# Command(n) runs Python code in the enum machinery; a dict lookup does not.
_COMMANDS = {int(c): c for c in Command}


def decode(data):
    """Return (command, payload, ids of dropped Data objects or None) from ``encode``'s bytes."""
    cmd, raw, frees = pickle.loads(data)
    cmd = _COMMANDS[cmd]
    spec = COMMANDS.get(cmd)
    if spec is not None and spec.message is not None and type(raw) is tuple:
        raw = tuple.__new__(spec.message, raw) if spec.from_wire is None else spec.from_wire(raw)
    return cmd, raw, frees
