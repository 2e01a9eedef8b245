"""The canonical sweep files (``*.toml``), shipped as package data so that ``kvtb demo`` and
``kvtb sweep NAME`` work from an installed wheel; :mod:`testbed.sweep.experiments` finds them.
No code lives here: experiments are data."""
