"""The ``kvtb`` command line: the top floor of the lab, which may import every package below it.

Runs in the ``kvtb`` process. :mod:`~testbed.cli.kvtb` builds the parser and dispatches each
command to the package that does its work (``kvtb server`` to ``server.app``, ``run`` to
``testbed.run``, ``sweep`` to ``testbed.sweep``, ``report`` and ``export`` to
``testbed.report``, ``bench`` and ``chaos`` to their packages); :mod:`~testbed.cli.explain`,
:mod:`~testbed.cli.whatif` and :mod:`~testbed.cli.demo` are the commands that live here.
``python -m testbed.cli`` is ``kvtb``.
"""
