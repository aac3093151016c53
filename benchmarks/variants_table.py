"""Issue 44's table: every variant on SmolLM2 at equal CPU time (benchmarks/variants_smollm2.sh), beside the
committed DFlash drafter's card.

    .venv/bin/python benchmarks/variants_table.py [--runs runs/variants]
        [--output benchmarks/results/variants_smollm2.json]

Per arm: its calibrated s/step (the train stage's, scaled to the first calibration's load), the steps it ran
and their CPU minutes, training's held-out validation at its last step (chain EAL, DDTree@16 / @64), and its
dflash-eval reports (`eval-<arm>-t0`, `eval-<arm>-t1`, each joined with its `-<tag>` continuations
over other suites): per suite the chain's tau, DDTree's tau per budget,
the fastest method's paired speedup over plain decoding with its 90% interval, and whether every output
was the target's. The committed drafter's row reads its card's reports (checkpoints/smollm2-135m-dflash/
eval_reports: report_0 at T=0, report_1 at T=1), and, when it was decoded again beside the arms
(`eval-committed-t0`), a second row does: speedups compare only on one machine. Writes the raw rows (with
each report's command, this commit and the machine) to --output and prints the markdown tables.

`--s-per-step ARM` prints the arm's s/step and nothing else (the train stage's step count): its calibration
here, else the one recorded in --output (calibrated on an earlier machine, whose runs/ is gone).

An arm whose run folder is gone (runs/ is not kept between machines; only git is) keeps its row from the
--output written before, marked with the commit that measured it, so a rerun over a fresh runs/ adds rows
and loses none; --fresh drops them.
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["dflash", "xpress", "dspark", "dflash2"]
NAMES = {"dflash": "DFlash, continued (control)", "xpress": "XPress", "dspark": "DSpark (vanilla, conf.)",
         "dflash2": "DFlash2 (full vocabulary)", "committed": "committed DFlash card (before)",
         "committed-here": "committed DFlash drafter, re-measured here"}
SUITES = ["mtbench", "gsm8k", "humaneval"]


def read(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def s_per_step(runs: Path, name: str) -> float | None:
    """As variants_smollm2.sh's train stage: the arm's calibration, scaled by dflash / dflashref when the arm
    was calibrated beside the DFlash reference arm."""
    def raw(n):
        s = read(runs / f"calib-{n}" / "summary.json")
        return None if s is None else s["train_tokens"] / s["train_tokens_per_s"] / s["steps"]
    own = raw(name)
    if own is None:
        return None
    if name not in ("dflash", "xpress") and raw("dflashref") is not None:
        return own * raw("dflash") / raw("dflashref")
    return own


def recorded_s_per_step(runs: Path, name: str, previous: dict | None) -> float | None:
    """The arm's calibration here, else its row's in the results written before."""
    here = s_per_step(runs, name)
    if here is not None or previous is None:
        return here
    return next((r.get("s_per_step") for r in previous["rows"] if r["arm"] == name), None)


def suite_rows(report: dict) -> dict:
    """suite -> chain tau, tau per DDTree budget, the fastest method and its speedup / interval, lossless."""
    out = {}
    for suite in SUITES:
        rows = [r for r in report["results"] if r["suite"] == suite]
        if not rows:
            continue
        spec = [r for r in rows if r["method"] != "ar"]
        best = max(spec, key=lambda r: r["speedup"])
        chain = next(r for r in rows if r["method"] == "dflash")
        out[suite] = {"chain_tau": chain["tau"], "chain_passes": chain.get("jacobi_passes"),
                      "ddtree_tau": {str(r["budget"]): r["tau"] for r in rows if r["method"] == "ddtree"},
                      "best": f"{'chain' if best['method'] == 'dflash' else 'DDTree@' + str(best['budget'])}",
                      "best_speedup": best["speedup"], "best_interval": best["speedup_interval"],
                      # T=0: every output is the target's; T>0: not judged (None), the sampler's test is
                      # tests/decoding's chi-square
                      "lossless": all(r["lossless"] for r in rows) if report["temperature"] == 0 else None,
                      "ar_tokens_per_s": next(r["tokens_per_s"] for r in rows if r["method"] == "ar")}
    return out


def arm_reports(runs: Path, name: str, t: str) -> dict | None:
    """The arm's report at temperature `t` ("t0", "t1"): `eval-<arm>-<t>` joined with the later evals of other
    suites of the same drafter, `eval-<arm>-<t>-<tag>` (the eval stage's TAG). Same drafter, temperature
    and budgets, no suite twice, or it stops."""
    folders = [f for f in [runs / f"eval-{name}-{t}", *sorted(runs.glob(f"eval-{name}-{t}-*"))] if f.is_dir()]
    reports = [r for r in map(read, (f / "report.json" for f in folders)) if r is not None]
    if not reports:
        return None
    first, seen = reports[0], set()
    for r in reports:
        same = [r[k] == first[k] for k in ("drafter", "temperature", "budgets")]
        assert all(same), f"{name} {t}: {r['command']} evaluated another drafter, temperature or budgets"
        suites = {x["suite"] for x in r["results"]}
        assert not suites & seen, f"{name} {t}: {sorted(suites & seen)} evaluated twice"
        seen |= suites
    return {**first, "command": [r["command"] for r in reports],
            "results": [x for r in reports for x in r["results"]]}


def decoded(rep: dict) -> dict:
    """A row's cell for one (joined) dflash-eval report: its commands, drafter, budgets, per-suite summary and
    every raw result."""
    return {"command": rep["command"], "drafter": rep["drafter"], "budgets": rep["budgets"],
            "suites": suite_rows(rep), "results": rep["results"]}


def arm_row(runs: Path, name: str, previous: dict | None = None) -> dict | None:
    """A finished arm (summary.json), or one stopped early whose training checkpoint was evaluated (its
    step from the evaluated folder's name, its validation from metrics.jsonl at that step)."""
    summary = read(runs / name / "summary.json")
    reports = {t: arm_reports(runs, name, t) for t in ("t0", "t1")}
    if summary is not None:
        steps, val = summary["steps"], {k: summary["eval"][k] for k in ("eal", "ddtree_tau")}
    elif (runs / name / "metrics.jsonl").is_file():  # stopped early: the evaluated or last validated step
        records = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
        validated = [r for r in records if "val_eal" in r]
        if not validated:
            return None
        drafter = next((r["drafter"] for r in reports.values() if r), None)
        steps = int(re.search(r"step_(\d+)", drafter).group(1)) if drafter else validated[-1]["step"]
        r = next(r for r in validated if r["step"] == steps)
        val = {"eal": r["val_eal"], "ddtree_tau": r["val_ddtree_tau"]}
    else:
        return None
    sps = recorded_s_per_step(runs, name, previous)
    row = {"arm": name, "s_per_step": sps, "steps": steps, "stopped_early": summary is None,
           "cpu_min": None if sps is None else sps * steps / 60, "val": val}
    for t, rep in reports.items():
        if rep is not None:
            row[t] = decoded(rep)
    return row


def committed_row() -> dict:
    folder = ROOT / "checkpoints" / "smollm2-135m-dflash" / "eval_reports"
    row = {"arm": "committed"}
    for t, name in (("t0", "report_0.json"), ("t1", "report_1.json")):
        rep = read(folder / name)
        row[t] = {"command": rep["command"], "budgets": rep["budgets"], "suites": suite_rows(rep)}
    return row


def committed_here_row(runs: Path) -> dict | None:
    """The committed drafter decoded again beside the arms (`eval-committed-t0`, `-t1`): speedups are the
    machine's (the card's were taken on another host), so this is the row the arms' speedups compare with."""
    row = {"arm": "committed-here"}
    for t in ("t0", "t1"):
        rep = arm_reports(runs, "committed", t)
        if rep is not None:
            row[t] = decoded(rep)
    return row if len(row) > 1 else None


def merge_kept(rows: list[dict], previous: dict | None) -> list[dict]:
    """`rows` measured now, plus the rows of `previous` (the --output written before) for arms measured now
    no longer, each with the commit that measured it ("measured_at"), in ARMS order."""
    if previous is None:
        return rows
    now = {r["arm"] for r in rows}
    kept = [{**r, "measured_at": r.get("measured_at", previous["commit"])}
            for r in previous["rows"] if r["arm"] not in now]
    order = [*ARMS, "committed", "committed-here"]
    return sorted(rows + kept, key=lambda r: order.index(r["arm"]))


def fmt_best(s: dict) -> str:
    lo, hi = s["best_interval"]
    return f"{s['best_speedup']:.2f}x ({s['best']}, {lo:.2f}-{hi:.2f})"


def label(r: dict) -> str:
    return (NAMES[r["arm"]] + (" (stopped early)" if r.get("stopped_early") else "")
            + (f" (measured at {r['measured_at'][:7]})" if "measured_at" in r else ""))


def tables(rows: list[dict]) -> str:
    lines = ["| arm | s/step | steps (CPU-min) | val EAL / DDTree@64 | " +
             " | ".join(f"{s} chain tau / DDTree@64 / best T=0 speedup" for s in SUITES) + " | lossless |",
             "|---" * (5 + len(SUITES)) + "|"]
    for r in rows:
        head = (f"| {label(r)} | {r['s_per_step']:.2f} | {r['steps']} ({r['cpu_min']:.0f}) | "
                f"{r['val']['eal']:.2f} / {r['val']['ddtree_tau'].get('64', float('nan')):.2f} | "
                if "steps" in r else f"| {label(r)} | | | | ")
        cells, lossless = [], True
        for s in SUITES:
            x = (r.get("t0") or {}).get("suites", {}).get(s)
            if x is None:
                cells.append("")
                continue
            lossless &= x["lossless"]
            tree = x["ddtree_tau"].get("64", float("nan"))
            cells.append(f"{x['chain_tau']:.2f} / {tree:.2f} / {fmt_best(x)}")
        judged = "t0" in r  # an arm without decodes has nothing to judge
        lines.append(head + " | ".join(cells) + f" | {('yes' if lossless else 'NO') if judged else ''} |")
    lines += ["", "| arm (T=1) | " + " | ".join(f"{s} chain tau / best speedup" for s in SUITES) + " |",
              "|---" * (1 + len(SUITES)) + "|"]
    for r in rows:
        if "t1" not in r:
            continue
        cells = [f"{x['chain_tau']:.2f} / {fmt_best(x)}" for x in (r["t1"]["suites"][s] for s in SUITES)]
        lines.append(f"| {label(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "threads_per_run": 1}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=str(ROOT / "runs" / "variants"))
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "variants_smollm2.json"))
    p.add_argument("--fresh", action="store_true", help="drop the rows of arms whose run folder is gone")
    p.add_argument("--s-per-step", metavar="ARM", help="print the arm's s/step and stop")
    args = p.parse_args()
    runs, previous = Path(args.runs), None if args.fresh else read(Path(args.output))
    if args.s_per_step:
        sps = recorded_s_per_step(runs, args.s_per_step, previous)
        if sps is None:
            print(f"{args.s_per_step}: not calibrated (no {runs}/calib-{args.s_per_step}, no row in "
                  f"{args.output}): run the calibrate stage", file=sys.stderr)
            return 2
        print(sps)
        return 0
    here = committed_here_row(runs)
    rows = ([r for r in (arm_row(runs, a, previous) for a in ARMS) if r is not None] + [committed_row()]
            + ([here] if here else []))
    rows = merge_kept(rows, previous)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    Path(args.output).write_text(json.dumps(
        {"command": "bash benchmarks/variants_smollm2.sh data && ... calibrate && ... train && ... eval; "
                    "python benchmarks/variants_table.py",
         "commit": commit, "machine": machine(), "rows": rows},
        indent=1) + "\n")
    print(tables(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
