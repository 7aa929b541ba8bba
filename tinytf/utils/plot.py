"""Training curves as a dependency-free SVG: loss and learning rate against the step.

``write_training_plot(path, records)`` draws two panels, one above the other, sharing the step
axis: the training loss (line) with the dev loss (dots) on top, the learning rate below. SVG is
plain XML text, so no plotting library is needed and any browser shows the file.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

WIDTH, PANEL_HEIGHT = 720, 240
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 70, 20, 30, 40


def _nice_ticks(lo, hi, n=5):
    """About ``n`` round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of 10)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(n, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _fmt(value):
    if value == 0:
        return "0"
    if abs(value) < 1e-2 or abs(value) >= 1e5:
        return f"{value:.1e}"
    return f"{value:g}"


def _panel(top, title, x_range, series):
    """SVG elements for one panel. ``series``: list of (points, colour, style, label) where style
    is "line" or "dots" and points are (x, y) pairs with finite y."""
    left, right = MARGIN_LEFT, WIDTH - MARGIN_RIGHT
    bottom = top + PANEL_HEIGHT - MARGIN_BOTTOM
    inner_top = top + MARGIN_TOP
    ys = [y for pts, *_ in series for _, y in pts]
    x0, x1 = x_range
    y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
    if y1 <= y0:
        y0, y1 = y0 - 0.5 * (abs(y0) or 1), y1 + 0.5 * (abs(y1) or 1)
    pad = 0.05 * (y1 - y0)
    y0, y1 = y0 - pad, y1 + pad

    def sx(x):
        return left + (x - x0) / ((x1 - x0) or 1) * (right - left)

    def sy(y):
        return bottom - (y - y0) / (y1 - y0) * (bottom - inner_top)

    out = [f'<text x="{left}" y="{top + 18}" font-size="14" font-weight="bold">'
           f'{escape(title)}</text>',
           f'<rect x="{left}" y="{inner_top}" width="{right - left}" '
           f'height="{bottom - inner_top}" fill="none" stroke="#444"/>']
    for t in _nice_ticks(y0, y1):
        if y0 <= t <= y1:
            out.append(f'<line x1="{left}" x2="{right}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" '
                       'stroke="#ddd"/>')
            out.append(f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" font-size="11" '
                       f'text-anchor="end">{_fmt(t)}</text>')
    for t in _nice_ticks(x0, x1):
        if x0 <= t <= x1:
            out.append(f'<text x="{sx(t):.1f}" y="{bottom + 16}" font-size="11" '
                       f'text-anchor="middle">{_fmt(t)}</text>')
    legend_x = right - 150
    for i, (pts, colour, style, label) in enumerate(series):
        if style == "line" and len(pts) > 1:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                       'stroke-width="1.5"/>')
        else:
            out.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>'
                       for x, y in pts)
        ly = inner_top + 14 + 16 * i
        out.append(f'<rect x="{legend_x}" y="{ly - 9}" width="12" height="10" '
                   f'fill="{colour}"/>')
        out.append(f'<text x="{legend_x + 18}" y="{ly}" font-size="12">{escape(label)}</text>')
    return out


def training_plot_svg(records) -> str:
    """The SVG text for ``records``: dicts with "step" and any of "loss", "dev_loss", "lr"
    (non-finite values are left out, so a skipped NaN step does not break the picture)."""
    def points(key):
        # By step; a step logged twice (a run resumed from an earlier checkpoint after a
        # crash) keeps its latest value, so the line never runs backwards.
        latest = {r["step"]: float(r[key]) for r in records
                  if r.get(key) is not None and math.isfinite(float(r[key]))}
        return sorted(latest.items())

    loss, dev, lr = points("loss"), points("dev_loss"), points("lr")
    steps = [x for x, _ in loss + dev + lr]
    x_range = (min(steps), max(steps)) if steps else (0, 1)
    if x_range[1] <= x_range[0]:
        x_range = (x_range[0], x_range[0] + 1)
    height = 2 * PANEL_HEIGHT
    body = _panel(0, "loss (label-smoothed, per target token)", x_range,
                  [(loss, "#1f77b4", "line", "train"), (dev, "#d62728", "dots", "dev")])
    body += _panel(PANEL_HEIGHT, "learning rate", x_range, [(lr, "#2ca02c", "line", "lr")])
    body.append(f'<text x="{WIDTH / 2}" y="{height - 6}" font-size="12" '
                'text-anchor="middle">step</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">\n'
            f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")


def write_training_plot(path, records) -> None:
    """Write ``training_plot_svg(records)`` to ``path`` (atomically: a reader never sees half)."""
    from tinytf.utils.checkpoint import atomic_write  # noqa: PLC0415 - a sibling module
    svg = training_plot_svg(records).encode("utf-8")
    atomic_write(path, lambda f: f.write(svg))


def main(argv=None) -> int:
    """``python -m tinytf.utils.plot RUNDIR``: draw RUNDIR/training.svg from
    RUNDIR/log.jsonl now."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tinytf.utils.plot RUNDIR", file=sys.stderr)
        return 2
    log = os.path.join(args[0], "log.jsonl")
    if not os.path.isfile(log):
        problem = "no log.jsonl (not a run directory)" if os.path.isdir(args[0]) else \
            "no such run directory"
        print(f"python -m tinytf.utils.plot: error: {args[0]}: {problem}", file=sys.stderr)
        return 2
    records = []
    with open(log, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue          # a line cut by a crash
    path = os.path.join(args[0], "training.svg")
    write_training_plot(path, records)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
