"""What tree distillation costs a training step on the real target: the DSpark recipe with and without
`tree_distill`, the same batches (same seed), alternated so machine load hits both alike.

    python benchmarks/tree_distill_cost.py      # after the real-target benchmark's cache stage

Each run trains `--steps` steps from the real-target benchmark's bf16 hidden-state cache; the step
time is the run's training time (train_tokens / train_tokens_per_s, so validation and start-up are
left out) over its steps. -> benchmarks/results/tree_distill_cost.json.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_target import DEFAULT_CACHE, ROOT, ROWS, TREE_ROWS, Bench, machine  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "tree_distill_cost.json"))
    args = p.parse_args()
    bench = Bench(Path(args.cache_dir), "full")
    base, extra = TREE_ROWS["dspark-treedistill"]
    settings = {"dspark": [], "dspark-treedistill": extra}
    times = {name: [] for name in settings}
    for rep in range(args.repeats):
        for name, overrides in settings.items():
            run = f"cost-{name}-{rep}"
            bench.train(run, ROWS[base], overrides + ["checkpoint_every=0", "eval.max_samples=1",
                                                      "eval.ddtree_budgets=[16]"], steps=args.steps)
            s = json.loads((bench.root / "runs" / run / "summary.json").read_text())
            times[name].append(round(s["train_tokens"] / s["train_tokens_per_s"] / s["steps"], 2))
    ratio = round(sum(times["dspark-treedistill"]) / sum(times["dspark"]), 2)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    result = {"command": "python " + " ".join(sys.argv), "commit": commit, "machine": machine(),
              "steps": args.steps, "tree_distill": extra, "s_per_step": times, "ratio": ratio}
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
