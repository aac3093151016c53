"""One short draft-vocabulary training run on the small data, shared by the draft-vocabulary tests of
tests/training, tests/decoding and tests/export (trained once per pytest session, ~12 s: 40 steps of a
1-layer drafter with a 128-token draft vocabulary, checkpoints at 20 and 40)."""

from collections import Counter
from pathlib import Path

from conftest import TINY_TARGET, run_main

DRAFT_VOCAB = 128
_RUN: dict = {}


def run_args(out: Path, small_data: Path, *extra) -> list[str]:
    return [f"output_dir={out}", "seed=3", "max_steps=40", "checkpoint_every=20", "log_every=5",
            "eval.every=0", "eval.max_samples=8", f"model.draft_vocab_size={DRAFT_VOCAB}",
            "model.num_layers=1", "train.batch_size=8", "data.num_anchors=16", "train.lr=3e-3",
            f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}", *extra]


def draft_vocab_run(tmp_path_factory, small_data) -> tuple[Path, str]:
    """-> (the run's output_dir, what it printed)."""
    if "out" not in _RUN:
        from dflash_train.cli.train import main

        out = tmp_path_factory.mktemp("draft-vocab") / "run"
        code, stdout, stderr = run_main(main, run_args(out, small_data))
        assert code == 0, stderr[-3000:]
        _RUN.update(out=out, stdout=stdout)
    return _RUN["out"], _RUN["stdout"]


def reference_vocab(small_data: Path, size: int, split: str = "train") -> tuple[list[int], Counter]:
    """The draft vocabulary recomputed from the data, independently of model/vocab.py: the `size` target
    ids most often supervised in data.train (ties by id, speculators' rule), the stop tokens (the
    tokenizer's EOS and the target's generation EOS) always among them, ids 0.. padding a short list.
    -> (kept ids ascending, supervised counts)."""
    from transformers import AutoTokenizer, GenerationConfig

    from dflash_train.data.dataset import load_conversations

    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    # recipes/tiny.yaml's data.max_length
    ds = load_conversations(str(small_data / f"{split}.jsonl"), tok, 256)
    counts = Counter()
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        for t, m in zip(ids, mask):
            if m:
                counts[t] += 1
    eos = GenerationConfig.from_pretrained(TINY_TARGET).eos_token_id
    stops = {tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    kept = set(stops)
    for t in sorted(counts, key=lambda t: (-counts[t], t)):
        if len(kept) >= size:
            break
        kept.add(t)
    pad = 0
    while len(kept) < size:
        if pad not in kept:
            kept.add(pad)
        pad += 1
    return sorted(kept), counts


def assert_lossless_in_draft_vocab(tiny_target, drafter, method: str, budget: int, questions,
                                   monkeypatch) -> None:
    """Decoding with a draft-vocabulary drafter gives plain decoding's tokens, and every tree it verifies
    holds draft-vocabulary tokens with finite scores (trees spied on at decode.verify)."""
    import torch

    import dflash_train.decoding.decode as decode_module
    from conftest import chat_prompt
    from dflash_train.data.dataset import stop_token_ids

    trees, real = [], decode_module.verify
    monkeypatch.setattr(decode_module, "verify", lambda target, cache, tree, *a: trees.append(tree)
                        or real(target, cache, tree, *a))
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)
    for q in questions:
        ids = chat_prompt(tiny_target.tokenizer, q)
        ar = decode_module.decode(tiny_target, None, ids, "ar", max_new_tokens=40, stop_ids=stops)
        trees.clear()
        r = decode_module.decode(tiny_target, drafter, ids, method, budget, max_new_tokens=40, stop_ids=stops)
        assert r.tokens == ar.tokens, q
        for tree in trees:
            assert bool(drafter.t2d[tree.tokens].all()) and bool(torch.isfinite(tree.log_probs).all())
