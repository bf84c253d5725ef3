"""Ids: random version 4 UUIDs, unique across threads and across a fork."""

from __future__ import annotations

import os
import threading
from uuid import UUID

from reprise_common.events import new_id


def test_ids_are_version_4_uuids_and_never_repeat_across_threads() -> None:
    seen: list[list[str]] = [[] for _ in range(4)]

    def draw(out: list[str]) -> None:
        out.extend(new_id() for _ in range(5_000))

    threads = [threading.Thread(target=draw, args=(out,)) for out in seen]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ids = [i for out in seen for i in out]
    assert len(set(ids)) == len(ids) == 20_000
    assert all(UUID(hex=i).version == 4 and len(i) == 32 for i in ids[:500])


def test_a_forked_child_does_not_hand_out_its_parents_next_ids() -> None:
    new_id()  # ids are drawn ahead now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next ids and leave at once
        os.close(read)
        os.write(write, " ".join(new_id() for _ in range(10)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = pipe.read().split()
    os.waitpid(pid, 0)
    parent = [new_id() for _ in range(10)]
    assert len(child) == 10 and not set(child) & set(parent)
