"""`WORKDIR/curves.png`: the run's loss curves, drawn from `WORKDIR/metrics.jsonl` when
training stops, so a run can be looked at without TensorBoard (matplotlib's Agg backend: no
display needed).

Left: the training loss at every logged step and the eval loss at every evaluation (a
mixture's per-source eval losses as thin lines). Right: what the router did, the share of
tokens sent to two experts (adaptive gating) and the tokens dropped over capacity, when the
model has experts; else the learning rate.
"""

import io
import json

from etils import epath

from jaxmoe.storage.paths import is_remote

CURVES_FILE = "curves.png"


def read_rows(metrics_path) -> list[dict]:
    """The JSON rows of a metrics file (damaged lines skipped: the writer reports them)."""
    rows = []
    for line in epath.Path(metrics_path).read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def series(rows: list[dict], split: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` in the rows of `split`, in step order."""
    points = sorted(
        (row["step"], float(row[key]))
        for row in rows
        if row.get("split") == split and isinstance(row.get(key), int | float)
    )
    return [s for s, _ in points], [v for _, v in points]


def curve_panels(rows: list[dict]) -> list[dict[str, tuple[list[int], list[float]]]]:
    """What each panel draws: {label: (steps, values)}, empty series left out."""
    loss = {
        "train loss": series(rows, "train", "loss"),
        "eval loss": series(rows, "eval", "loss"),
    }
    eval_keys = {key for row in rows if row.get("split") == "eval" for key in row}
    for key in sorted(k for k in eval_keys if k.startswith("loss/")):
        loss[f"eval {key}"] = series(rows, "eval", key)
    routing = {
        "tokens to two experts": series(rows, "train", "top2_fraction"),
        "tokens dropped": series(rows, "train", "dropped_fraction"),
    }
    if not any(steps for steps, _ in routing.values()):
        routing = {"learning rate": series(rows, "train", "learning_rate")}
    panels = [loss, routing]
    return [{k: v for k, v in panel.items() if v[0]} for panel in panels]


def write_curves(workdir) -> str | None:
    """Draw WORKDIR/curves.png from WORKDIR/metrics.jsonl; its path, or None when the file
    holds no training rows yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workdir = epath.Path(workdir)
    rows = read_rows(workdir / "metrics.jsonl") if (workdir / "metrics.jsonl").exists() else []
    panels = curve_panels(rows)
    if not panels[0]:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, panel in zip(axes, panels, strict=True):
        for label, (steps, values) in panel.items():
            eval_line = label.startswith("eval")
            ax.plot(
                steps,
                values,
                label=label,
                marker="o" if eval_line else None,
                markersize=3,
                linewidth=0.8 if label.startswith("eval loss/") else 1.5,
            )
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if panel:
            ax.legend(fontsize=8)
    axes[0].set_ylabel("loss")
    axes[1].set_ylabel("fraction" if "learning rate" not in panels[1] else "learning rate")
    fig.suptitle(f"{workdir.name}: {workdir / 'metrics.jsonl'}", fontsize=9)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    path = workdir / CURVES_FILE
    if is_remote(str(path)):
        path.write_bytes(image.getvalue())  # an object store replaces an object whole
    else:
        tmp = path.with_name(CURVES_FILE + ".tmp")  # never a half-written picture
        tmp.write_bytes(image.getvalue())
        tmp.replace(path)
    return str(path)
