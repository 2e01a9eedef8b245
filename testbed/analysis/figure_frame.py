"""The frame an analysis figure starts from: one titled, gridded axes, and the no-data note.

Figures that show nothing say so in words on the empty axes (:func:`no_data`) rather than
leaving a blank plot.
"""

from __future__ import annotations

import textwrap

from matplotlib import pyplot as plt
from matplotlib.figure import Figure


def new_figure(title: str, size: tuple[float, float], wrap: int = 80) -> tuple[Figure, plt.Axes]:
    """A figure of ``size`` inches with one axes: ``title`` wrapped at ``wrap`` characters,
    a light grid."""
    figure, axes = plt.subplots(figsize=size, layout="constrained")
    axes.set_title(textwrap.fill(title, wrap))
    axes.grid(True, alpha=0.3)
    return figure, axes


def no_data(axes: plt.Axes, text: str) -> None:
    """``text`` in the middle of ``axes`` (what the figure would show, and why it is empty)."""
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes)
