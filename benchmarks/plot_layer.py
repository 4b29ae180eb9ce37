"""A picture of one bench_layer.py table file: per shape and token count, the step time and the activation memory
held for the backward against the retention ratio, one line per policy, with the exact layer, the torch._grouped_mm
anchor and DeepSpeed MoE as reference levels (DeepSpeed's time, usually far above, is written where it is off
the axis). Needs matplotlib (the "bench" extra); runs anywhere, from the markdown alone.

    python3 benchmarks/plot_layer.py benchmarks/results/layer_retention_h200_back_to_back_thirteenth.md
"""
import argparse
import re

ANCHOR, DEEPSPEED, EXACT = "grouped_mm dropless", "DeepSpeed MoE", "LRMoE exact"
RETENTION_ROW = re.compile(r"^LRMoE retention ([0-9.]+), (\w+)(.*)$")  # ratio, policy, anything after it


def read_tables(text: str) -> dict:
    """{section heading: {row name: {"ms": float, "held": float or None}}} from bench_layer.py's markdown.
    Columns are found by their header, so a table without memory columns gives held None."""
    tables, heading, cols = {}, None, None
    for line in text.splitlines():
        if line.startswith("## "):
            heading, cols = line[3:].strip(), None
            tables[heading] = {}
        elif line.startswith("|") and heading is not None:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cols is None:
                cols = cells
            elif not set(cells[0]) <= set("- "):
                value = dict(zip(cols, cells))
                tables[heading][cells[0]] = {"ms": _number(value.get("ms")), "held": _number(value.get("held GiB"))}
    return {h: rows for h, rows in tables.items() if rows}


def _number(cell):
    try:
        return float(cell)
    except (TypeError, ValueError):
        return None  # a row that failed ("failed", "-") or a column the table does not have


def retention_lines(rows: dict) -> dict:
    """{line label: [(ratio, ms, held)] by ratio}: the LRMoE retention rows, one line per policy (and whatever
    follows the policy in the row name: another allocation, recomputed dots, a GEMM config)."""
    lines = {}
    for name, v in rows.items():
        m = RETENTION_ROW.match(name)
        if m and v["ms"] is not None:
            lines.setdefault(m.group(2) + m.group(3), []).append((float(m.group(1)), v["ms"], v["held"]))
    return {label: sorted(points) for label, points in lines.items()}


def _level(rows: dict, prefix: str):
    return next((v for name, v in rows.items() if name.startswith(prefix)), None)


def plot(tables: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(tables)
    fig, axes = plt.subplots(2, n, figsize=(3.6 * n, 6.4), squeeze=False)
    for col, (heading, rows) in enumerate(tables.items()):
        t_ax, m_ax = axes[0][col], axes[1][col]
        lines = retention_lines(rows)
        for label, points in lines.items():
            r = [p[0] for p in points]
            t_ax.plot(r, [p[1] for p in points], marker="o", label=label)
            if all(p[2] is not None for p in points):
                m_ax.plot(r, [p[2] for p in points], marker="o", label=label)
        top = max((p[1] for pts in lines.values() for p in pts), default=1.0)
        for prefix, color, dash, name in ((EXACT, "k", "--", "exact"), (ANCHOR, "C3", ":", "grouped_mm anchor")):
            v = _level(rows, prefix)
            if v and v["ms"] is not None:
                t_ax.axhline(v["ms"], color=color, linestyle=dash, linewidth=1, label=f"{name} {v['ms']:.2f} ms")
                top = max(top, v["ms"])
                if v["held"] is not None:
                    m_ax.axhline(v["held"], color=color, linestyle=dash, linewidth=1, label=name)
        t_ax.set_ylim(0, top * 1.15)
        ds = _level(rows, DEEPSPEED)
        if ds and ds["ms"] is not None:
            t_ax.text(0.02, 0.97, f"DeepSpeed MoE: {ds['ms']:.1f} ms", transform=t_ax.transAxes, va="top", fontsize=8)
        t_ax.set_title(heading.split(" (")[0] + ", " + heading.rsplit("), ", 1)[-1], fontsize=9)
        for ax in (t_ax, m_ax):
            ax.invert_xaxis()  # from exact (1.0) to the fewest pairs kept
            ax.grid(alpha=0.3)
        m_ax.set_xlabel("retention ratio")
        m_ax.set_ylim(bottom=0)
        if col == 0:
            t_ax.set_ylabel("forward + backward, ms")
            m_ax.set_ylabel("activation memory held, GiB")
        t_ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("table", help="a markdown file written by bench_layer.py --out")
    p.add_argument("--out", default=None, help="the PNG (default: the table's path with .png)")
    args = p.parse_args(argv)
    text = open(args.table).read()
    tables = read_tables(text)
    if not tables:
        raise SystemExit(f"{args.table}: no bench_layer.py tables found (## headings followed by | rows)")
    out = args.out or args.table.rsplit(".", 1)[0] + ".png"
    plot(tables, out, text.splitlines()[0].lstrip("# ").strip())  # the file's title line
    print(out)


if __name__ == "__main__":
    main()
