"""Draw ``release_timeline.json`` (from bench_release_gpu.py) as a PNG: GPU used memory vs time, one panel
per scenario (driver reference, gpuclean with a SIGTERM-obeying leak, with a SIGTERM-ignoring leak,
vLLM-style polling), with the marks (signals, exit, gone from NVML, verdict).

    python benchmarks/plot_timeline.py OUT/release_timeline.json docs/benchmarks_release_timeline.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

PANELS = [
    ("driver", "Driver alone: SIGTERM by hand, NVML polled every ~1.5 ms", ("SIGTERM",)),
    ("reap_term", "gpuclean teardown, leak obeys SIGTERM (a)", ("teardown check starts",)),
    ("reap_ignore", "gpuclean teardown, leak ignores SIGTERM (b): SIGKILL after the grace",
     ("teardown check starts",)),
    ("vllm", "vLLM-style wait_for_gpu_memory_to_clear (test kills its child, then polls every 5 s)",
     ("teardown starts",)),
]
COLORS = {"SIGTERM": "tab:orange", "SIGKILL": "tab:red", "exited": "tab:purple",
          "gone from NVML": "tab:green",
          "memory back to idle": "tab:olive", "verdict: clean": "tab:blue", "vLLM: clean": "tab:blue",
          "teardown check starts": "black", "teardown starts": "black"}


def pick(timelines: list[dict[str, Any]], name: str, zero_labels: tuple[str, ...]) -> dict[str, Any] | None:
    """The run whose end (last mark) is the median one: a typical run, not the best."""
    runs = [t for t in timelines if t["name"] == name and t["samples"]]
    if not runs:
        return None

    def span(t: dict[str, Any]) -> float:
        zero = next((m["t_ms"] for m in t["marks"] if m["label"] in zero_labels), 0.0)
        return max((m["t_ms"] for m in t["marks"]), default=0.0) - zero

    spans = sorted(span(t) for t in runs)
    median = statistics.median_low(spans)
    return next(t for t in runs if span(t) == median)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("timeline", help="release_timeline.json")
    parser.add_argument("png", help="output PNG")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.timeline) as f:
        data = json.load(f)
    machine = data.get("machine") or {}
    chosen = [(name, title, pick(data["timelines"], name, zero), zero) for name, title, zero in PANELS]
    chosen = [c for c in chosen if c[2] is not None]
    if not chosen:
        print("no timelines in the file", file=sys.stderr)
        return 1
    fig, axes = plt.subplots(len(chosen), 1, figsize=(11, 2.9 * len(chosen)), squeeze=False)
    for ax, (_name, title, tl, zero_labels) in zip(axes[:, 0], chosen, strict=False):
        assert tl is not None
        zero = next((m["t_ms"] for m in tl["marks"] if m["label"] in zero_labels), 0.0)
        xs = [s[0] - zero for s in tl["samples"]]
        ys = [s[1] / 1024 for s in tl["samples"]]
        ax.plot(xs, ys, "-", color="tab:gray", lw=1.2, marker=".", ms=2.5, drawstyle="steps-post",
                label="device used memory (NVML v2)")
        top = max(ys) if ys else 1.0
        seen: set[str] = set()
        for i, m in enumerate(tl["marks"]):
            x = m["t_ms"] - zero
            label = m["label"]
            color = COLORS.get(label, "tab:cyan" if label.startswith("vLLM poll") else "tab:brown")
            ax.axvline(x, color=color, ls="--", lw=1)
            ax.text(x, top * (0.95 - 0.13 * (i % 6)), f" {label} ({x:.0f} ms)", color=color, fontsize=7.5,
                    va="top", ha="left")
            seen.add(label)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("GiB used")
        ax.set_ylim(bottom=-0.05 * max(top, 0.1), top=top * 1.08 + 0.05)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("ms since the signal (driver) / since teardown starts")
    device = str(machine.get("device", "?")).split(" (")[0]
    fig.suptitle(f"Leak-to-clean: {device}, driver {machine.get('driver', '?')}, "
                 f"{data.get('gib')} GiB holder, "
                 f"grace {data.get('grace_s')} s, {machine.get('date_utc', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
