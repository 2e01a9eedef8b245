"""What a run is, before it runs: the spec and where its values come from.

Runs in every lab process (``kvtb run``, sweeps, chaos and bench children); imports only the
layers below it (core, models, workloads, fleet). Modules, each one job:

- :mod:`~testbed.spec.runspec`: :class:`~testbed.spec.runspec.RunSpec`, a frozen, validated
  run named by the hash of its resolved form;
- :mod:`~testbed.spec.engines`: what differs between engines (valid policies, which keys apply,
  open or closed loop), one row per engine, which the spec reads instead of comparing names;
- :mod:`~testbed.spec.inputs`: values read from the machine when a spec is parsed (absolute
  paths, the data directory, trace digests, the trace sampler);
- :mod:`~testbed.spec.flags`: every run key as a ``kvtb run`` flag and a sweep key;
- :mod:`~testbed.spec.paths`: user paths made absolute when they are read.
"""
