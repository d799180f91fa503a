"""A rank joins the master's store as soon as it listens (`setup.wait_for_master`), not after
torch's client backoff."""

from __future__ import annotations

import socket
import threading
import time

from megatron_runs.setup import wait_for_master


def test_a_rank_waits_for_the_masters_store_and_gives_up_at_its_deadline() -> None:
    held = socket.socket()  # bound, never listening: every connection is refused
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    assert wait_for_master("127.0.0.1", port, timeout_s=0.05) is False
    found: list[bool] = []
    waiter = threading.Thread(
        target=lambda: found.append(wait_for_master("127.0.0.1", port)), daemon=True
    )
    waiter.start()
    time.sleep(0.1)  # the master comes up after the rank began to look
    held.listen()
    waiter.join(30)
    held.close()
    assert found == [True]
