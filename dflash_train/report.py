"""Eval reports: budget advice, report.json, report.md and plots (matplotlib, headless)."""

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _interp_log_width(table: dict, width: int) -> float:
    """Verify ms at `width` from a {width: ms} table, linear in log(width) between measured widths."""
    pts = sorted((int(w), float(ms)) for w, ms in table.items())
    if width <= pts[0][0]:
        return pts[0][1]
    for (w0, m0), (w1, m1) in zip(pts, pts[1:]):
        if width <= w1:
            f = (math.log(width) - math.log(w0)) / (math.log(w1) - math.log(w0))
            return m0 + f * (m1 - m0)
    return pts[-1][1] * width / pts[-1][0]  # beyond the table: grow linearly (compute-bound)


def advise_budget(results: list[dict], device_costs: dict | None = None) -> dict:
    """Predicted best DDTree budget per suite.

    Speedup over AR of a method = tau x (AR step time) / (its step time), with step time the sum
    of its measured per-round stage times (draft + tree + verify + commit) on this device. With
    `device_costs` (benchmarks/gpu_costs.py on another device), the step time there is
    draft + tree build + verify at width budget+1 (interpolated), and AR's step is verify at width 1.
    """
    advice = {}
    for suite in dict.fromkeys(r["suite"] for r in results):
        rows = [r for r in results if r["suite"] == suite]
        ar = next(r for r in rows if r["method"] == "ar")
        ar_ms = sum(ar["stage_ms_per_round"].values())
        preds = {}
        for r in rows:
            if r["method"] == "ddtree":
                preds[r["budget"]] = r["tau"] * ar_ms / sum(r["stage_ms_per_round"].values())
        chain = next(r for r in rows if r["method"] == "dflash")
        entry = {"predicted_speedup_by_budget": {str(b): round(s, 3) for b, s in preds.items()},
                 "chain_predicted_speedup": round(chain["tau"] * ar_ms / sum(chain["stage_ms_per_round"].values()), 3)}
        if preds:
            best = max(preds, key=preds.get)
            entry.update(best_budget=best, best_predicted_speedup=round(preds[best], 3))
        if device_costs:
            v = device_costs["verify_ms_by_width"]
            draft = device_costs.get("draft_ms", 0.0)
            build = device_costs.get("tree_build_ms_by_budget", {})
            ar_dev = _interp_log_width(v, 1)
            dev = {}
            for r in rows:
                if r["method"] == "ddtree":
                    b = r["budget"]
                    step = draft + float(build.get(str(b), 0.0)) + _interp_log_width(v, b + 1)
                    dev[b] = r["tau"] * ar_dev / step
            if dev:
                best = max(dev, key=dev.get)
                entry["device"] = {"name": device_costs.get("device"), "best_budget": best,
                                   "best_predicted_speedup": round(dev[best], 3),
                                   "predicted_speedup_by_budget": {str(b): round(s, 3) for b, s in dev.items()}}
        advice[suite] = entry
    return advice


def markdown(report: dict) -> str:
    hw = report["hardware"]
    lines = [f"# dflash-eval: {report['drafter']}", "",
             f"Target `{report['target']}`, block size {report['block_size']}, taps {report['target_layer_ids']}, "
             f"temperature {report['temperature']}, max {report['max_new_tokens']} new tokens per turn.",
             f"Hardware: {hw['device']} ({hw['device_type']}), torch {hw['torch']}"
             + (f", CUDA {hw['cuda']}, driver {hw['driver']}" if hw.get("cuda") else "") + ".", ""]
    for suite, adv in report["advice"].items():
        rows = [r for r in report["results"] if r["suite"] == suite]
        lines += [f"## {suite} ({rows[0]['prompts']} prompts)", "",
                  "| method | budget | tau | tokens/s | speedup vs AR | lossless | draft ms | tree ms | verify ms | commit ms |",
                  "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
        for r in rows:
            s = r["stage_ms_per_round"]
            lossless = {True: "yes", False: "**NO**", None: "n/a (T>0)"}[r["lossless"]]
            lines.append(f"| {r['method']} | {r['budget']} | {r['tau']:.2f} | {r['tokens_per_s']} | "
                         f"{r['speedup']:.2f}x | {lossless} | {s['draft']:.2f} | {s['tree']:.2f} | "
                         f"{s['verify']:.2f} | {s['commit']:.2f} |")
        lines.append("")
        if "best_budget" in adv:
            lines.append(f"Recommended DDTree budget on this device: **{adv['best_budget']}** (predicted "
                         f"{adv['best_predicted_speedup']:.2f}x over AR; the chain: {adv['chain_predicted_speedup']:.2f}x).")
        if "device" in adv:
            d = adv["device"]
            lines.append(f"On {d['name']} (from its measured verify costs): budget **{d['best_budget']}**, "
                         f"predicted {d['best_predicted_speedup']:.2f}x over AR.")
        lines.append("")
    lines += ["tau = tokens per target forward, bonus token included, averaged over prompts. "
              "Times are per decoding round, prefill excluded.", ""]
    return "\n".join(lines)


def plot_tau(report: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for suite in report["advice"]:
        rows = [r for r in report["results"] if r["suite"] == suite]
        tree = sorted((r["budget"], r["tau"]) for r in rows if r["method"] == "ddtree")
        line = ax.plot([max(b, 0.5) for b, _ in tree], [t for _, t in tree], marker="o", label=f"{suite}: DDTree")
        chain = next(r["tau"] for r in rows if r["method"] == "dflash")
        ax.axhline(chain, linestyle="--", color=line[0].get_color(), label=f"{suite}: DFlash chain")
    ax.axhline(1.0, color="grey", linewidth=0.8, label="AR")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget (non-root nodes; 0 drawn at 0.5)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_histograms(report: dict, path: Path) -> None:
    suites = list(report["advice"])
    fig, axes = plt.subplots(len(suites), 1, figsize=(6, 3 * len(suites)), squeeze=False)
    for ax, suite in zip(axes[:, 0], suites):
        rows = [r for r in report["results"] if r["suite"] == suite and r["method"] != "ar"]
        best = report["advice"][suite].get("best_budget")
        shown = [r for r in rows if r["method"] == "dflash" or r["budget"] == best]
        width = 0.8 / max(len(shown), 1)
        for i, r in enumerate(shown):
            ks = [int(k) for k in r["accept_hist"]]
            total = max(sum(r["accept_hist"].values()), 1)
            ax.bar([k + i * width for k in ks], [v / total for v in r["accept_hist"].values()], width,
                   label=f"{r['method']}" + (f" budget {r['budget']}" if r["method"] == "ddtree" else ""))
        ax.set_title(f"{suite}: acceptance length per round")
        ax.set_xlabel("tokens per round (accepted + bonus)")
        ax.set_ylabel("fraction of rounds")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(folder: Path, report: dict) -> None:
    (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "report.md").write_text(markdown(report))
    plot_tau(report, folder / "tau_vs_budget.png")
    plot_histograms(report, folder / "accept_hist.png")
