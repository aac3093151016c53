"""Issue 44's goal, checked end to end: a fourth variant is one new file under model/variants/ plus its
registry entry. A copy of the package gets a small real variant (toy.py: a learned per-slot logit bias
read by training's loss and by the chain) and nothing else; a subprocess importing the copy trains it,
reloads it and decodes with it."""

import difflib
import filecmp
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT

# What a contributor writes: one file, following xpress.py / dspark.py.
TOY = '''\
"""Toy: the DFlash backbone plus a learned per-slot logit bias readout(slot_embed[k]) of rank toy_rank."""

import torch
from pydantic import BaseModel, Field
from torch import nn

from dflash_train.core.schema import Index
from dflash_train.model.variants.base import ChainDraft, Variant


class SlotBias(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, rank: int):
        super().__init__()
        self.slot_embed = nn.Parameter(torch.zeros(block_size - 1, rank))  # [K, r], 0: starts as DFlash
        self.readout = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.readout.weight, std=0.02)


class ToyModelKeys(BaseModel):
    toy_rank: int = Field(4, ge=1)  # the rank of the per-slot bias


class ToyDrafterKeys(BaseModel):
    toy_rank: Index = 0  # 0 for other variants


class Toy(Variant):
    name, display_name = "toy", "Toy"
    model_keys, drafter_keys = ToyModelKeys, ToyDrafterKeys
    draft_vocab = False  # the readout spans the whole vocabulary
    heads_outside_forward = True  # the readout is used inside the loss
    native_refusal = "the native DFlash format has no slot bias: export with --format speculators"

    def add_modules(self, drafter, config) -> None:
        drafter.slot_bias = SlotBias(config.vocab_size, config.block_size, config.toy_rank)

    def chain(self, drafter, hidden, base_logits, bonus, before=None) -> ChainDraft:
        head = drafter.slot_bias
        return ChainDraft((base_logits + head.readout(head.slot_embed).to(base_logits.dtype)).argmax(-1))

    def teacher_forced(self, drafter, block_hidden, block_tokens, before=None) -> dict:
        b, A = block_tokens.shape[:2]
        return {"u": drafter.slot_bias.slot_embed.expand(b, A, -1, -1)}  # [b, A, K, r]

    def logit_bias(self, model, heads):
        return heads["u"], model.slot_bias.readout.weight

    def drafter_fields(self, m, tc) -> dict:
        return {"variant": "toy", "toy_rank": m.toy_rank}

    def check(self, fields) -> None:
        if fields.toy_rank < 1:
            raise ValueError(f"a toy drafter needs toy_rank >= 1, got {fields.toy_rank}")
'''

RANK = 3  # not the recipe default, so the drafter's config must have carried it

# Runs in the subprocess, importing the copy: train, reload, decode.
SCRIPT = textwrap.dedent('''\
    import sys
    from pathlib import Path

    import torch
    import dflash_train
    from dflash_train.checkpoint.folders import load_drafter, read_weights
    from dflash_train.cli.train import main
    from dflash_train.data.dataset import stop_token_ids
    from dflash_train.decoding.decode import decode
    from dflash_train.model.target import load_target
    from dflash_train.model.variants import VARIANTS

    print("package", dflash_train.__file__)
    out, data, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    main([f"output_dir={out}", "max_steps=2", "model.num_layers=1", "train.batch_size=4",
          "data.num_anchors=8", "eval.max_samples=2", "eval.every=0", "checkpoint_every=0",
          f"data.train={data}/train.jsonl", f"data.val={data}/val.jsonl",
          "model.variant=toy", f"model.toy_rank={rank}"])

    drafter, _ = load_drafter(f"{out}/final")
    drafter.eval()
    print("config", drafter.config.variant, drafter.config.toy_rank, type(drafter.variant).__name__)
    saved = {k: v for k, v in read_weights(Path(out) / "final").items()
             if k.startswith("slot_bias.")}
    ours = {k: v for k, v in drafter.state_dict().items() if k.startswith("slot_bias.")}
    print("weights", sorted(ours), sorted(saved) == sorted(ours)
          and all(torch.equal(saved[k].float(), ours[k]) for k in ours))
    print("trained", bool(drafter.slot_bias.slot_embed.abs().sum() > 0))  # it starts at 0

    calls = []
    chain = VARIANTS["toy"].chain
    VARIANTS["toy"].chain = lambda *a, **k: calls.append(1) or chain(*a, **k)
    target = load_target("data/tiny-target")
    prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": "What is 23 + 59?"}],
                                                   add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)["input_ids"]
    stop = stop_token_ids(target.model, target.tokenizer)
    greedy = dict(temperature=0.0, max_new_tokens=24, stop_ids=stop)
    with torch.no_grad():
        toy = decode(target, drafter, prompt, method="dflash", **greedy)  # the variant's chain
        plain = decode(target, None, prompt, method="ar", **greedy)
    print("decode", len(calls) > 0, len(toy.tokens), toy.tokens == plain.tokens)
''')


def tree_diff(ours: Path, copy: Path) -> tuple[list[str], list[str], list[str]]:
    """(only in ours, only in the copy, differing files) as paths relative to the roots, __pycache__ aside."""
    left, right, differ = [], [], []

    def walk(c: filecmp.dircmp, rel: Path):
        left.extend(str(rel / n) for n in c.left_only)
        right.extend(str(rel / n) for n in c.right_only)
        differ.extend(str(rel / n) for n in c.diff_files)
        for name, sub in c.subdirs.items():
            walk(sub, rel / name)

    walk(filecmp.dircmp(ours, copy, ignore=["__pycache__"]), Path())
    return sorted(left), sorted(right), sorted(differ)


def test_a_new_variant_is_one_file_plus_its_registry_entry(tmp_path, small_data):
    package = tmp_path / "src" / "dflash_train"
    shutil.copytree(ROOT / "dflash_train", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "model" / "variants" / "toy.py").write_text(TOY)
    registry = package / "model" / "variants" / "__init__.py"
    text = registry.read_text()
    # the registry entry: the import, and the variant in VARIANTS
    anchor = "from dflash_train.model.variants.xpress import XPress\n"
    entry = '"xpress": XPress()}'
    assert text.count(anchor) == 1 and text.count(entry) == 1
    text = text.replace(anchor, anchor + "from dflash_train.model.variants.toy import Toy\n")
    registry.write_text(text.replace(entry, '"xpress": XPress(), "toy": Toy()}'))

    # the whole change: toy.py new, and in __init__.py one line added (the import) and one line changed
    only_ours, only_copy, differ = tree_diff(ROOT / "dflash_train", package)
    assert (only_ours, only_copy, differ) == ([], ["model/variants/toy.py"], ["model/variants/__init__.py"])
    before = (ROOT / "dflash_train/model/variants/__init__.py").read_text().splitlines()
    after = registry.read_text().splitlines()
    delta = [line for line in difflib.unified_diff(before, after, lineterm="", n=0)
             if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert [line[0] for line in delta] == ["+", "-", "+"], delta

    # a script file, not -c: -c puts the working directory (the checkout, whose dflash_train would shadow
    # the copy) first on sys.path; the working directory is the checkout for data/tiny-target
    script = tmp_path / "toy_run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(package.parent), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), str(small_data), str(RANK)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("package", "config", "weights", "trained", "decode"))
    assert lines["package"] == str(package / "__init__.py")  # the copy, not the checkout
    assert lines["config"] == f"toy {RANK} Toy"
    assert lines["weights"] == "['slot_bias.readout.weight', 'slot_bias.slot_embed'] True"
    assert lines["trained"] == "True"  # the loss's logit bias reached the zero-initialised slot_embed
    calls, n, same = lines["decode"].split()
    assert calls == "True" and int(n) > 0 and same == "True", lines["decode"]  # the toy chain, lossless


def test_a_variant_that_does_not_say_is_refused_by_the_native_format():
    """The native DFlash format holds the plain backbone only: a variant without its own native_refusal is
    refused there (rather than exported without its weights); plain DFlash is not; the four keep theirs."""
    from dflash_train.model.variants import VARIANTS
    from dflash_train.model.variants.base import Variant

    class Quiet(Variant):
        name, display_name = "quiet", "Quiet"

    assert Variant().native_refusal is None and VARIANTS["dflash"].native_refusal is None
    assert "export a Quiet drafter with --format speculators" in Quiet().native_refusal
    for name in ("dspark", "dflash2", "xpress"):
        assert VARIANTS[name].display_name in VARIANTS[name].native_refusal
