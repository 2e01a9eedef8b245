"""``kvtb chaos``: reliability scenarios against real processes, and the frame fuzzer.

Everything here runs in the chaos process unless said otherwise:

- ``command``: the ``kvtb chaos`` command; runs the scenarios, writes the report.
- ``report``: the keys every scenario reports, totals, acceptance, ``reliability.json/.md``.
- ``lab``: a scenario's settings, directory and processes (servers, engine runs).
- ``server_faults``: the server SIGKILLed under a run, with and without a restart.
- ``client_faults``: clients SIGKILLed while holding things; a client that loses its replies.
- ``attacks``: fuzzing; requests without credentials or with another client's ids.
- ``sharing``: four engines on one small server.
- ``exhaustion``: a full ``/dev/shm`` and full disks (in private mount namespaces).
- ``crowds``: a flood of connections that never authenticate; a client hogging the locks.
- ``tier_faults``: a disk tier below L1 full, unreadable, slow.
- ``remote_faults``: the redis tier's Redis killed and restarted under a run; a slow network.
- ``peer_faults``: a peer server killed while a run's hits come from it.
- ``netem_run``: a server and its Redis over TCP behind a slowed loopback, in a private
  network namespace (``python -m``).
- ``mounts``: small file systems in a private mount namespace (also used by the tests).
- ``shm_probe``, ``full_disk_run``: what runs inside such a namespace (``python -m``).
- ``frames``: structure-aware fuzz frames from the protocol's structs (pure).
- ``frame_edits``: building and bending msgpack frames for ``frames`` (pure).
- ``fuzz``: sends fuzz frames to a server and checks it afterwards (also used by the tests).
- ``probes``: a protocol client without the connector that checks every byte it reads.
- ``watch``: server stats and RSS sampling, quiescence, files left by dead servers.
- ``runs``: engine runs (``execute_run``) in children of a fork server that imported vLLM.
- ``holder``: a client *process* that holds locks, pins and a reservation until killed.
"""
