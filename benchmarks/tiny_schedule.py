"""Which schedule should the tiny default recipe train with? Rows of (batch, steps, lr, anchors) at
about equal training wall-clock, three seeds each, every drafter decoded by dflash-eval (lossless,
temperature 0) on the bundled prompts, as `make demo` does.

    .venv/bin/python benchmarks/tiny_schedule.py                   # the table (~50 min on one core)
    .venv/bin/python benchmarks/tiny_schedule.py --rows now b4-lr6e-4 --seeds 0

Resumable: a (row, seed) whose eval report exists is read, not rerun, so a killed sweep continues.
Every row trains on about the same number of anchored blocks (batch x steps x anchors), which is
what a step's time grows with here; the table shows each run's measured seconds so that "equal
wall-clock" can be checked (more, smaller steps pay a little per-step overhead).
Writes OUTPUT/<row>-s<seed>/{run,eval}, OUTPUT/schedule.json and benchmarks/results/tiny_schedule.json.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.objectives import run  # noqa: E402  (a command, its log; stops the sweep on failure)
RECIPE = ROOT / "recipes" / "tiny.yaml"
# row -> recipe overrides (the tiny recipe's shape, data and loss; only the schedule changes)
ROWS = {  # about 102k anchored blocks each (batch x steps x anchors), the tiny recipe's budget
    "now": ["train.batch_size=16", "max_steps=200", "train.lr=3e-3", "data.num_anchors=32"],
    # SpecForge's lr
    "b4x400-lr6e-4": ["train.batch_size=4", "max_steps=400", "train.lr=6e-4", "data.num_anchors=64"],
    "b4x400-lr1.2e-3": ["train.batch_size=4", "max_steps=400", "train.lr=1.2e-3", "data.num_anchors=64"],
    "b8x200-lr1.5e-3": ["train.batch_size=8", "max_steps=200", "train.lr=1.5e-3", "data.num_anchors=64"],
    "b4x800-lr1e-3": ["train.batch_size=4", "max_steps=800", "train.lr=1e-3", "data.num_anchors=32"],
    # b4x800 measured ~1.15x the wall time of `now` (small steps pay per-step overhead): 700 steps match it
    "b4x700-lr1e-3": ["train.batch_size=4", "max_steps=700", "train.lr=1e-3", "data.num_anchors=32"],
}
BUDGETS = [16, 64]


def one(row: str, seed: int, out: Path, env: dict, train: bool = True) -> dict | None:
    d = out / f"{row}-s{seed}"
    report = d / "eval" / "report.json"
    if not report.is_file() and not train:
        return None
    if not report.is_file():
        d.mkdir(parents=True, exist_ok=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        run([sys.executable, "-m", "dflash_train.train", "--recipe", str(RECIPE), f"output_dir={d / 'run'}",
             f"seed={seed}", "checkpoint_every=0", "eval.every=0", "overwrite=true", "log_every=1000",
             *ROWS[row]],
            d / "train.log", env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        # CPU seconds of the training process: on a shared machine, steadier than its wall time
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        (d / "train_cpu_s.json").write_text(json.dumps({"train_cpu_s": round(cpu, 1)}) + "\n")
        run([sys.executable, "-m", "dflash_train.cli.eval", "--drafter", str(d / "run" / "final"),
             "--budgets", ",".join(map(str, BUDGETS)), "--concurrency", "1", "--output", str(d / "eval"),
             "--overwrite", "--device", "cpu"], d / "eval.log", env)
    summary = json.loads((d / "run" / "summary.json").read_text())
    rep = json.loads(report.read_text())
    by = {(r["method"], r["budget"]): r for r in rep["results"]}
    chain = next(r for r in rep["results"] if r["method"] == "dflash")
    cpu = (json.loads((d / "train_cpu_s.json").read_text())["train_cpu_s"]
           if (d / "train_cpu_s.json").is_file() else None)
    return {"row": row, "seed": seed, "train_s": summary["wall_s"], "train_cpu_s": cpu,
            "steps": summary["steps"], "tau_chain": chain["tau"],
            **{f"tau_ddtree_{b}": by[("ddtree", b)]["tau"] for b in BUDGETS},
            "lossless": all(r["lossless"] for r in rep["results"]), "prompts": chain["prompts"]}


def table(results: list[dict]) -> str:
    lines = ["| row | overrides | train wall s (per seed) | train CPU s | tau chain (per seed) | mean | "
             "DDTree@64 (per seed) | mean | lossless |", "|---|---|---|---|---|---:|---|---:|:-:|"]
    for row in dict.fromkeys(r["row"] for r in results):
        rs = [r for r in results if r["row"] == row]
        fmt = lambda k, p=2: " / ".join(f"{r[k]:.{p}f}" for r in rs)  # noqa: E731
        cpu = " / ".join(f"{r['train_cpu_s']:.0f}" for r in rs if r["train_cpu_s"] is not None) or "-"
        lines.append(f"| {row} | `{' '.join(ROWS[row])}` | {fmt('train_s', 0)} | {cpu} | "
                     f"{fmt('tau_chain')} | {statistics.mean(r['tau_chain'] for r in rs):.2f} | "
                     f"{fmt('tau_ddtree_64')} | {statistics.mean(r['tau_ddtree_64'] for r in rs):.2f} | "
                     f"{'yes' if all(r['lossless'] for r in rs) else 'NO'} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--output", default="runs/tiny_schedule")
    p.add_argument("--table-only", action="store_true", help="tabulate the runs already done, start none")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "tiny_schedule.json"))
    args = p.parse_args()
    out = Path(args.output)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    results = []
    for seed in args.seeds:  # seed-major: a machine-load change lands on every row alike
        for row in args.rows:
            r = one(row, seed, out, env, train=not args.table_only)
            if r is None:
                continue
            results.append(r)
            print(f"{row} s{seed}: {r['train_s']:.0f}s, tau chain {r['tau_chain']:.3f}, DDTree@64 "
                  f"{r['tau_ddtree_64']:.3f} (lossless {r['lossless']})", flush=True)
    md = table(results)
    print(md)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    record = {"command": "python " + " ".join(sys.argv), "commit": commit,
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "threads": 1},
              "rows": ROWS, "results": results}
    (out / "schedule.json").write_text(json.dumps(record, indent=2) + "\n")
    Path(args.results).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
