"""Train throughput and peak memory: our trainer vs speculators' own DFlash trainer, on this CPU.

    .venv/bin/python benchmarks/train_throughput.py [--steps 25] [--warmup 5] [--rows 600] [--threads 1]

Both train the same drafter (2 layers, block 8, taps = our z-lab ids [1, 5] = speculators'
aux ids [2, 6]) against the bundled tiny target (8 layers, hidden 128) on the same rows of
data/tiny/train.jsonl, tokenized once by `dflash_train.data.dataset.load_conversations`, in fp32,
with AdamW, CE to the target's greedy tokens (gamma 4), the same anchors and tokens per step:

  ours, offline      batch_size sequences x num_anchors anchors each, states read from a
                     float32 `dflash_train.data.hs_cache` built here (no target forward in the step)
  ours, online       the same, with the target forward inside the step
  speculators 0.9.0  one packed row of ~batch_size sequences (total_seq_len = batch_size x mean
                     length) and max_anchors = batch_size x num_anchors, states read from
                     hidden_states/hs_{i}.safetensors written here (taps + the last layer's
                     pre-norm output, from a target forward with a hook)

Train tokens: the sequence tokens (prompt + response, no padding) of each optimizer step:
ours counts `attention_mask.sum()` (its metrics.jsonl `tokens`), speculators
`document_ids != -1` (a forward pre-hook; its own profile counts the same). Tokens/s =
tokens of steps warmup+1..warmup+steps / time between the end of step `warmup` and the end
of the last step (end of a step = after the optimizer and scheduler step; ours: metrics.jsonl
`elapsed_s`, speculators: a clock read after its scheduler step). So the window holds data
fetch, forward, backward, clip, optimizer and per-step logging, and no start-up, warm-up,
validation or checkpointing.
Peak memory: each run is its own subprocess; the parent reaps it with os.wait4, whose
rusage is that one child's (ru_maxrss, max resident set size). It includes the libraries'
baseline, shown on two lines of their own (processes that only import ours' and speculators'
libraries).

speculators runs unmodified from a runner script written to a temp dir, with these patches
(all from the runner, none in the installed package): the trainer's device `0` (cuda:0)
becomes "cpu", `torch.accelerator.synchronize()` (its step timer) a no-op, and its
validation epoch (after the measured steps) is skipped. Flags: --draft-attn-impl sdpa (flex
attention has no CPU backward), --loss-implementation eager (the fused loss is Triton),
--num-workers 0, --on-missing raise, --hidden-states-dtype float32, --optimizer adamw,
--full-attention-indices 0 1 (its default is sliding-window layers; ours are full).
Output goes to stdout only; everything it writes lives in a temp dir removed at the end.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_train.data.dataset import load_conversations  # noqa: E402
from dflash_train.data.hs_cache import build_cache  # noqa: E402
from dflash_train.model.target import load_target, taps_from_hidden_states  # noqa: E402

TARGET = ROOT / "data" / "tiny-target"
OUR_TAPS = [1, 5]  # z-lab ids: decoder layer k = HF output_hidden_states[k + 1]
SPEC_TAPS = [k + 1 for k in OUR_TAPS]  # speculators aux ids: HF output_hidden_states[k]
BLOCK, DRAFT_LAYERS, LR, GAMMA, MAX_LEN = 8, 2, 3e-3, 4.0, 256
VAL_ROWS = 100  # speculators needs a non-empty validation split (never run here)

# Runs inside the speculators subprocess: redirect device 0 and the accelerator sync to the
# CPU, skip the validation epoch, and record the tokens and end time of every step.
SPEC_RUNNER = textwrap.dedent('''
    import json, logging, sys, time
    import torch

    torch.accelerator.synchronize = lambda *args, **kwargs: None  # its step timer; no accelerator here
    import speculators.train.trainer as trainer_mod
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    # Trainer moves the model and batches to local_rank (0 = cuda:0)
    trainer_mod.get_local_rank = lambda: "cpu"
    trainer_mod.Trainer.val_epoch = lambda self, epoch: None  # after the measured steps; not timed
    record = {"tokens": [], "step_end": [], "profile": []}

    init, schedulers_step = trainer_mod.Trainer.__init__, trainer_mod.Trainer._schedulers_step

    class Profiles(logging.Handler):  # its own per-step profile, for a cross-check
        def emit(self, rec):
            if isinstance(rec.msg, dict) and rec.msg.get("profile"):
                record["profile"].append(rec.msg["profile"])

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(Profiles())
        count = lambda m, a, kw: record["tokens"].append(int((kw["document_ids"] != -1).sum()))
        self.model.register_forward_pre_hook(count, with_kwargs=True)
        record["trainable_parameters"] = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        record["optimizers"] = [type(o).__name__ for o in self.optimizers]
        record["device"] = str(next(self.model.parameters()).device)

    def patched_schedulers_step(self):  # the last call of each optimizer step
        schedulers_step(self)
        record["step_end"].append(time.perf_counter())

    trainer_mod.Trainer.__init__ = patched_init
    trainer_mod.Trainer._schedulers_step = patched_schedulers_step
    out = sys.argv.pop(1)
    main(TrainConfig.resolve(sys.argv[1:]))
    with open(out, "w") as f:
        json.dump(record, f)
''')


def run_measured(cmd: list[str], log: Path, env: dict) -> tuple[int, float, float]:
    """Run cmd as a child process -> (exit code, wall seconds, its own peak RSS in MiB)."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(p.pid, 0)  # rusage of this child alone (ru_maxrss in KiB on Linux)
        p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, time.perf_counter() - t0, usage.ru_maxrss / 1024


def window(tokens: list[int], step_end: list[float], warmup: int) -> dict:
    """Throughput over the steps after `warmup`: tokens / (end of the last step - end of step `warmup`)."""
    n = len(step_end) - warmup
    tok, dt = sum(tokens[warmup:]), step_end[-1] - step_end[warmup - 1]
    durations = [b - a for a, b in zip(step_end[warmup - 1 :], step_end[warmup:])]
    return {"tps": tok / dt, "tok_step": tok / n, "s_step": dt / n, "s_median": statistics.median(durations)}


def tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@torch.no_grad()
def write_speculators_data(target, ds, out: Path, batch_size: int = 16) -> None:
    """Pre-tokenized rows (input_ids, loss_mask, seq_len; torch format) and one
    hidden_states/hs_{i}.safetensors per row: token_ids [T] int64 and hidden_states
    [T, taps + 1, H] = HF output_hidden_states[k] for k in SPEC_TAPS, then the last decoder
    layer's pre-norm output (HF's last hidden state is post-norm). Right-padded batches, as
    our cache is built."""
    from datasets import Dataset
    from safetensors.torch import save_file
    from speculators.data_generation.offline import check_hidden_states

    rows = ds["input_ids"]
    Dataset.from_dict({"input_ids": rows, "loss_mask": ds["loss_mask"],
                       "seq_len": [len(ids) for ids in rows]}).with_format("torch").save_to_disk(out)
    (out / "hidden_states").mkdir()
    model = target.model
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, args, output: captured.__setitem__("pre_norm",
                                                     output[0] if isinstance(output, tuple) else output))
    try:
        for lo in range(0, len(rows), batch_size):
            batch = rows[lo : lo + batch_size]
            T = max(len(ids) for ids in batch)
            ids = torch.zeros((len(batch), T), dtype=torch.long)
            attn = torch.zeros((len(batch), T), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, : len(r)], attn[i, : len(r)] = torch.tensor(r), 1
            o = model.model(input_ids=ids, attention_mask=attn, output_hidden_states=True, use_cache=False)
            pre = captured["pre_norm"]  # [b, T, H]
            # The hook must see the un-normed state: the final norm of it is HF's last hidden state.
            assert torch.allclose(model.model.norm(pre), o.last_hidden_state, atol=1e-5)
            hs = torch.stack([o.hidden_states[k] for k in SPEC_TAPS] + [pre], dim=2)  # [b, T, 3, H]
            for i, r in enumerate(batch):
                sample = {"token_ids": ids[i, : len(r)].clone(),
                          "hidden_states": hs[i, : len(r)].float().contiguous()}
                check_hidden_states(sample, r)
                save_file(sample, out / "hidden_states" / f"hs_{lo + i}.safetensors")
            if lo == 0:  # the taps are the ones our cache holds (z-lab id k = HF index k + 1)
                assert torch.equal(taps_from_hidden_states(o.hidden_states, OUR_TAPS),
                                   hs[:, :, :-1].flatten(2))
    finally:
        hook.remove()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=25, help="measured optimizer steps per trainer")
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps before the measured window (>= 1)")
    p.add_argument("--rows", type=int, default=600,
                   help="training conversations (from data/tiny/train.jsonl)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="sequences per step (ours); speculators packs about as many tokens into one row")
    p.add_argument("--anchors", type=int, default=32,
                   help="anchors per sequence (speculators: x batch size per row)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads of every run (OMP_NUM_THREADS); on a few shared "
                        "cores a parallel op waits for a descheduled worker, so 1 thread measures the "
                        "trainers, not the neighbours")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true",
                   help="keep the temp dir (logs, data, outputs) and print its path")
    args = p.parse_args()
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("--warmup and --steps must be >= 1 (the window starts at the end of a step)")
    torch.set_num_threads(args.threads)
    total_steps = args.warmup + args.steps
    py = sys.executable
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    tmp = Path(tempfile.mkdtemp(prefix="train_throughput_"))
    try:
        # --- identical tokens for both trainers ----------------------------------------------
        t0 = time.perf_counter()
        target = load_target(str(TARGET))
        # ours resolves model.mask_token the same way
        mask_id = target.tokenizer.convert_tokens_to_ids("<|MASK|>")
        train_jsonl, val_jsonl = tmp / "train.jsonl", tmp / "val.jsonl"
        with open(ROOT / "data" / "tiny" / "train.jsonl") as src:
            train_jsonl.write_text("".join(line for _, line in zip(range(args.rows), src)))
        with open(ROOT / "data" / "tiny" / "val.jsonl") as src:
            val_jsonl.write_text("".join(line for _, line in zip(range(VAL_ROWS), src)))
        train_ds = load_conversations(str(train_jsonl), target.tokenizer, MAX_LEN)
        val_ds = load_conversations(str(val_jsonl), target.tokenizer, MAX_LEN)
        if len(train_ds) < total_steps * args.batch_size:
            raise SystemExit(f"--rows {args.rows} gives {len(train_ds)} conversations, fewer than "
                             f"{total_steps} steps x {args.batch_size} (one epoch must cover the run)")
        mean_len = statistics.mean(len(ids) for ids in train_ds["input_ids"])
        total_seq_len = round(args.batch_size * mean_len)  # speculators' packed row ~ our tokens per step

        # --- precomputed states: our float32 cache, speculators' hs files ---------------------
        cache = tmp / "cache"
        build_cache(target, train_ds, OUR_TAPS, cache, "float32", shard_rows=256, batch_size=16)
        from datasets import concatenate_datasets

        spec_ds = concatenate_datasets([train_ds, val_ds])  # train split = the first len(train_ds) rows
        spec_data, spec_error = tmp / "spec_data", None
        train_ratio = len(train_ds) / len(spec_ds)
        assert int(len(spec_ds) * train_ratio) == len(train_ds)  # speculators' own split rule
        try:
            write_speculators_data(target, spec_ds, spec_data)
        except Exception as e:  # report it and still measure ours
            spec_error = f"preparing its data failed: {type(e).__name__}: {e}"
        prep_s = time.perf_counter() - t0
        del target

        # --- the runs ----------------------------------------------------------------------
        ours_common = [py, "-m", "dflash_train.train", "--recipe", "recipes/tiny.yaml",
                       f"max_steps={total_steps}", "checkpoint_every=0", "eval.every=0",
                       "eval.max_samples=16", f"data.train={train_jsonl}", f"data.num_anchors={args.anchors}",
                       f"model.block_size={BLOCK}", f"model.num_layers={DRAFT_LAYERS}",
                       f"model.target_layer_ids={OUR_TAPS}", f"train.batch_size={args.batch_size}",
                       "train.grad_accum=1", f"train.lr={LR}", "train.weight_decay=0.0",
                       "train.clip_grad=1.0", "train.precision=fp32", "loss.terms={ce: 1.0}",
                       "loss.position_weight=exp", "loss.ce_labels=target", f"loss.gamma={GAMMA}",
                       f"seed={args.seed}", "log_every=1000", "overwrite=true"]
        ours = {"ours, offline (fp32 cache)": (tmp / "ours_offline", [f"data.hidden_state_cache={cache}"]),
                "ours, online (target in step)": (tmp / "ours_online", [])}
        runs = {name: ours_common + [f"output_dir={out}", *extra] for name, (out, extra) in ours.items()}
        spec_name, spec_record, runner = ("speculators 0.9.0, offline", tmp / "spec_record.json",
                                          tmp / "spec_runner.py")
        runner.write_text(SPEC_RUNNER)
        runs[spec_name] = [
            py, str(runner), str(spec_record), "--speculator-type", "dflash", "--verifier-name-or-path",
            str(TARGET), "--data-path", str(spec_data), "--train-data-ratio", repr(train_ratio),
            "--total-seq-len", str(total_seq_len), "--max-anchors", str(args.batch_size * args.anchors),
            "--block-size", str(BLOCK), "--num-layers", str(DRAFT_LAYERS), "--draft-arch", "qwen3",
            "--target-layer-ids", *map(str, SPEC_TAPS), "--full-attention-indices",
            *map(str, range(DRAFT_LAYERS)), "--draft-attn-impl", "sdpa", "--mask-token-id", str(mask_id),
            "--loss-fn", "ce", "--loss-implementation", "eager", "--dflash-decay-gamma", str(GAMMA),
            "--hidden-states-dtype", "float32", "--num-workers", "0", "--on-missing", "raise", "--optimizer",
            "adamw", "--lr", str(LR), "--weight-decay", "0.0", "--scheduler-type", "cosine", "--max-steps",
            str(total_steps), "--epochs", "1", "--log-freq", "1", "--save-path", str(tmp / "spec_out"),
            "--log-dir", str(tmp / "spec_logs"), "--seed", str(args.seed), "--no-resume-from-checkpoint"]
        baselines = {"(import torch, transformers, ...)": "import torch, transformers, accelerate, datasets",
                     "(import speculators.train.cli)": "import speculators.train.cli"}

        results = {}
        for name, cmd in [*((n, [py, "-c", code]) for n, code in baselines.items()), *runs.items()]:
            if name == spec_name and spec_error:
                results[name] = {"error": spec_error}
                continue
            log = tmp / f"{len(results)}.log"
            rc, wall, rss = run_measured(cmd, log, env)
            results[name] = {"wall": wall, "rss": rss, "error": f"exit {rc}:\n{tail(log)}" if rc else None}

        spec_profile = None
        for name in runs:
            r = results[name]
            if r["error"]:
                continue
            if name in ours:
                out = ours[name][0]
                recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                tokens = [rec["tokens"] - prev for rec, prev in zip(recs, [0]
                                                                    + [rec["tokens"] for rec in recs])]
                step_end = [rec["elapsed_s"] for rec in recs]
                r["params"] = json.loads((out / "summary.json").read_text())["drafter_parameters"]
                r["optimizer"] = "AdamW"  # training/trainer.py builds torch.optim.AdamW
            else:
                rec = json.loads(spec_record.read_text())
                tokens, step_end, spec_profile = rec["tokens"], rec["step_end"], rec["profile"][args.warmup :]
                r["params"], r["optimizer"] = rec["trainable_parameters"], "+".join(rec["optimizers"])
            assert len(tokens) == len(step_end) == total_steps, f"{name} ran {len(step_end)} steps"
            r.update(window(tokens, step_end, args.warmup))

        # --- report -------------------------------------------------------------------------
        print(f"\nDFlash training throughput, tiny target (8 layers, hidden 128, vocab 1024), drafter "
              f"{DRAFT_LAYERS} layers, block {BLOCK}, taps z-lab {OUR_TAPS} = speculators "
              f"{SPEC_TAPS}; fp32 on CPU ({args.threads} torch thread(s) per run, {os.cpu_count()} cores)")
        print(f"{len(train_ds)} conversations (mean {mean_len:.1f} tokens); per step: ours {args.batch_size} "
              f"sequences x {args.anchors} anchors, speculators one packed row of {total_seq_len} tokens x "
              f"{args.batch_size * args.anchors} anchors; {args.warmup} warm-up + "
              f"{args.steps} measured steps; data prep {prep_s:.0f}s\n")
        head = (f"{'trainer':<34} {'params':>8} {'optimizer':>9} {'tok/step':>8} {'s/step':>7} {'median':>7} "
                f"{'tokens/s':>8} {'peak RSS MiB':>12} {'wall s':>6}")
        print(head)
        print("-" * len(head))
        for name in runs:
            r = results[name]
            if r["error"]:
                print(f"{name:<34} FAILED, {r['error']}")
                continue
            print(f"{name:<34} {r['params']:>8,} {r['optimizer']:>9} {r['tok_step']:>8.0f} "
                  f"{r['s_step']:>7.3f} {r['s_median']:>7.3f} {r['tps']:>8.0f} "
                  f"{r['rss']:>12.0f} {r['wall']:>6.0f}")
        for name in baselines:
            r = results[name]
            print(f"{name:<34} {'':>8} {'':>9} {'':>8} {'':>7} {'':>7} {'':>8} "
                  f"{r['rss']:>12.0f} {r['wall']:>6.0f}")
        print("s/step: mean over the measured steps (tokens/s = their tokens / their time); median: per-step "
              "median; wall: the whole subprocess")
        if spec_profile:
            median_tps = statistics.median(p["tokens_per_s"] for p in spec_profile)
            mean_ms = {k: statistics.mean(p[k] for p in spec_profile) for k in ["fwd_ms", "bwd_ms", "opt_ms"]}
            print(f"speculators' own step profile, same steps: median {median_tps:.0f} "
                  f"tokens/s; mean forward {mean_ms['fwd_ms']:.0f} ms, backward {mean_ms['bwd_ms']:.0f} ms, "
                  f"optimizer {mean_ms['opt_ms']:.0f} ms")
        spec = results[spec_name]
        if not spec["error"]:
            print("\nratio ours / speculators:")
            for name in ours:
                r = results[name]
                if not r["error"]:
                    print(f"  {name:<32} tokens/s x{r['tps'] / spec['tps']:.2f}, "
                          f"peak RSS x{r['rss'] / spec['rss']:.2f}")
    finally:
        if args.keep:
            print(f"\nkept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
