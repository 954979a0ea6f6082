"""The PNG of `pi2-gguf bench --sweep ... --png FILE`: decode tok/s against the memory limit, one line per engine
(stock llama.cpp, pi2) and optionally a planner's prediction (dashed). matplotlib (the `plot` extra) is imported
when a plot is made, drawn on its Agg canvas (no display, no global pyplot state), as `pi2-gguf inspect --png`."""

from __future__ import annotations

from pathlib import Path

from ..errors import MissingExtraError
from ..paths import write_png

Points = list[tuple[int, float]]  # (memory limit in bytes, decode tok/s)

LOG_Y_RANGE = 10.0  # highest / lowest tok/s above which the y axis is logarithmic


def require_matplotlib() -> None:
    """MissingExtraError naming the extra unless matplotlib imports (checked before a sweep runs for minutes)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise MissingExtraError("--png needs matplotlib: pip install 'pi2-gguf[plot]'") from e


def log_y(values: list[float]) -> bool:
    """Whether tok/s values span enough (more than LOG_Y_RANGE times) to plot them on a logarithmic axis."""
    positive = [v for v in values if v > 0]
    return bool(positive) and max(positive) / min(positive) > LOG_Y_RANGE


def save_sweep_png(path: str | Path, model_name: str, stock: Points, pi2: Points,
                   predicted: Points | None = None) -> Path:
    """Writes the plot to path (atomically) and returns it: x = memory limit (MB), y = decode tok/s, a line with
    markers for stock and for pi2 (the limits each ran at), and `predicted` (e.g. a planner's estimate) as a
    dashed line labelled "plan (predicted)". The y axis is logarithmic when the values span more than
    LOG_Y_RANGE times. Needs matplotlib (the `plot` extra)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # (label, points, marker, line style, colour)
    lines = [("stock llama.cpp (repack off)", stock, "o", "-", "tab:gray"),
             ("pi2 (memory budget = limit)", pi2, "s", "-", "tab:blue")]
    if predicted:
        lines.append(("plan (predicted)", predicted, "", "--", "tab:orange"))
    values: list[float] = []
    for label, points, marker, linestyle, color in lines:
        pts = sorted(points)
        if not pts:
            continue
        ax.plot([b / 1e6 for b, _ in pts], [v for _, v in pts], label=label, marker=marker or None,
                linestyle=linestyle, color=color)
        values += [v for _, v in pts]
    if log_y(values):
        ax.set_yscale("log")
    if not values:
        ax.text(0.5, 0.5, "no configuration finished", transform=ax.transAxes, ha="center", va="center")
    else:
        ax.legend()
    ax.set_xlabel("memory limit (MB)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"{model_name}: decode speed against the memory limit")
    ax.grid(True, which="both", alpha=0.3)
    return write_png(fig, path)
