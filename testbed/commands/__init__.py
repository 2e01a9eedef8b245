"""Pieces that the lab's long commands share (``kvtb bench``, ``kvtb chaos``): the ``--only``
flag (:mod:`~testbed.commands.only_flag`) and sizes declared once for a quick and a full run
(:mod:`~testbed.commands.quick_sizes`). Plain Python; imports nothing of the lab.
"""
