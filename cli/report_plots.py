"""The plots of `convoq report`: PNGs drawn with matplotlib's Agg canvas, returned as base64 for the page to
inline, over equal time slices of the finished jobs (`Buckets`)."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import numpy as np
from matplotlib import colormaps
from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
from matplotlib.figure import Figure

from jobs.priority import HIGHEST
from jobs.queues import is_interactive
from jobs.settings import Settings

if TYPE_CHECKING:
    from cli.report import Finished

# seconds: from a demo's few seconds to weeks of service, the smallest that keeps under MAX_BUCKETS points
BUCKET_WIDTHS = (1, 2, 5, 10, 15, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400, 7 * 86400)
MAX_BUCKETS = 60  # enough points for a trend, enough jobs per point for a p99
PERCENTILES = (50, 95, 99)
PRIORITY_COLORS = colormaps["tab10"]


@dataclass
class Buckets:
    """Equal time slices over the finish times: `index` puts each job in one, `centers` places them on a plot."""

    width: float  # seconds
    index: np.ndarray
    centers: list[datetime]

    @classmethod
    def over(cls, at: np.ndarray) -> Buckets:
        span = at.max() - at.min()
        width = next((w for w in BUCKET_WIDTHS if span / w < MAX_BUCKETS), BUCKET_WIDTHS[-1])
        origin = at.min() // width * width
        index = ((at - origin) // width).astype(int)
        centers = [datetime.fromtimestamp(origin + (i + 0.5) * width, UTC) for i in range(index.max() + 1)]
        return cls(width, index, centers)

    def apply(self, values: np.ndarray, reduce: Callable[[np.ndarray], float], where: np.ndarray | None = None
              ) -> np.ndarray:
        """`reduce` of the values in each bucket (NaN where a bucket is empty), optionally of a subset only."""
        keep = np.ones(len(values), dtype=bool) if where is None else where
        out = np.full(len(self.centers), np.nan)
        for i in np.unique(self.index[keep]):
            out[i] = reduce(values[keep & (self.index == i)])
        return out


def png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return base64.b64encode(buffer.getvalue()).decode()


def time_axis(ax, buckets: Buckets) -> None:
    # the window's own span: matplotlib would pad a single bucket out to years
    half = timedelta(seconds=buckets.width / 2)
    ax.set_xlim(buckets.centers[0] - half, buckets.centers[-1] + half)
    locator = AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    # the date goes in the label: as the formatter's offset it is drawn over the label
    ax.xaxis.set_major_formatter(ConciseDateFormatter(locator, show_offset=False))
    first, last = (f"{c:%Y-%m-%d}" for c in (buckets.centers[0], buckets.centers[-1]))
    ax.set_xlabel(f"finished at (UTC), {first}" + (f" to {last}" if last != first else ""))
    ax.grid(alpha=0.3)


def latency_plot(jobs: Finished, buckets: Buckets) -> str:
    fig = Figure(figsize=(12, 4), layout="constrained")
    axes = fig.subplots(1, len(PERCENTILES), sharey=True)
    for ax, q in zip(axes, PERCENTILES, strict=True):
        for priority in np.unique(jobs.priority)[::-1]:  # the legend lists the most urgent first
            values = buckets.apply(jobs.end_to_end, lambda v, q=q: np.percentile(v, q), jobs.priority == priority)
            ax.plot(buckets.centers, values, marker="o", markersize=3, color=PRIORITY_COLORS(priority),
                    label=f"priority {priority}")
        ax.set_title(f"p{q}")
        time_axis(ax, buckets)
    axes[0].set_ylabel("end-to-end latency (s)")
    if np.nanmax(jobs.end_to_end) > 50 * max(np.nanmin(jobs.end_to_end), 1e-3):
        axes[0].set_yscale("log")  # urgent chats and hours-old bulk work on one axis
    axes[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return png(fig)


def throughput_plot(jobs: Finished, buckets: Buckets) -> str:
    fig = Figure(figsize=(12, 5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    width_days = buckets.width / 86400
    # an empty bucket is a stretch with nothing finished: zero, not a gap
    per_minute = np.nan_to_num(buckets.apply(jobs.at, len)) / (buckets.width / 60)
    top.bar(buckets.centers, per_minute, width=width_days * 0.9, color="tab:blue")
    top.set_ylabel("jobs finished / min")
    top.grid(alpha=0.3)
    tokens_per_s = np.nan_to_num(buckets.apply(jobs.output_tokens, np.sum)) / buckets.width
    bottom.plot(buckets.centers, tokens_per_s, marker="o", markersize=3, color="tab:green")
    bottom.set_ylabel("output tokens / s")
    bottom.set_ylim(bottom=0)
    time_axis(bottom, buckets)
    fig.suptitle(f"Throughput ({buckets.width / 60:g}-minute buckets)")
    return png(fig)


def interactive_vs_bulk_plot(jobs: Finished, buckets: Buckets, settings: Settings) -> str:
    """The trade-off the scheduler makes, on one time axis: what urgent jobs wait, what bulk work gets done."""
    fig = Figure(figsize=(12, 5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    urgent = is_interactive(jobs.priority, settings)
    for q, style in ((50, "o-"), (95, "s--")):
        values = buckets.apply(jobs.end_to_end, lambda v, q=q: np.percentile(v, q), urgent)
        top.plot(buckets.centers, values, style, markersize=3, color="tab:red", label=f"p{q}")
    top.set_ylabel(f"priority >= {settings.interactive_priority}:\nend-to-end (s)")
    top.set_ylim(bottom=0)
    top.legend(fontsize="small", loc="upper left")
    top.grid(alpha=0.3)
    tokens_per_s = np.nan_to_num(buckets.apply(jobs.output_tokens, np.sum, ~urgent)) / buckets.width
    bottom.plot(buckets.centers, tokens_per_s, marker="o", markersize=3, color="tab:green")
    bottom.set_ylabel(f"priority < {settings.interactive_priority}:\noutput tokens / s")
    bottom.set_ylim(bottom=0)
    time_axis(bottom, buckets)
    fig.suptitle("Interactive latency against bulk throughput")
    return png(fig)


def wait_vs_compute_plot(jobs: Finished) -> str:
    """Mean seconds per job, and the same as shares: bulk waits would otherwise flatten the urgent bars."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    absolute, share = fig.subplots(1, 2)
    priorities = np.unique(jobs.priority)
    labels = [str(p) for p in priorities]
    parts = (("queue wait", jobs.queue_wait, "tab:gray"), ("prefill", jobs.prefill, "tab:orange"),
             ("decode", jobs.decode, "tab:blue"))
    means = np.array([[values[jobs.priority == p].mean() for p in priorities] for _, values, _ in parts])
    for ax, heights in ((absolute, means), (share, 100 * means / means.sum(axis=0))):
        bottom = np.zeros(len(priorities))
        for (name, _, color), height in zip(parts, heights, strict=True):
            ax.bar(labels, height, bottom=bottom, label=name, color=color)
            bottom += height
        ax.set_xlabel(f"priority ({HIGHEST} is the most urgent)")
        ax.grid(axis="y", alpha=0.3)
    absolute.set_ylabel("mean seconds per job")
    share.set_ylabel("share of queue wait + compute (%)")
    share.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Queue wait vs compute")
    return png(fig)


def batch_size_plot(jobs: Finished) -> str:
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.subplots()
    sizes, counts = np.unique(jobs.batch_size, return_counts=True)
    ax.bar(sizes, counts, width=0.8 if sizes.max() <= 64 else sizes.max() / 80, color="tab:purple")
    ax.set_xlabel("batch size (largest engine step the job ran in)")
    ax.set_ylabel("jobs")
    ax.set_title("Batch size distribution")
    ax.grid(axis="y", alpha=0.3)
    return png(fig)


def reuse_plot(jobs: Finished, buckets: Buckets) -> str:
    fig = Figure(figsize=(12, 4), layout="constrained")
    ax = fig.subplots()
    prompt = buckets.apply(jobs.prompt_tokens, np.sum)
    for name, values, color in (("from the prefix cache", jobs.reused, "tab:green"),
                                ("of which from the host tier", jobs.host_reused, "tab:olive")):
        share = 100 * buckets.apply(values, np.sum) / np.where(prompt > 0, prompt, np.nan)
        ax.plot(buckets.centers, share, marker="o", markersize=3, color=color, label=name)
    ax.set_ylabel("prompt tokens reused (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Prefix reuse")
    ax.legend()
    time_axis(ax, buckets)
    return png(fig)
