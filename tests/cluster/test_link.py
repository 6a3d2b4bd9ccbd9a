"""cluster.link: what needs no MPI (the head of a forwarded command)."""

from synkhronos.cluster import link


def test_command_head_carries_the_number_and_the_generation():
    raw = link.CMD_HEAD.pack(41, 3) + b"payload"
    assert link.CMD_HEAD.unpack_from(raw) == (41, 3)
    assert raw[link.CMD_HEAD.size:] == b"payload"
