"""Throughput against the offload threshold: the model's curve, simulated points, and the
optimizer's choice. matplotlib is optional (``kvwire[plot]``) and imported only here."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from kvwire.errors import UsageError
from kvwire.scheduler.model import OptimizerResult

__all__ = ["plot_format", "plot_threshold_curve"]


def plot_format(path: str | os.PathLike[str]) -> str:
    """The format a plot is written to ``path`` in (``kvwire simulate --plot``, ``kvwire
    bench --plot``): the one its suffix names (matplotlib's reading of it), else PNG. The
    file is the one named either way: matplotlib, given no format and a name without a
    suffix, writes ``path + ".png"`` instead, which may be another output's file
    (``--json rep.png --plot rep``)."""
    return os.path.splitext(os.fspath(path))[1][1:].lower() or "png"


def plot_threshold_curve(
    path: str | Path,
    opt: OptimizerResult,
    *,
    simulated: Sequence[tuple[float, float]] = (),
    title: str = "",
) -> None:
    """Write a PNG: ``Lambda_max(t)`` at the best split, the envelope over splits,
    ``(t, throughput)`` points from the simulator, and the optimizer's ``t``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib (pip install kvwire[plot])") from None
    ks = [t / 1024 for t in opt.thresholds]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    ax.plot(
        ks,
        opt.lambda_at_best_split,
        label=f"model, N_p={opt.best.prefill_instances} N_d={opt.best.decode_instances}",
    )
    if opt.lambda_best_over_splits:
        ax.plot(
            ks, opt.lambda_best_over_splits, ls=":", color="grey", label="model, best split per t"
        )
    if simulated:
        ax.plot(
            [t / 1024 for t, _ in simulated],
            [v for _, v in simulated],
            "o",
            color="C3",
            label="simulated (selective at fixed t)",
        )
    ax.axvline(opt.threshold_tokens / 1024, color="C2", ls="--", label="optimizer's t")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(left=0.0)
    ax.set_xlabel("threshold t (K tokens of incremental prefill)")
    ax.set_ylabel("throughput (requests/s)")
    ax.set_title(title or f"Lambda_max(t); binding at optimum: {opt.binding}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format=plot_format(path))
    plt.close(fig)
