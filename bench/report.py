"""Writes the markdown table and the PNG plot of a kernel benchmark result.

    python bench/report.py bench/results/<date>-<gpu>-kernels.json

Produces <same name>.md and <same name>.png beside the JSON and prints the
table. The plot shows achieved bandwidth as a fraction of the device-to-device
copy bandwidth measured in the same run, per op and shape.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import table  # noqa: E402


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = res["cases"]
    labels = [f"{c['op'].replace('fp8_comm_', '').replace('fused_', '')}\n{c['shape']}" for c in cases]
    frac = [100 * c["fraction_of_copy"] for c in cases]
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(cases) + 1.5))
    bars = ax.barh(range(len(cases)), frac, color=["#4c72b0" if "wan" in c["shape"] else "#dd8452" for c in cases])
    ax.set_yticks(range(len(cases)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(80, color="k", linestyle="--", linewidth=1, label="80% target")
    ax.set_xlabel(f"achieved / device-to-device copy bandwidth ({res['copy_gb_per_s']:.0f} GB/s), %")
    env = res.get("env", {})
    ax.set_title(f"cache-dit-opd kernels on {env.get('gpu', res.get('device', '?'))} "
                 f"(speed-up over the PyTorch reference at bar ends)", fontsize=9)
    for bar, c in zip(bars, cases):
        ax.text(bar.get_width() + 0.5, bar.get_y() + bar.get_height() / 2, f"{c['speedup_vs_torch']:.1f}x",
                va="center", fontsize=7)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    src = Path(sys.argv[1])
    res = json.loads(src.read_text())
    md = table(res)
    env = res.get("env")
    if env:
        md = "\n".join(f"- {k}: {v}" for k, v in env.items()) + "\n\n" + md
    src.with_suffix(".md").write_text(md + "\n")
    plot(res, src.with_suffix(".png"))
    print(md)


if __name__ == "__main__":
    main()
