"""PNG plots of a ``python -m bench`` run (matplotlib, the ``bench`` extra).

- time_vs_size.png: median time against tensor size, one panel per worker count;
- speedup_vs_workers.png: gloo's time over switchml's against the worker count;
- time_vs_density.png: the sparse path's time against block density, per worker count.

With a link rate B the least times the links allow are drawn in: S/B (in-network
aggregation: S up and S down) and 2(n-1)/n*S/B (ring allreduce), and for the
speedup their ratio 2(n-1)/n.
"""

from __future__ import annotations

import os

from .common import lower_bound_s

STYLE = {"switchml-dense": ("tab:blue", "o"), "gloo": ("tab:orange", "s"),
         "switchml-sparse": ("tab:green", "^"), "switchml-dense16": ("tab:purple", "D"),
         "gloo-fp16": ("tab:red", "v")}
#: A system the table above does not name: drawn all the same.
OTHER_STYLE = ("tab:gray", "x")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, count, title, width=5.5):
    cols = min(count, 3)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, 4.2 * rows), squeeze=False)
    fig.suptitle(title)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def time_vs_size(plt, rows, link_bps, path):
    worlds = sorted({r["workers"] for r in rows})
    fig, axes = _panels(plt, len(worlds), "allreduce time against tensor size")
    for ax, n in zip(axes, worlds):
        mine = [r for r in rows if r["workers"] == n]
        series = sorted({(r["system"], r["density"]) for r in mine},
                        key=lambda s: (s[0], s[1] or 0))
        for system, density in series:
            pts = sorted((r["size_mib"], r["median_s"]) for r in mine
                         if r["system"] == system and r["density"] == density)
            color, marker = STYLE.get(system, OTHER_STYLE)
            label = system if density is None else f"{system} d={density:g}"
            ax.plot(*zip(*pts), marker=marker, color=color, label=label,
                    linestyle="-" if density is None else ":")
        sizes = sorted({r["size_bytes"] for r in mine})
        if link_bps and sizes:
            mib = [s / 2**20 for s in sizes]
            ax.plot(mib, [lower_bound_s("switchml-dense", n, s, link_bps) for s in sizes],
                    "k--", linewidth=1, label="S/B")
            ax.plot(mib, [lower_bound_s("gloo", n, s, link_bps) for s in sizes],
                    "k:", linewidth=1, label="2(n-1)/n·S/B")
        ax.set(xscale="log", yscale="log", xlabel="tensor size (MiB)",
               ylabel="median time (s)", title=f"n = {n}")
        ax.legend(fontsize="small")
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_vs_workers(plt, rows, link_bps, path):
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for size in sorted({r["size_bytes"] for r in rows}):
        pts = sorted((r["workers"], r["speedup_over_gloo"]) for r in rows
                     if r["size_bytes"] == size and r["system"] == "switchml-dense"
                     and r.get("speedup_over_gloo"))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"switchml dense, {size / 2**20:g} MiB")
    worlds = sorted({r["workers"] for r in rows})
    if link_bps and worlds:
        ax.plot(worlds, [2 * (n - 1) / n for n in worlds], "k--", linewidth=1,
                label="2(n-1)/n: ratio of the link bounds")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="workers n", ylabel="gloo time / switchml time",
           title="speedup over gloo ring allreduce", xticks=worlds)
    ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def time_vs_density(plt, rows, link_bps, path):
    sparse = [r for r in rows if r["system"] == "switchml-sparse"]
    keys = sorted({(r["workers"], r["size_bytes"]) for r in sparse})
    # wider panels: each keeps its legend at its right, clear of the points
    fig, axes = _panels(plt, len(keys), "block-sparse allreduce time against density", 8.5)
    for ax, (n, size) in zip(axes, keys):
        pts = sorted((r["density"], r["median_s"]) for r in sparse
                     if r["workers"] == n and r["size_bytes"] == size)
        ax.plot(*zip(*pts), marker="^", color=STYLE["switchml-sparse"][0],
                label="switchml sparse")
        for r in rows:
            if r["workers"] == n and r["size_bytes"] == size and r["system"] != "switchml-sparse":
                ax.axhline(r["median_s"], color=STYLE.get(r["system"], OTHER_STYLE)[0],
                           label=f"{r['system']} (dense tensor)")
        if link_bps:
            ax.axhline(lower_bound_s("switchml-dense", n, size, link_bps), color="k",
                       linestyle="--", linewidth=1, label="S/B")
            ax.axhline(lower_bound_s("gloo", n, size, link_bps), color="k", linestyle=":",
                       linewidth=1, label="2(n-1)/n·S/B")
            ds = [d for d, _ in pts]
            ax.plot(ds, [lower_bound_s("switchml-sparse", n, size, link_bps, d) for d in ds],
                    color="tab:green", linestyle="--", linewidth=1, marker="x",
                    label="union of blocks / B (sparse bound)")
        ax.set(xscale="log", yscale="log", xlabel="block density", ylabel="median time (s)",
               title=f"n = {n}, {size / 2**20:g} MiB")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1))  # clear of points
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_plots(rows, link_bps, out) -> list:
    """Write the plots the rows have data for; return their paths."""
    plt = _pyplot()
    written = []
    plots = [("time_vs_size.png", time_vs_size, bool(rows)),
             ("speedup_vs_workers.png", speedup_vs_workers,
              any(r.get("speedup_over_gloo") and r["system"] == "switchml-dense" for r in rows)),
             ("time_vs_density.png", time_vs_density,
              any(r["system"] == "switchml-sparse" for r in rows))]
    for name, fn, has_data in plots:
        if has_data:
            path = os.path.join(out, name)
            fn(plt, rows, link_bps, path)
            written.append(path)
    return written
