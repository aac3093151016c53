"""Tree distillation (dflash_train/training/tree_distill.py): the distribution it trains at each node is the
one the decoder's tree scores that node's children with (every variant, every DSpark head); its gradients
reach the conditional head and nothing else (not the frozen target, not the backbone); a few steps on it move
the drafter toward the target at the nodes; training runs with it and reports it; an older run (no
tree_distill section) still resumes. Its labels are exact: the target's logits at every node of trees packed
behind a sequence (one forward, ancestor-only mask) equal a separate target forward over the sequence up
to the anchor followed by the node's root-to-node path."""

import json
import math

import pytest
import torch

from dflash_train.data.dataset import collate, load_conversations
from dflash_train.decoding.ddtree import build_tree
from dflash_train.model.drafter import DFlashDrafter
from dflash_train.model.target import load_target
from dflash_train.model.variants.dflash2 import SelectorScorer
from dflash_train.model.variants.dspark import MarkovScorer
from dflash_train.training.blocks import anchored_blocks, draw_anchors
from dflash_train.training.build import drafter_config_for
from dflash_train.training.config import ModelConfig, load_recipe
from dflash_train.training.tree_distill import (node_log_probs, packed_trees, pick_blocks,
                                                tree_distillation_loss, tree_target_logits)

B = 5
VARIANTS = {"dflash": {}, "dspark-vanilla": {"markov_head_type": "vanilla"},
            "dspark-gated": {"markov_head_type": "gated"}, "dspark-rnn": {"markov_head_type": "rnn"},
            "dflash2": {"selector_top_k": 6}}


def random_drafter(target, name: str, seed: int = 0, std: float = 0.2) -> DFlashDrafter:
    variant = name.split("-")[0]
    kw = VARIANTS[name] | ({"markov_rank": 8} if variant == "dspark" else {}) | (
        {"selector_rank": 8} if variant == "dflash2" else {})
    torch.manual_seed(seed)
    drafter = DFlashDrafter(drafter_config_for(target, ModelConfig(num_layers=1, block_size=B,
                                                                   variant=variant, **kw)))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, std if p.ndim > 1 else 1.0)
    return drafter.eval()


def scorer_for(drafter, hidden, bonus):
    if drafter.markov_head is not None:
        # exact: the bias on every token
        return MarkovScorer(drafter.markov_head, hidden, bonus, candidates=10**9)
    if drafter.candidate_selector is not None:
        return SelectorScorer(drafter.candidate_selector, hidden, bonus)
    return None


@pytest.mark.parametrize("name", list(VARIANTS))
def test_node_distributions_are_the_ones_the_tree_scores_children_with(tiny_target, name):
    drafter = random_drafter(tiny_target, name)
    H = drafter.config.hidden_size
    g = torch.Generator().manual_seed(1)
    hidden, bonus = torch.randn(B, H, generator=g) * 3, 17
    head = tiny_target.lm_head
    with torch.no_grad():
        unary = head(hidden[1:])
        tree = build_tree(unary, 24, scorer_for(drafter, hidden, bonus))
        rows, support, logq = node_log_probs(drafter, head, hidden, tree, bonus)
    depths = [0] + tree.depths.tolist()
    # the root and every non-leaf depth
    assert rows.tolist() == [i for i, d in enumerate(depths) if d < B - 1]
    at = {int(r): k for k, r in enumerate(rows)}
    lp = [0.0] + tree.log_probs.tolist()
    edges = 0
    for child in range(1, tree.size + 1):
        parent, token = int(tree.parents[child]), int(tree.tokens[child - 1])
        stated = lp[child] - lp[parent]  # the tree's log-prob of this child given its parent
        k = at[parent]
        if support is None:
            got = float(logq[k, token])
        else:  # DFlash2: the K-way softmax; the tree adds the unary mass of slot d+1's candidates
            d = depths[parent]
            assert (set(support[k].tolist())
                    == set(unary[d].topk(drafter.candidate_selector.top_k).indices.tolist()))
            got = float(logq[k, support[k].tolist().index(token)]
                        + torch.logsumexp(unary[d, support[k]], 0) - torch.logsumexp(unary[d], 0))
        assert math.isclose(got, stated, abs_tol=2e-4), (child, got, stated)
        edges += 1
    assert edges == tree.size
    if name.startswith("dspark"):  # the conditional scores differ between siblings' children
        parents_at_1 = [i for i in range(1, tree.size + 1) if depths[i] == 1 and i in at]
        assert len(parents_at_1) >= 2
        assert not torch.allclose(logq[at[parents_at_1[0]]], logq[at[parents_at_1[1]]])


@pytest.fixture(scope="module")
def batch(tiny_target, small_data):
    ds = load_conversations(str(small_data / "train.jsonl"), tiny_target.tokenizer, 128)
    return collate([ds[i] | {"row": i} for i in range(2)], tiny_target.tokenizer.pad_token_id)


def distil(drafter, target, batch, step=0, budget=12, anchors=3):
    """The training step's tree term on the batch, as trainer.distilled_trees computes it."""
    from dflash_train.training.validate import cpu_tree_scorer

    a, ok = draw_anchors(batch, 8, seed=0, step=step)
    o = anchored_blocks(drafter, target, batch, a, ok, drafter.config.target_layer_ids, B,
                        drafter.config.mask_token_id)
    row, blocks = pick_blocks(o.valid, anchors, step)
    assert row >= 0 and len(blocks) == anchors
    n = int(batch.attention_mask[row].sum())
    return tree_distillation_loss(drafter, target, batch.input_ids[row, :n], o.block_hidden[row, blocks],
                                  a[row, blocks].tolist(), budget, cpu_tree_scorer(drafter))


@pytest.mark.parametrize("name", ["dspark-rnn", "dflash2"])
def test_gradients_reach_the_drafter_only(tiny_target, batch, name):
    drafter = random_drafter(tiny_target, name, std=0.05).train()
    before = {k: v.clone() for k, v in tiny_target.model.state_dict().items()}
    kl, counts = distil(drafter, tiny_target, batch)
    assert kl.item() > 0 and counts["nodes"] >= 3
    kl.backward()
    assert all(p.grad is None for p in tiny_target.model.parameters())  # the frozen target: no gradient...
    for k, v in tiny_target.model.state_dict().items():  # ...and untouched
        assert torch.equal(v, before[k]), k
    grads = {n: p.grad for n, p in drafter.named_parameters()}
    head = "candidate_selector." if name == "dflash2" else "markov_head."
    # backbone, confidence head: none
    assert all(g is None for n, g in grads.items() if not n.startswith(head))
    if name == "dflash2":
        sel = grads["candidate_selector.successor_codebook"]
        used = sel.abs().sum(-1) > 0
        assert 0 < int(used.sum()) < sel.shape[0]  # only the candidates' rows
        assert grads["candidate_selector.predecessor_codebook"].abs().sum() > 0
    else:
        w1 = grads["markov_head.markov_w1.weight"]
        assert 0 < int((w1.abs().sum(-1) > 0).sum()) < w1.shape[0]  # only the rows of tokens in the trees
        assert grads["markov_head.markov_w2.weight"].abs().sum() > 0
        assert grads["markov_head.joint_proj.weight"].abs().sum() > 0


def test_a_few_steps_move_the_drafter_toward_the_target_at_the_nodes(tiny_target, batch):
    drafter = random_drafter(tiny_target, "dspark-vanilla", std=0.05).train()
    opt = torch.optim.Adam(drafter.parameters(), lr=5e-2)
    first = None
    for _ in range(30):
        kl, counts = distil(drafter, tiny_target, batch)
        first = first or (kl.item(), counts["agree"] / counts["nodes"])
        opt.zero_grad()
        kl.backward()
        opt.step()
    with torch.no_grad():
        kl, counts = distil(drafter, tiny_target, batch)
    assert kl.item() < 0.5 * first[0], (first, kl.item(), counts)
    assert counts["agree"] / counts["nodes"] > first[1]


def test_training_with_tree_distillation_reports_it_and_names_its_budget(tmp_path, small_data):
    """Train (tree-distilled, chosen for budget 8), then the card and dflash-eval say what it was trained
    for."""
    from dflash_train.core.errors import UserError
    from dflash_train.cli.eval import main as eval_main
    from dflash_train.cli.export import main as export_main
    from dflash_train.cli.train import main as train_main

    out = tmp_path / "run"
    train_main([f"output_dir={out}", "max_steps=4", "model.variant=dspark", "model.markov_rank=16",
                f"data.train={small_data / 'train.jsonl'}", f"data.val={small_data / 'val.jsonl'}",
                "train.batch_size=4", "eval.max_samples=4", "eval.ddtree_budgets=[4, 8]",
                "eval.deploy_budget=8", "eval.every=1", "checkpoint_every=1", "tree_distill.weight=1.0",
                "tree_distill.budget=8", "tree_distill.every=2", "log_every=1"])
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:  # every 2nd step distils (step counts from 1 in the records)
        distilled = r["step"] % 2 == 0
        assert (r["terms"]["tree"] > 0) == distilled and ("tree_agree" in r) == distilled
    # the choice: the validated drafter with the best held-out tree tau at the deploy budget (later on ties)
    import shutil
    shutil.rmtree(out / "checkpoints" / "step_000001")  # a checkpoint no longer on disk cannot be chosen
    from dflash_train.training.config import load_recipe as recipe
    from dflash_train.training.resume import choose_checkpoint
    chosen = choose_checkpoint(out, recipe(str(out / "final" / "recipe.yaml")))
    taus = {r["step"]: r["val_ddtree_tau"]["8"] for r in steps if r["step"] > 1}
    best = max(taus, key=lambda s: (taus[s], s))
    assert chosen["step"] == best and chosen["budget"] == 8 and chosen["value"] == taus[best]
    assert set(chosen["validated"]) == {"2", "3", "4"}
    summary = json.loads((out / "summary.json").read_text())["chosen"]
    assert summary["budget"] == 8 and set(summary["validated"]) == {"1", "2", "3", "4"}

    export_main(["--format", "speculators", "--checkpoint", str(out / "final"), "--output",
                 str(tmp_path / "spec")])
    card = (tmp_path / "spec" / "README.md").read_text()
    # the count from the run's metrics.jsonl (steps 2 and 4 distilled), not the recipe's promise
    assert ("Trained for its tree: 2 of its 4 steps distilled trees (metrics.jsonl), every 2 step(s), "
            "2 blocks' own 8-node trees") in card
    assert "Chosen for DDTree budget **8** by held-out teacher-forced tree tau (step 1: " in card
    eval_main(["--drafter", str(tmp_path / "spec"), "--limit", "1", "--budgets", "8", "--max-new-tokens", "8",
               "--output", str(tmp_path / "eval")])
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert (report["trained_for"]["deploy_budget"] == 8
            and report["trained_for"]["tree_distill"]["budget"] == 8)
    # chain and path-conditioned tree = plain decoding
    assert all(r["lossless"] is True for r in report["results"])
    # the export carries the recipe, not the run's metrics: the eval does not claim what it cannot count
    text = (tmp_path / "eval" / "report.md").read_text()
    assert ("Drafter trained and chosen for DDTree budget 8; its recipe asks for tree distillation (2 "
            "blocks' 8-node trees every 2 step(s), weight 1.0), how many steps distilled is not "
            "recorded") in text
    assert report["trained_for"]["distilled"] is None
    with pytest.raises(UserError, match="eval.deploy_budget 32 is not among eval.ddtree_budgets"):
        load_recipe(None, ["eval.deploy_budget=32"])
    with pytest.raises(UserError, match="tree_distill.budget"):
        load_recipe(None, ["tree_distill.budget=0"])
    for variant in (["model.variant=dflash"], ["model.variant=dspark", "model.markov_rank=0"]):
        with pytest.raises(UserError, match=r"^recipe '.*': tree_distill trains a conditional "
                                            r"head .* has none$"):
            load_recipe(None, ["tree_distill.weight=1", *variant])


def test_a_run_saved_before_tree_distillation_existed_still_resumes(tmp_path):
    from dflash_train.core.errors import UserError
    from dflash_train.training.resume import check_same_recipe

    cfg = load_recipe(None, ["model.variant=dspark"])
    saved = cfg.model_dump(mode="json")
    del saved["tree_distill"]
    check_same_recipe(saved, cfg, tmp_path, "x")  # the added section at its defaults: the same recipe
    with pytest.raises(UserError, match="tree_distill.weight"):
        check_same_recipe(saved, load_recipe(None, ["model.variant=dspark", "tree_distill.weight=1"]),
                          tmp_path, "x")


def node_paths(tree):
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (tokens[i - 1],))
    return paths  # the root's () first


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tree_logits_equal_separate_path_forwards(arch, qwen3_random_target_dir, llama_target_dir):
    target = load_target(str(qwen3_random_target_dir if arch == "qwen3" else llama_target_dir))
    V = target.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (24,), generator=g)
    anchors = [3, 11, 23]  # the last: a tree after the whole sequence
    trees = [build_tree(torch.randn(4, V, generator=g), budget) for budget in (6, 12, 9)]
    got = tree_target_logits(target.model, ids, anchors, trees)
    for a, tree, logits in zip(anchors, trees, got):
        assert logits.shape == (tree.size + 1, V)
        for row, path in enumerate(node_paths(tree)):
            seq = torch.cat([ids[: a + 1], torch.tensor(path, dtype=torch.long)])[None]
            with torch.no_grad():
                ref = target.model(input_ids=seq).logits[0, -1]
            torch.testing.assert_close(logits[row], ref, rtol=1e-4, atol=1e-4)


def test_packing_keeps_the_sequence_causal_and_trees_apart():
    ids = torch.arange(10)
    trees = [build_tree(torch.randn(3, 20), 5), build_tree(torch.randn(3, 20), 4)]
    tokens, positions, visible, rows = packed_trees(ids, [2, 7], trees)
    T = 10
    assert (torch.equal(visible[:T, :T], torch.ones(T, T, dtype=torch.bool).tril())
            and not visible[:T, T:].any())
    first, second = rows[0][1:], rows[1][1:]
    assert not visible[first][:, second].any() and not visible[second][:, first].any()
    assert (not visible[first][:, 3:T].any() and visible[second][:, :8].all()
            and not visible[second][:, 8:T].any())
    assert positions[first].tolist() == (2 + trees[0].depths).tolist()
    with pytest.raises(ValueError, match="outside the sequence"):
        packed_trees(ids, [10], trees[:1])
