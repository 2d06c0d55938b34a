"""The plot extra: matplotlib on a headless backend, imported only when a plot is asked for."""

from __future__ import annotations

from typing import Any

from pwctl.errors import PwctlError


def pyplot(what: str = "--plot") -> Any:
    """matplotlib.pyplot on the Agg backend, or a one-line PwctlError naming `what` when the
    plot extra is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PwctlError(f"{what} needs matplotlib: pip install 'pwctl[plot]'") from None
    return plt
