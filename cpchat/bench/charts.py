"""The bench's charts: plain series in, a PNG out, so each comparison decides what is plotted and this
module only how. Drawn with matplotlib when it is installed (the `bench` extra); without it the bench
says so and writes its tables alone."""

from __future__ import annotations

import sys
from pathlib import Path

Lines = dict[str, tuple[list[int], list[float]]]  # a line's label -> (context tokens, values)


def pyplot():
    """matplotlib.pyplot drawing to files, or None (said on stderr) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  matplotlib is not installed (pip install 'cpchat[bench]'): no chart", file=sys.stderr)
        return None
    return plt


def write_context_chart(path: Path, panels: dict[str, Lines]) -> None:
    """Side by side, one panel per measure (its title -> its lines), over context tokens on a log2 axis."""
    if (plt := pyplot()) is None:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items(), strict=True):
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_ratio_chart(path: Path, groups: list[str], bars: dict[str, list[float | None]], outlined: list[str],
                      ylabel: str) -> None:
    """Grouped bars of ratios to a reference (1, ruled grey): one colour per series (its label -> a value
    per group, None where it has none), and in each group the series `outlined` names drawn edged."""
    if (plt := pyplot()) is None:
        return
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) + 2), 4))
    width = 0.8 / max(len(bars), 1)
    for k, (label, values) in enumerate(bars.items()):
        for i, value in enumerate(values):
            if value is None:
                continue
            edged = label == outlined[i]
            ax.bar(i + (k - (len(bars) - 1) / 2) * width, value, width, color=f"C{k}",
                   edgecolor="black" if edged else "none", linewidth=1.5 if edged else 0)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(handles=[Patch(color=f"C{k}", label=label) for k, label in enumerate(bars)])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_bar_chart(path: Path, groups: list[str], bars: dict[str, list[float]], ylabel: str) -> None:
    """Grouped bars, each labelled with its value: one colour per series (its label -> a value per group)."""
    if (plt := pyplot()) is None:
        return
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(groups) + 2), 4))
    width = 0.8 / max(len(bars), 1)
    for k, (label, values) in enumerate(bars.items()):
        drawn = ax.bar([i + (k - (len(bars) - 1) / 2) * width for i in range(len(groups))], values, width,
                       color=f"C{k}", label=label)
        ax.bar_label(drawn, labels=[f"{v:.3g}" for v in values], fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.25 * max((v for values in bars.values() for v in values), default=1.0))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
