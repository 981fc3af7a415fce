"""Charts: the hierarchical roofline. matplotlib is imported inside, so `import hrm` stays light."""

from __future__ import annotations

from pathlib import Path

from hrm.io import save_figure
from hrm.roofline.report import RooflineReport
from hrm.units import format_bandwidth, format_flops

_KV_MARKERS = {
    "float32": "D",
    "bfloat16": "o",
    "float16": "o",
    "int8": "s",
    "float8": "s",
    "int4": "^",
}


def plot_roofline(
    report: RooflineReport, path: str | Path, bound: tuple[float, str] | None = None
) -> Path:
    """Log-log roofline: CPU and GPU roofs, the PCIe cross-level roof, ops placed on them, P1/P2;
    bound: (FLOP/s, label) of a throughput bound (MoE-Lens's stage 1), drawn as a level line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6.5), dpi=120)
    _draw_roofs(ax, report)
    _draw_attention(ax, [p for p in report.points if p.op == "attention"])
    _draw_expert_ffn(ax, [p for p in report.points if p.op == "expert_ffn"], report.micro_batch)
    _draw_turning_points(ax, report)
    if bound is not None:
        ax.axhline(bound[0], color="tab:purple", ls="-.", lw=1.5, label=bound[1])
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


def _draw_roofs(ax, report: RooflineReport) -> None:
    """The CPU roof, and with a GPU its roof and the roof of data fetched over PCIe."""
    import numpy as np

    marks = [v for v in (report.turning.p1, report.turning.p2) if v] if report.turning else []
    intensities = [p.cpu_intensity for p in report.points] + marks
    lo, hi = min(intensities) / 4, max(intensities) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 400)

    def roof(peak, bw, style, color, label):
        ax.plot(x, np.minimum(peak, bw * x), style, color=color, lw=2, label=label)

    cpu_peak, cpu_bw = report.cpu_peak_flops_per_s, report.cpu_bandwidth_bytes_per_s
    roof(cpu_peak, cpu_bw, "-", "tab:blue",
         f"CPU roof ({format_flops(cpu_peak, 3)}, {format_bandwidth(cpu_bw, 3)})")  # fmt: skip
    if report.gpu_peak_flops_per_s is None:
        return
    gpu_peak, gpu_bw, link = (report.gpu_peak_flops_per_s, report.gpu_bandwidth_bytes_per_s,
                              report.link_bytes_per_s)  # fmt: skip
    roof(gpu_peak, gpu_bw, "-", "tab:green",
         f"GPU roof ({format_flops(gpu_peak, 3)}, {format_bandwidth(gpu_bw, 3)})")  # fmt: skip
    roof(gpu_peak, link, "--", "tab:red", f"GPU, data over PCIe ({format_bandwidth(link, 3)})")


def _draw_attention(ax, attention) -> None:
    """Decode attention, one marker per KV dtype (its intensity does not depend on the batch);
    hollow where the GPU runs it over KV fetched over PCIe."""
    seen = set()
    for p in attention:
        if p.kv_dtype in seen:
            continue
        seen.add(p.kv_dtype)
        marker = _KV_MARKERS.get(p.kv_dtype, "o")
        batches = ",".join(str(q.batch) for q in attention if q.kv_dtype == p.kv_dtype)
        label = f"decode attention on CPU, KV {p.kv_dtype} (b={batches})"
        ax.scatter(p.cpu_intensity, p.cpu_flops_per_s, marker=marker, s=70, color="tab:purple",
                   zorder=5, label=label)  # fmt: skip
        if p.gpu_streamed_flops_per_s is not None:
            ax.scatter(p.cpu_intensity, p.gpu_streamed_flops_per_s, marker=marker, s=70,
                       facecolors="none", edgecolors="tab:purple", zorder=5)  # fmt: skip
    if attention and attention[0].gpu_streamed_flops_per_s is not None:
        label = "hollow marker: the same op on the GPU, its data fetched over PCIe"
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="gray", label=label)


def _draw_expert_ffn(ax, ffn, micro_batch) -> None:
    """The expert FFN per batch size, on the CPU and with its weights streamed to the GPU."""
    if not ffn:
        return
    xs = [p.cpu_intensity for p in ffn]
    ax.plot(xs, [p.cpu_flops_per_s for p in ffn], "o-", color="tab:orange", ms=6, zorder=5,
            label="expert FFN on CPU (weights in CPU memory)")  # fmt: skip
    if ffn[0].gpu_streamed_flops_per_s is not None:
        ax.plot(xs, [p.gpu_streamed_flops_per_s for p in ffn], "o--", color="tab:orange",
                mfc="none", ms=6, zorder=5,
                label=f"expert FFN on GPU, weights streamed (mu={micro_batch})")  # fmt: skip
    for p in ffn:
        ax.annotate(f"N={p.batch}", (p.cpu_intensity, p.cpu_flops_per_s), fontsize=8,
                    textcoords="offset points", xytext=(4, -12))  # fmt: skip


def _draw_turning_points(ax, report: RooflineReport) -> None:
    if report.turning is None:
        return
    for name, value in (("P1", report.turning.p1), ("P2", report.turning.p2)):
        if value is None:
            continue
        ax.axvline(value, color="gray", ls=":", lw=1.2)
        ax.annotate(f"{name} = {value:.3g} FLOP/B", (value, 1.0),
                    xycoords=("data", "axes fraction"), xytext=(-4, -14),
                    textcoords="offset points", fontsize=9, color="dimgray",
                    ha="right")  # fmt: skip
