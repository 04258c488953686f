"""Turning raw figures into the outputs: the JSON (everything), the Markdown
table and the PNG plot. Used by both the A/B run and ``--ops``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional

from bench.common import file_stem, length_label, log

ENGINES = ("lily", "stock")


# ----------------------------------------------------------------- summary


def _median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _spread(values: List[float]) -> Optional[float]:
    return (max(values) - min(values)) / statistics.median(values) if values else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _count(ok: List[Dict[str, Any]], key: str) -> Optional[float]:
    """A decode-step count (``bench.counts``) of the last round that has one:
    the graph is the same every round."""
    values = [a["counts"][key] for a in ok if key in (a.get("counts") or {})]
    return values[-1] if values else None


def summarize_engine(arms: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One engine at one length over its rounds."""
    ok = [a for a in sorted(arms, key=lambda a: a["round"]) if "error" not in a]
    digests = [a["digest"] for a in ok]
    return {
        "rounds_ok": len(ok),
        "rounds_failed": len(arms) - len(ok),
        "prefill_tps": [a["prefill_tps"] for a in ok],
        "decode_tps": [a["decode_tps"] for a in ok],
        "prefill_tps_median": _median([a["prefill_tps"] for a in ok]),
        "decode_tps_median": _median([a["decode_tps"] for a in ok]),
        # One decode step's graph (bench/counts.py): kernels it launches, bytes
        # they read and write, and the bytes the token must read at least.
        "kernels_per_decode_token": _count(ok, "kernels_per_decode_token"),
        "bytes_per_decode_token": _count(ok, "bytes_per_decode_token"),
        "bytes_token_must_read": _count(ok, "bytes_token_must_read"),
        "bytes_ratio_to_must_read": _count(ok, "ratio_to_must_read"),
        "counts_context": _count(ok, "context"),
        "counts_errors": sorted({a["counts"]["error"] for a in ok if "error" in (a.get("counts") or {})}),
        # Host time to build one decode step's graph (bench/measure.py).
        "host_ms_per_decode_token": _median([a["host_ms_per_decode_token"] for a in ok
                                             if a.get("host_ms_per_decode_token") is not None]),
        # The kernels' device time of one decode step (bench/gpu_time.py;
        # None where the platform has no timer).
        "gpu_ms_per_decode_token": _median([a["gpu_ms_per_decode_token"] for a in ok
                                            if a.get("gpu_ms_per_decode_token") is not None]),
        "gpu_time_notes": sorted({a["gpu_time_note"] for a in ok if a.get("gpu_time_note")}),
        # (max - min) / median over rounds: large values mean a noisy arm
        # (or one that paid for compilation in one round only).
        "prefill_spread": _spread([a["prefill_tps"] for a in ok]),
        "decode_spread": _spread([a["decode_tps"] for a in ok]),
        "digests": digests,
        "digests_consistent": len(set(digests)) <= 1,
        "peak_memory_bytes_max": max((a["peak_memory_bytes"] for a in ok), default=None),
        "lily_layers": sorted({a.get("lily_layers") for a in ok}),
        "errors": [a["error"] for a in arms if "error" in a],
    }


def summarize(arms: List[Dict[str, Any]], lengths: List[int]) -> List[Dict[str, Any]]:
    rows = []
    for n in lengths:
        per = {e: summarize_engine([a for a in arms if a["length"] == n and a["engine"] == e])
               for e in ENGINES}
        flags = []
        for e in ENGINES:
            if not per[e]["digests_consistent"]:
                flags.append(f"{e}: greedy tokens differ across rounds {per[e]['digests']}")
            if per[e]["rounds_failed"]:
                flags.append(f"{e}: {per[e]['rounds_failed']} round(s) failed: {per[e]['errors'][0]}")
        lily_d, stock_d = per["lily"]["digests"], per["stock"]["digests"]
        methods = sorted({a["prefill_method"] for a in arms if a["length"] == n and a.get("prefill_method")})
        rows.append({
            "length": n,
            "label": length_label(n),
            # --depth-from: the prefill figures time the last chunk at depth only.
            "prefill_method": methods[0] if methods else None,
            "lily": per["lily"],
            "stock": per["stock"],
            "decode_ratio": _ratio(per["lily"]["decode_tps_median"], per["stock"]["decode_tps_median"]),
            "prefill_ratio": _ratio(per["lily"]["prefill_tps_median"], per["stock"]["prefill_tps_median"]),
            # Informational: kernels in other precisions may pick other greedy
            # tokens; on the reference path the engines must agree.
            "engines_tokens_match": bool(lily_d and stock_d and set(lily_d) == set(stock_d)),
            "flags": flags,
        })
    return rows


# ------------------------------------------------------------------ format


def _optional(x: Optional[float], digits: int = 2) -> str:
    """A figure some platforms cannot give: "-" there."""
    return "-" if x is None else _num(x, digits)


def _num(x: Optional[float], digits: int = 2) -> str:
    if x is None:
        return "error"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _gib(x: Optional[int]) -> str:
    if x is None:
        return "-"
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def _header(doc: Dict[str, Any], title: str) -> List[str]:
    m, s = doc["machine"], doc["software"]
    accel = m.get("accelerator", {})
    return [
        f"# {title}",
        "",
        f"- machine: {m['hostname']}, {accel.get('name')} ({accel.get('backend')}), "
        f"{m['cpu']}, {_gib(m.get('memory_bytes'))} RAM, {m['os']}",
        f"- software: python {s['python']}, mlx {s['mlx']}, mlx-lm {s['mlx_lm']}, "
        f"mlx-lily {s['mlx_lily']} @ {s['git_revision']}; kernels: {s.get('kernel_backend')} "
        f"(MLX_LILY_KERNELS={s['MLX_LILY_KERNELS']}, "
        f"MLX_LILY_KERNEL_BACKEND={s.get('MLX_LILY_KERNEL_BACKEND')})",
        f"- started {doc['started']}, finished {doc['finished']}",
    ]


def _count_cell(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _mb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e6:,.2f}"


def ab_table(rows: List[Dict[str, Any]]) -> List[str]:
    lines = [
        "| length | decode lily | decode stock | ratio | prefill lily | prefill stock | ratio "
        "| kernels/token lily | kernels/token stock | MB/token lily | MB/token stock "
        "| host ms/token lily | host ms/token stock | GPU ms/token lily | GPU ms/token stock |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mark = " ⚠" if r["flags"] else ""
        depth = " †" if r.get("prefill_method") else ""
        lines.append(
            f"| {r['label']}{mark} | {_num(r['lily']['decode_tps_median'])} | "
            f"{_num(r['stock']['decode_tps_median'])} | {_num(r['decode_ratio'], 3)} | "
            f"{_num(r['lily']['prefill_tps_median'], 1)}{depth} | {_num(r['stock']['prefill_tps_median'], 1)}{depth} | "
            f"{_num(r['prefill_ratio'], 3)} | "
            f"{_count_cell(r['lily'].get('kernels_per_decode_token'))} | "
            f"{_count_cell(r['stock'].get('kernels_per_decode_token'))} | "
            f"{_mb(r['lily'].get('bytes_per_decode_token'))} | "
            f"{_mb(r['stock'].get('bytes_per_decode_token'))} | "
            f"{_num(r['lily'].get('host_ms_per_decode_token'), 2)} | "
            f"{_num(r['stock'].get('host_ms_per_decode_token'), 2)} | "
            f"{_optional(r['lily'].get('gpu_ms_per_decode_token'))} | "
            f"{_optional(r['stock'].get('gpu_ms_per_decode_token'))} |"
        )
    return lines


def counts_md(rows: List[Dict[str, Any]]) -> List[str]:
    """Per length: each engine's bytes per decode token against the bytes the
    token must read (bench/counts.py says what each counts)."""
    lines = [
        "## Decode step: kernels and bytes",
        "",
        "One decode step's graph (bench/counts.py): kernels = primitive nodes that are not views; "
        "bytes = each kernel's inputs + outputs, summed over kernels; must read = the weights one "
        "token touches (top-k experts) + the cache state; counted on the run's cache after the "
        "measured tokens (context = length + decode steps + 1).",
        "",
        "| length | context | must read MB | lily MB | lily / must | stock MB | stock / must |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lily, stock = r["lily"], r["stock"]
        lines.append(
            f"| {r['label']} | {_count_cell(lily.get('counts_context') or stock.get('counts_context'))} | "
            f"{_mb(lily.get('bytes_token_must_read') or stock.get('bytes_token_must_read'))} | "
            f"{_mb(lily.get('bytes_per_decode_token'))} | {_num(lily.get('bytes_ratio_to_must_read'), 2) if lily.get('bytes_ratio_to_must_read') else '-'} | "
            f"{_mb(stock.get('bytes_per_decode_token'))} | {_num(stock.get('bytes_ratio_to_must_read'), 2) if stock.get('bytes_ratio_to_must_read') else '-'} |"
        )
    errors = sorted({e for r in rows for k in ENGINES for e in r[k].get("counts_errors", [])})
    lines += [""] + [f"Counting failed: {e}" for e in errors] + ([""] if errors else [])
    return lines


def ab_markdown(doc: Dict[str, Any]) -> str:
    st = doc["settings"]
    model = st["model"] or f"random {st['shape']} (seed {st['seed']})"
    lines = _header(doc, "mlx-lily A/B: lily vs stock mlx-lm")
    lines += [
        f"- model: {model}; mode: {st['mode']}; rounds: {st['rounds']} (ABBA); "
        f"decode steps: {st['decode_steps']}; prefill chunk: {st['prefill_step_size']}; "
        f"warmup: {st['warmup']}",
        "",
        f"Throughput in tokens/s, median over rounds. Decode: the {st['decode_steps']} tokens after the first, "
        "at the given context; prefill: prompt tokens / time to the first token. "
        "ratio = lily / stock (above 1: lily is faster).",
        "",
        *ab_table(doc["summary"]),
        "",
    ]
    depth = [f"- {r['label']}: {r['prefill_method']}" for r in doc["summary"] if r.get("prefill_method")]
    if depth:
        lines += ["† Prefill at depth (`--depth-from`): tokens/s of the last tokens only, for both "
                  "engines, after the same earlier tokens were prefilled by lily, untimed:", "", *depth, ""]
    flags = [f"- {r['label']}: {f}" for r in doc["summary"] for f in r["flags"]]
    if flags:
        lines += ["Flags (⚠):", "", *flags, ""]
    lines += counts_md(doc["summary"])
    lines += _numerics_md(doc.get("numerics"))
    lines += [
        "## Greedy tokens and memory per length",
        "",
        "| length | lily digests | stock digests | engines agree | peak mem lily | peak mem stock |",
        "|---:|---|---|---|---:|---:|",
    ]
    for r in doc["summary"]:
        lines.append(
            f"| {r['label']} | {' '.join(r['lily']['digests']) or '-'} | "
            f"{' '.join(r['stock']['digests']) or '-'} | {'yes' if r['engines_tokens_match'] else 'no'} | "
            f"{_gib(r['lily']['peak_memory_bytes_max'])} | {_gib(r['stock']['peak_memory_bytes_max'])} |"
        )
    lines += ["", *_op_paths_md(doc["op_paths"])]
    return "\n".join(lines) + "\n"


def _numerics_md(num: Optional[Dict[str, Any]]) -> List[str]:
    if num is None:
        return []
    lines = ["## Numerics (teacher-forced)", ""]
    if "error" in num:
        return lines + [f"failed: {num['error']}", ""]
    lines += [
        "| positions | top-1 agreement | ppl lily | ppl stock | ppl rel. diff | mean KL(lily‖stock) | max KL |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {num['positions']} | {num['top1_agreement']:.4f} | {num['ppl_lily']:.4f} | "
        f"{num['ppl_stock']:.4f} | {num['ppl_rel_diff']:+.2e} | {num['kl_mean']:.3e} | {num['kl_max']:.3e} |",
        "",
    ]
    floor = num.get("noise_floor")
    if floor:
        lines += [
            "Noise floor (stock against itself, its first input nudged by one bf16 step): "
            f"top-1 agreement {floor['top1_agreement']:.4f}, mean KL {floor['kl_mean']:.3e}. "
            "Where this floor is far from zero the model is chaotic (random weights can be) and "
            "lily's figures above mean only as much as they exceed it.",
            "",
        ]
    if num.get("note"):
        lines += [f"Note: {num['note']}", ""]
    return lines


def _op_paths_md(paths: Dict[str, Dict[str, str]]) -> List[str]:
    lines = ["## Lily op paths at run time", "", "| op | path | why |", "|---|---|---|"]
    lines += [f"| {n} | {p['path']} | {p['reason']} |" for n, p in paths.items()]
    return lines + [""]


# -------------------------------------------------------------------- plot


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None (the plot is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: skipping the plot (pip install matplotlib)")
        return None
    return plt


def ab_plot(doc: Dict[str, Any], path: Path) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    rows = doc["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"lily": ("tab:red", "o"), "stock": ("tab:blue", "s")}
    for ax, metric, title in ((axes[0], "prefill", "Prefill"), (axes[1], "decode", f"Decode ({doc['settings']['decode_steps']} tokens)")):
        for e in ENGINES:
            color, marker = styles[e]
            xs = [r["length"] for r in rows if r[e][f"{metric}_tps_median"] is not None]
            ys = [r[e][f"{metric}_tps_median"] for r in rows if r[e][f"{metric}_tps_median"] is not None]
            ax.plot(xs, ys, color=color, marker=marker, label=f"{e} (median)")
            # Every round as a faint dot, so spread between rounds is visible.
            for r in rows:
                for v in r[e][f"{metric}_tps"]:
                    ax.plot(r["length"], v, color=color, marker=".", alpha=0.35, linestyle="none")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["length"] for r in rows], [r["label"] for r in rows])
        ax.minorticks_off()
        ax.set_xlabel("prompt / context length (tokens)")
        ax.set_ylabel("tokens / s")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    m, s = doc["machine"], doc["software"]
    st = doc["settings"]
    model = st["model"] or f"random {st['shape']}"
    fig.suptitle(f"lily vs stock mlx-lm: {model}; {m['accelerator'].get('name')} "
                 f"({m['hostname']}); rev {s['git_revision']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ writers


def _write(doc: Dict[str, Any], out: Path, kind: str, markdown: str, plot_fn) -> Dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    stem = file_stem(kind, doc["machine"], doc["software"]["git_revision"])
    files = {"json": str(out / f"{stem}.json"), "markdown": str(out / f"{stem}.md")}
    Path(files["markdown"]).write_text(markdown)
    if plot_fn is not None and plot_fn(doc, out / f"{stem}.png"):
        files["plot"] = str(out / f"{stem}.png")
    doc["files"] = files
    Path(files["json"]).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    for what, where in files.items():
        log(f"wrote {what}: {where}")
    return files


def finish_ab(doc: Dict[str, Any], out: Path, plot: bool = True) -> Dict[str, str]:
    doc["summary"] = summarize(doc["arms"], doc["settings"]["lengths"])
    doc["flags"] = [f"{r['label']}: {f}" for r in doc["summary"] for f in r["flags"]]
    markdown = ab_markdown(doc)
    files = _write(doc, out, "ab", markdown, ab_plot if plot else None)
    print("\n".join(ab_table(doc["summary"])))
    for flag in doc["flags"]:
        log(f"flag: {flag}")
    return files


# --------------------------------------------------------------------- ops


def ops_table(rows: List[Dict[str, Any]]) -> List[str]:
    lines = [
        "| op | phase | context | tokens | path | lily ms | stock ms | speedup | lily ms in a graph | stock ms in a graph |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ctx = length_label(r["context"]) if r.get("context") else "-"
        if "error" in r:
            lines.append(f"| {r['op']} | {r['phase']} | {ctx} | {r['tokens']} | error | - | - | - | - | - |")
            continue
        lily = "reference only" if r["lily_ms"] is None else _num(r["lily_ms"], 3)
        if r.get("declined_kernel_ms") is not None:
            lily = f"reference (its {r['kernels']} kernel: {_num(r['declined_kernel_ms'], 3)})"
        path = f"{r['path']} ({r['kernels']})" if r.get("kernels") and r["path"] == "kernel" else r["path"]
        lines.append(
            f"| {r['op']} | {r['phase']} | {ctx} | {r['tokens']} | {path} | {lily} | "
            f"{_num(r['stock_ms'], 3)} | {_num(r['speedup'], 2) if r['speedup'] else '-'} | "
            f"{_num(r['lily_graph_ms'], 3) if r.get('lily_graph_ms') else '-'} | "
            f"{_num(r['stock_graph_ms'], 3) if r.get('stock_graph_ms') else '-'} |"
        )
    return lines


def ops_markdown(doc: Dict[str, Any]) -> str:
    st = doc["settings"]
    lines = _header(doc, "mlx-lily ops: each lily op vs its stock reference")
    lines += [
        f"- shapes: {st['shape']}; prefill chunk {st['chunk']}; attention contexts "
        f"{', '.join(length_label(c) for c in st['contexts'])}",
        "",
        "Median milliseconds per call (inputs at the model's shapes). stock = the op's "
        "reference, which is stock mlx-lm's computation; lily = the op as lily calls it "
        "(its kernel where it has one and takes these shapes). speedup = stock / lily. "
        "'reference only': no kernel runs here, so only the reference is timed. "
        "'reference (its K kernel: ms)': the op chooses its reference for these shapes on this "
        "backend (faster there), and its kernel K is timed beside it. 'in a graph' (GPUs only, "
        f"calls up to {doc['settings']['timing'].get('in_graph_up_to_ms', '-')} ms): "
        f"{doc['settings']['timing'].get('graph_calls', '-')} calls built, then evaluated "
        "together, per call: the evaluation's launch and sync overhead spread over them, as "
        "over a model's layers.",
        "",
        *ops_table(doc["rows"]),
        "",
    ]
    gemm = [r for r in doc["rows"] if "stock_tflops" in r]
    for r in gemm:
        lily = f"{r['lily_tflops']:.1f}" if r.get("lily_tflops") else "- (reference only)"
        lines += [
            f"{r['op']} ({r.get('shape', 'bf16 GEMM')}): "
            f"lily {lily} TFLOP/s, mx.matmul {r['stock_tflops']:.1f} TFLOP/s.",
            "",
        ]
    notes = [f"- {r['op']} ({r['phase']}): {r['note']}" for r in doc["rows"] if r.get("note")]
    if notes:
        lines += ["Notes:", "", *sorted(set(notes)), ""]
    lines += _op_paths_md(doc["op_paths"])
    return "\n".join(lines) + "\n"


def finish_ops(doc: Dict[str, Any], out: Path) -> Dict[str, str]:
    files = _write(doc, out, "ops", ops_markdown(doc), None)
    print("\n".join(ops_table(doc["rows"])))
    return files
