"""Charts: the hierarchical roofline. matplotlib is imported inside, so `import hrm` stays light."""

from __future__ import annotations

from pathlib import Path

from hrm.io import save_figure
from hrm.roofline_report import RooflineReport
from hrm.units import format_bandwidth, format_flops

_KV_MARKERS = {
    "float32": "D",
    "bfloat16": "o",
    "float16": "o",
    "int8": "s",
    "float8": "s",
    "int4": "^",
}


def plot_roofline(report: RooflineReport, path: str | Path) -> Path:
    """Log-log roofline: CPU and GPU roofs, the PCIe cross-level roof, ops placed on them, P1/P2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(10, 6.5), dpi=120)
    marks = [v for v in (report.turning.p1, report.turning.p2) if v] if report.turning else []
    intensities = [p.cpu_intensity for p in report.points] + marks
    lo, hi = min(intensities) / 4, max(intensities) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 400)

    def roof(peak, bw, style, color, label):
        ax.plot(x, np.minimum(peak, bw * x), style, color=color, lw=2, label=label)

    roof(
        report.cpu_peak_flops_per_s,
        report.cpu_bandwidth_bytes_per_s,
        "-",
        "tab:blue",
        f"CPU roof ({format_flops(report.cpu_peak_flops_per_s, 3)}, "
        f"{format_bandwidth(report.cpu_bandwidth_bytes_per_s, 3)})",
    )
    if report.gpu_peak_flops_per_s is not None:
        roof(
            report.gpu_peak_flops_per_s,
            report.gpu_bandwidth_bytes_per_s,
            "-",
            "tab:green",
            f"GPU roof ({format_flops(report.gpu_peak_flops_per_s, 3)}, "
            f"{format_bandwidth(report.gpu_bandwidth_bytes_per_s, 3)})",
        )
        roof(
            report.gpu_peak_flops_per_s,
            report.link_bytes_per_s,
            "--",
            "tab:red",
            f"GPU, data over PCIe ({format_bandwidth(report.link_bytes_per_s, 3)})",
        )

    attention = [p for p in report.points if p.op == "attention"]
    ffn = [p for p in report.points if p.op == "expert_ffn"]
    seen = set()
    for p in attention:
        if p.kv_dtype in seen:  # intensity does not depend on the batch: one marker per KV dtype
            continue
        seen.add(p.kv_dtype)
        marker = _KV_MARKERS.get(p.kv_dtype, "o")
        batches = ",".join(str(q.batch) for q in attention if q.kv_dtype == p.kv_dtype)
        ax.scatter(
            p.cpu_intensity,
            p.cpu_flops_per_s,
            marker=marker,
            s=70,
            color="tab:purple",
            zorder=5,
            label=f"decode attention on CPU, KV {p.kv_dtype} (b={batches})",
        )
        if p.gpu_streamed_flops_per_s is not None:
            ax.scatter(
                p.cpu_intensity,
                p.gpu_streamed_flops_per_s,
                marker=marker,
                s=70,
                facecolors="none",
                edgecolors="tab:purple",
                zorder=5,
            )
    if attention and attention[0].gpu_streamed_flops_per_s is not None:
        ax.scatter(
            [],
            [],
            marker="o",
            facecolors="none",
            edgecolors="gray",
            label="hollow marker: the same op on the GPU, its data fetched over PCIe",
        )
    if ffn:
        xs = [p.cpu_intensity for p in ffn]
        ax.plot(
            xs,
            [p.cpu_flops_per_s for p in ffn],
            "o-",
            color="tab:orange",
            ms=6,
            zorder=5,
            label="expert FFN on CPU (weights in CPU memory)",
        )
        if ffn[0].gpu_streamed_flops_per_s is not None:
            ax.plot(
                xs,
                [p.gpu_streamed_flops_per_s for p in ffn],
                "o--",
                color="tab:orange",
                mfc="none",
                ms=6,
                zorder=5,
                label=f"expert FFN on GPU, weights streamed (mu={report.micro_batch})",
            )
        for p in ffn:
            ax.annotate(
                f"N={p.batch}",
                (p.cpu_intensity, p.cpu_flops_per_s),
                fontsize=8,
                textcoords="offset points",
                xytext=(4, -12),
            )
    if report.turning is not None:
        for name, value in (("P1", report.turning.p1), ("P2", report.turning.p2)):
            if value is None:
                continue
            ax.axvline(value, color="gray", ls=":", lw=1.2)
            ax.annotate(
                f"{name} = {value:.3g} FLOP/B",
                (value, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(-4, -14),
                textcoords="offset points",
                fontsize=9,
                color="dimgray",
                ha="right",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("operational intensity against the data's home memory (FLOP/byte)")
    ax.set_ylabel("attainable performance (FLOP/s)")
    ax.set_title(
        f"Hierarchical roofline: {report.model} on {report.hardware} "
        f"({report.dtype}, decode context {report.context})"
    )
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)
