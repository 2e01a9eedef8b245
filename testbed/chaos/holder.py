"""A client process that takes everything a client can hold on a server, then waits to be
killed: ``python -m testbed.chaos.holder URL TOKEN_FILE``.

It stores four chunks (committed data that must survive it), looks them up (a lock group),
begins a retrieve of two (pins), begins a store of two more (a reservation) and looks up all
six (a lookup left pending on the chunks in flight), then prints one line ``HOLDING`` and
sleeps, heartbeating, until it is SIGKILLed (by ``testbed.chaos.client_faults``).
"""

from __future__ import annotations

import sys
import time

from testbed.chaos.probes import ProbeClient, chunk_hashes
from testbed.core.credentials import read_token_file

MODEL = "holder"
STORED = chunk_hashes("holder/stored", 4)
RESERVED = chunk_hashes("holder/reserved", 2)


def main(argv: list[str]) -> int:
    url, token_file = argv
    token = read_token_file(token_file).client
    with ProbeClient(url, token, model=MODEL, heartbeat_interval_s=0.2) as client:
        client.register()
        client.store("holder:store", STORED)
        found = client.lookup("holder:locks", STORED)
        client.begin_retrieve("holder:locks", found.handle, STORED[:2])
        client.begin_store("holder:reserve", RESERVED)
        pending = client.lookup("holder:pending", STORED + RESERVED)
        print(f"HOLDING hit={found.hit_chunks} pending={pending.pending}", flush=True)
        while True:
            time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
