"""The files of `jaxmoe analyze-routing`: routing.json, summary.md and three PNG plots.

Plots use matplotlib's Agg backend (no display needed):
  top2_by_layer.png      top-2 rate of every MoE layer
  top2_by_frequency.png  top-2 rate by how often the token occurs in the analysed data
  top2_by_position.png   top-2 rate by position in the sequence (0, 1, 2-3, 4-7, ...)
"""

import json
import os

JSON_NAME, MARKDOWN_NAME = "routing.json", "summary.md"
PLOT_NAMES = ("top2_by_layer.png", "top2_by_frequency.png", "top2_by_position.png")
_COLORS = {"decoder": "tab:blue", "encoder": "tab:orange"}


def write_report(summary: dict, out_dir: str) -> list[str]:
    """Write routing.json, summary.md and the plots into out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in (JSON_NAME, MARKDOWN_NAME, *PLOT_NAMES)]
    with open(paths[0], "w") as f:
        json.dump({k: v for k, v in summary.items() if k != "files"}, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(summary))
    plot_layers(summary, paths[2])
    plot_buckets(summary, "by_frequency", "token count in the analysed data", paths[3])
    plot_buckets(summary, "by_position", "position in the sequence", paths[4])
    return paths


def _pct(rate) -> str:
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def _cell(text: str) -> str:
    """A piece as a markdown table cell: quoted, escapes visible, pipes escaped."""
    return "`" + json.dumps(text, ensure_ascii=False).replace("|", "\\|").replace("`", "'") + "`"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def markdown(summary: dict) -> str:
    """The short human-readable summary (rates in percent of valid tokens)."""
    stacks = summary["stacks"]
    lines = [
        "# Router analysis: tokens sent to two experts",
        "",
        f"Checkpoint `{summary.get('checkpoint', '?')}`, data `{summary.get('data', '?')}`, "
        f"gate `{summary.get('gate', '?')}` (threshold {summary.get('threshold', '?')}). "
        "Top-2 rate = share of tokens the gate sent to two experts.",
        "",
    ]
    lines += _table(
        ["stack", "tokens", "distinct ids", "top-2 rate (mean over layers)"],
        [[s, v["tokens"], v["distinct_ids"], _pct(v["top2_rate"])] for s, v in stacks.items()],
    )
    lines += ["## By layer", ""]
    lines += _table(
        ["layer", "stack", "tokens", "top-2 rate"],
        [[r["layer"], r["stack"], r["tokens"], _pct(r["top2_rate"])] for r in summary["layers"]],
    )
    for stack, info in stacks.items():
        title = f" ({stack})" if len(stacks) > 1 else ""
        lines += [f"## By token frequency{title}", ""]
        lines += _table(
            ["count in data", "token ids", "tokens", "top-2 rate"],
            [
                [r["bucket"], r["token_ids"], r["tokens"], _pct(r["top2_rate"])]
                for r in info["by_frequency"]
            ],
        )
        lines += [f"## By position{title}", ""]
        lines += _table(
            ["position", "tokens", "top-2 rate"],
            [[r["bucket"], r["tokens"], _pct(r["top2_rate"])] for r in info["by_position"]],
        )
        for end in ("highest", "lowest"):
            lines += [
                f"## Pieces with the {end} top-2 rates{title} "
                f"(seen at least {summary['min_count']} times; {info['eligible_ids']} ids)",
                "",
            ]
            lines += _table(
                ["piece", "id", "count", "top-2 rate"],
                [[_cell(p["piece"]), p["id"], p["count"], _pct(p["top2_rate"])] for p in info[end]],
            )
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_layers(summary: dict, path: str) -> None:
    plt = _pyplot()
    rows = summary["layers"]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(rows) + 2), 3.2))
    rates = [100 * (r["top2_rate"] or 0.0) for r in rows]
    ax.bar([r["layer"] for r in rows], rates, color=[_COLORS.get(r["stack"], "gray") for r in rows])
    for x, rate in enumerate(rates):
        ax.text(x, rate, f"{rate:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens sent to two experts (%)")
    ax.set_title("Top-2 rate per MoE layer")
    ax.set_ylim(0, max([*rates, 1.0]) * 1.2)
    ax.tick_params(axis="x", labelrotation=45 if len(rows) > 6 else 0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_buckets(summary: dict, key: str, xlabel: str, path: str) -> None:
    """One solid line per stack (mean over its layers), thin lines for single layers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    for stack, info in summary["stacks"].items():
        rows = [r for r in info[key] if r["tokens"]]
        labels = [r["bucket"] for r in rows]
        color = _COLORS.get(stack, "gray")
        for layer in info["layers"]:
            values = [100 * (r["top2_rate_per_layer"][layer] or 0.0) for r in rows]
            ax.plot(labels, values, color=color, alpha=0.3, linewidth=1)
        means = [100 * (r["top2_rate"] or 0.0) for r in rows]
        ax.plot(labels, means, color=color, marker="o", linewidth=2, label=f"{stack}, mean")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tokens sent to two experts (%)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, title="thin: single layers", title_fontsize=7)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
