"""Eval reports: report.json, report.md and plots (matplotlib, headless)."""

import json
from pathlib import Path
from typing import Annotated

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pydantic import Field, model_validator  # noqa: E402

from dflash_train.core.schema import Open, load_json, validated  # noqa: E402
from dflash_train.evaluation.loops import MIN_LOOP_TOKENS, MIN_REPEATS  # noqa: E402
from dflash_train.evaluation.speed import verdict_text  # noqa: E402

# --- the schema of report.json, as dflash-export reads it back (the fields the card uses) -------

Interval = Annotated[list[float], Field(min_length=2, max_length=2)]


class Result(Open):
    suite: str
    method: str
    budget: Annotated[int, Field(ge=0)]
    tau: float
    lossless: bool | None
    speedup: float | None
    speedup_interval: Interval | None
    prompts: Annotated[int, Field(ge=1)]
    temperature: float
    max_new_tokens: int


class Hardware(Open):
    device: str
    device_type: str
    torch: str
    cuda: str | None = None
    driver: str | None = None


class MethodKey(Open):
    method: str
    budget: int


class Verdict(Open):  # speed.verdict
    best: MethodKey
    speedup: float
    interval: Interval | None
    recommended: MethodKey | None
    indistinguishable: list[MethodKey]

    @model_validator(mode="after")
    def _named(self):
        if self.recommended is None and len(self.indistinguishable) < 2:
            raise ValueError("a verdict without a recommendation lists at least two indistinguishable "
                             "methods")
        return self


class DeviceAdvice(Open):
    name: str | None
    concurrency: dict[int, Verdict]


class Advice(Open):
    measured: Verdict
    concurrency: dict[int, Verdict]
    device: DeviceAdvice | None = None


class EvalReport(Open):
    target: str
    target_revision: str | None = None
    drafter_fingerprint: str | None = None  # None: an older dflash-eval (the exporter says so)
    block_size: int | None = None
    hardware: Hardware
    results: Annotated[list[Result], Field(min_length=1)]
    advice: Annotated[dict[str, Advice], Field(min_length=1)]

    @model_validator(mode="after")
    def _same_suites(self):
        measured = {r.suite for r in self.results}
        if measured != set(self.advice):
            raise ValueError(f"results' suites {sorted(measured)} are not advice's suites "
                             f"{sorted(self.advice)}")
        return self


def read_report(path: str) -> dict:
    """A report.json written by dflash-eval, checked against EvalReport (one line naming the field)."""
    where = f"eval report '{path}'"
    report = load_json(Path(path), f"{where} is not a readable dflash-eval report.json")
    validated(EvalReport, report, where)
    return report

# --- report.md and plots ----------------------------------------------------------------------


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _speedup(value, iv) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}x" + (f" ({iv[0]:.2f}-{iv[1]:.2f})" if iv and iv[0] != iv[1] else "")


def _tau(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _method(r: dict) -> str:
    return f"| {r['method']} | {r['budget']} |"


def _prediction_table(rows: list[dict], key: str, levels: list[int]) -> list[str]:
    lines = ["| method | budget | " + " | ".join(f"{c} request{'s' * (c > 1)}" for c in levels) + " |",
             "|---|---:|" + "---:|" * len(levels)]
    for r in rows:
        cells = []
        for c in levels:
            p = r[key][str(c)]
            cells.append(_speedup(p["speedup"], p["interval"]) + ("*" if p["extrapolated"] else ""))
        lines.append(f"{_method(r)} " + " | ".join(cells) + " |")
    return lines


def _distilled_text(trained: dict) -> str:
    """Tree distillation as the run's metrics counted it (checkpoint/folders.distilled_steps):
    "tree-distilled" only when some step distilled; a recipe alone says what was asked."""
    td, n = trained.get("tree_distill"), trained.get("distilled")
    if not td:
        return ""
    how = (f"{td['anchors']} blocks' {td['budget']}-node trees every {td['every']} step(s), "
           f"weight {td['weight']}")
    if n is None:
        return f"; its recipe asks for tree distillation ({how}), how many steps distilled is not recorded"
    if not n["distilled"]:
        return (f"; its recipe asks for tree distillation ({how}), but not one of its "
                f"{plural(n['steps'], 'step')} distilled")
    return f", tree-distilled on {n['distilled']} of {plural(n['steps'], 'step')} ({how})"


# hardware.dtype in words (bf16-weights: dflash-eval --target-dtype bf16-weights)
DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16", "bf16-weights": "bf16 weights, fp32 activations"}


def dtype_label(dtype: str) -> str:
    return DTYPE_LABELS.get(dtype, dtype)


def _dtype_text(dtype: str) -> str:
    if dtype == "bf16-weights":
        return "; weights rounded to bf16, activations in float32"
    return f"; weights in {dtype}"


def _header(report: dict) -> list[str]:
    """The report's title, setup and hardware lines (and what the drafter was trained for)."""
    hw = report["hardware"]
    lines = [f"# dflash-eval: {report['drafter']}", "",
             f"Target `{report['target']}`, block size {report['block_size']}, taps "
             f"{report['target_layer_ids']}, temperature {report['temperature']}, max "
             f"{report['max_new_tokens']} new tokens per turn, {report['repeats']} repeat(s) of the sweep.",
             f"Hardware: {hw['device']} ({hw['device_type']}), torch {hw['torch']}"
             + (f", CUDA {hw['cuda']}, driver {hw['driver']}" if hw.get("cuda") else "")
             + (_dtype_text(hw["dtype"]) if hw.get("dtype") else "")
             + (f", {hw['cpu_threads']} thread(s), the streaming CPU linear "
                f"(dflash_train/model/cpu_linear.py)"
                if hw.get("cpu_linear") == "stream" else "") + ".", ""]
    trained = report.get("trained_for") or {}
    if trained.get("deploy_budget") or trained.get("tree_distill"):
        lines[-1:-1] = ["Drafter trained" + (f" and chosen for DDTree budget {trained['deploy_budget']}"
                                             if trained.get("deploy_budget") else "")
                        + _distilled_text(trained) + "."]
    return lines


def _suite_section(suite: str, rows: list[dict], adv: dict, levels: list[int]) -> list[str]:
    """One suite's results table, measured verdict and predictions (on this device, and on
    another one's measured costs)."""
    lines = [f"## {suite} ({plural(rows[0]['prompts'], 'prompt')})", "",
             "| method | budget | tau | speedup vs AR (90% interval) | tokens/s | lossless | draft ms | tree "
             "ms | verify ms | commit ms | loops | tau without loops |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = r["stage_ms_per_round"]
        lossless = {True: "yes", False: "**NO**", None: "n/a (T>0)"}[r["lossless"]]
        lines.append(f"{_method(r)} {r['tau']:.2f} | {_speedup(r['speedup'], r['speedup_interval'])} | "
                     f"{r['tokens_per_s']} | {lossless} | "
                     + " | ".join("n/a" if s[k] is None else f"{s[k]:.2f}" for k in s)
                     + f" | {r['looping_replies']}/{r['replies']} | {_tau(r['tau_without_loops'])} |")
    lines += ["", f"**Measured here, one request at a time:** {verdict_text(adv['measured'])}", "",
              "Predicted speedup over AR when N requests share one verify forward "
              "(width N x (budget + 1)), from this eval's cost curve:", ""]
    lines += _prediction_table(rows, "predicted", levels)
    lines.append("")
    lines += [f"- {c} request{'s' * (int(c) > 1)}: {verdict_text(v)}" for c, v in adv["concurrency"].items()
              if int(c) > 1]
    if "device" in adv:
        lines += ["", f"Predicted on {adv['device']['name']} (from its measured costs, `--verify-times`):",
                  ""]
        lines += _prediction_table(rows, "predicted_on_device", levels)
        lines.append("")
        lines += [f"- {c} request{'s' * (int(c) > 1)}: {verdict_text(v)}"
                  for c, v in adv["device"]["concurrency"].items()]
    lines.append("")
    return lines


def _method_notes(costs: dict) -> list[str]:
    """How speedup, tau, loops and stage times are measured, and the cost curve behind the predictions."""
    return ["Speedup = median over prompts and repeats of AR's decode time per token / the method's on the "
            "same prompt; the methods run back to back per prompt, in an order rotated from prompt to "
            "prompt, so a change in machine load lands on all of them. Interval: 90% bootstrap over prompts "
            "and repeats. tau = tokens per target forward, bonus token included, averaged over prompts. "
            f"Loops = replies holding a repetition loop (a block of tokens repeated exactly, {MIN_REPEATS}+ "
            f"times, over {MIN_LOOP_TOKENS}+ tokens: dflash_train/evaluation/loops.py) out of all; tau "
            "without loops leaves out the prompts with such a reply. "
            "Stage times are medians per decoding round, prefill excluded.", "",
            f"Cost curve (median of {costs['rounds']} rounds after a {costs['context']}-token context): "
            "verify ms by width " + ", ".join(f"{w}: {ms:.2f}"
                                              for w, ms in costs["verify_ms_by_width"].items())
            + "; drafter ms by batch " + ", ".join(f"{c}: {ms:.2f}"
                                                   for c, ms in costs["draft_ms_by_batch"].items())
            + ". A round of N requests = drafter pass for N + N x (tree build + commit) + one verify "
              "forward.",
            ""]


def markdown(report: dict) -> str:
    lines, extrapolated = _header(report), False
    for suite, adv in report["advice"].items():
        rows = [r for r in report["results"] if r["suite"] == suite]
        lines += _suite_section(suite, rows, adv, report["concurrency"])
        extrapolated |= any(p["extrapolated"] for r in rows for p in r["predicted"].values())
    lines += _method_notes(report["costs"])
    if extrapolated:
        lines += ["\\* the verify width is beyond the widest measured (1024): extrapolated along the curve's "
                  "last segment.", ""]
    return "\n".join(lines)


def plot_tau(report: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    any_tree = False
    for suite in report["advice"]:
        rows = [r for r in report["results"] if r["suite"] == suite]
        tree = sorted((r["budget"], r["tau"]) for r in rows if r["method"] == "ddtree")
        any_tree |= bool(tree)
        line = ax.plot([b for b, _ in tree], [t for _, t in tree], marker="o", label=f"{suite}: DDTree")
        chain = next(r["tau"] for r in rows if r["method"] == "dflash")
        ax.axhline(chain, linestyle="--", color=line[0].get_color(), label=f"{suite}: DFlash chain")
    ax.axhline(1.0, color="grey", linewidth=0.8, label="AR")
    if any_tree:  # `--budgets 0`: no tree, only the chain's and AR's levels (no budgets to log-scale)
        ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget (non-root nodes)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speedup(report: dict, path: Path) -> None:
    """Per suite: measured speedup (one request, with its interval) and the predicted speedup at
    each concurrency against the tree budget; the chain is drawn at its own width (B-1 nodes)."""
    suites = list(report["advice"])
    fig, axes = plt.subplots(len(suites), 1, figsize=(7, 4 * len(suites)), squeeze=False)
    for ax, suite in zip(axes[:, 0], suites):
        rows = [r for r in report["results"] if r["suite"] == suite]
        tree = sorted((r for r in rows if r["method"] == "ddtree"), key=lambda r: r["budget"])
        chain = next(r for r in rows if r["method"] == "dflash")
        for c in report["concurrency"]:
            ps = [r["predicted"][str(c)] for r in tree]
            line = ax.plot([r["budget"] for r in tree], [p["speedup"] for p in ps], marker=".",
                           label=f"predicted, {c} request{'s' * (c > 1)}")
            color = line[0].get_color()
            ivs = [p["interval"] or [p["speedup"]] * 2 for p in ps]
            ax.fill_between([r["budget"] for r in tree], [i[0] for i in ivs], [i[1] for i in ivs],
                            color=color, alpha=0.15)
            pc = chain["predicted"][str(c)]
            ax.plot([chain["budget"]], [pc["speedup"]], marker="s", color=color, linestyle="none")
        measured = [r for r in tree + [chain] if r["speedup"] is not None]
        ax.errorbar([r["budget"] for r in measured], [r["speedup"] for r in measured],
                    yerr=[[r["speedup"] - (r["speedup_interval"] or [r["speedup"]] * 2)[0] for r in measured],
                          [(r["speedup_interval"] or [r["speedup"]] * 2)[1] - r["speedup"]
                           for r in measured]],
                    fmt="o", color="black", capsize=3, label="measured, 1 request (90% interval)")
        ax.axhline(1.0, color="grey", linewidth=0.8, label="AR")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{suite}: speedup over AR (squares: the DFlash chain)")
        ax.set_xlabel("tree budget (non-root nodes)")
        ax.set_ylabel("speedup over AR")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_verify_cost(report: dict, path: Path) -> None:
    costs = report["costs"]
    fig, ax = plt.subplots(figsize=(6, 4))
    widths = [int(w) for w in costs["verify_ms_by_width"]]
    ax.plot(widths, list(costs["verify_ms_by_width"].values()), marker="o")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("verify width (tokens in one target forward)")
    ax.set_ylabel("ms per verify forward")
    ax.set_title(f"{report['hardware']['device']}: verify cost after {costs['context']} context tokens",
                 fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_histograms(report: dict, path: Path) -> None:
    suites = list(report["advice"])
    fig, axes = plt.subplots(len(suites), 1, figsize=(6, 3 * len(suites)), squeeze=False)
    for ax, suite in zip(axes[:, 0], suites):
        rows = [r for r in report["results"] if r["suite"] == suite and r["method"] != "ar"]
        trees = [r for r in rows if r["method"] == "ddtree" and r["speedup"] is not None]
        best = max(trees, key=lambda r: r["speedup"])["budget"] if trees else None
        shown = [r for r in rows if r["method"] == "dflash"
                 or (r["method"] == "ddtree" and r["budget"] == best)]
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
    plot_speedup(report, folder / "speedup_vs_budget.png")
    plot_verify_cost(report, folder / "verify_cost.png")
