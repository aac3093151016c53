"""model.markov_w1_embed (dflash_train/model/variants/markov_embed.py): DSpark's W1 trained as table + Ê P
with P folded into the table each step. Folding is exact: the table follows the unfolded parametrisation's
W1 step for step (an independent reference: T + Ê P as two ordinary parameters under AdamW); a token never
seen as a predecessor gets a trained row (a plain table leaves it at its initial value); a run with it
resumes exactly, saves a plain DSpark head that every loader reads, and decodes losslessly."""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from dflash_train.model.variants.dspark import MarkovHead
from dflash_train.model.variants.markov_embed import SharedW1

V, H, R = 40, 12, 6


def toy_loss(w1: torch.Tensor, w2: torch.nn.Linear, prev: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The Markov bias alone as logits: CE of W2(W1[prev]) against labels."""
    return F.cross_entropy(w2(F.embedding(prev, w1)), labels)


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * step / 20))


def batches(n: int, seen: int):
    """Predecessors drawn from the first `seen` tokens only: the rest never precede anything."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, seen, (32,), generator=g), torch.randint(0, V, (32,), generator=g))
            for _ in range(n)]


def test_folding_follows_the_unfolded_parametrisation_and_trains_unseen_rows():
    torch.manual_seed(0)
    head = MarkovHead(V, R, H, "vanilla")
    embed = torch.randn(V, H)
    init = head.markov_w1.weight.detach().clone()
    ref_t = torch.nn.Parameter(init.clone())  # the reference: W1 = T + Ê P, both ordinary parameters
    ref_p = torch.nn.Parameter(torch.zeros(H, R))
    ref_w2 = torch.nn.Linear(R, V, bias=False)
    ref_w2.load_state_dict(head.markov_w2.state_dict())
    basis = embed / embed.norm(dim=1).mean()
    lr, betas = 1e-2, (0.9, 0.95)
    ref_opt = torch.optim.AdamW([{"params": [ref_t, ref_w2.weight]},
                                 {"params": [ref_p], "lr": lr / math.sqrt(H)}],
                                lr=lr, betas=betas, weight_decay=0.0)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=betas, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    shared = SharedW1(head, embed, lr, betas, schedule)
    plain = MarkovHead(V, R, H, "vanilla")  # the table alone, for the unseen rows
    plain.load_state_dict(head.state_dict())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=lr, betas=betas, weight_decay=0.0)
    for prev, labels in batches(12, seen=10):
        toy_loss(head.markov_w1.weight, head.markov_w2, prev, labels).backward()
        opt.step(), sched.step(), shared.step(), opt.zero_grad()
        toy_loss(ref_t + basis @ ref_p, ref_w2, prev, labels).backward()
        ref_opt.step(), ref_sched.step(), ref_opt.zero_grad()
        toy_loss(plain.markov_w1.weight, plain.markov_w2, prev, labels).backward()
        plain_opt.step(), plain_opt.zero_grad()
        assert shared.proj.abs().max() == 0  # folded: the drafter holds all of W1
    torch.testing.assert_close(head.markov_w1.weight, (ref_t + basis @ ref_p).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.markov_w2.weight, ref_w2.weight.detach(), rtol=1e-5, atol=1e-6)
    unseen = slice(10, V)
    assert torch.equal(plain.markov_w1.weight[unseen], init[unseen])  # no gradient, no step
    moved = (head.markov_w1.weight[unseen] - init[unseen]).norm(dim=1)
    assert (moved > 1e-3).all()  # every unseen token's row learned from the tokens like it (init std 0.01)
    # ... by the embedding path: the change is Ê[x] P_total, P_total the reference's accumulated P
    torch.testing.assert_close(head.markov_w1.weight[unseen] - init[unseen], (basis @ ref_p).detach()[unseen],
                               rtol=1e-4, atol=1e-6)


def test_its_state_resumes_the_same_steps():
    torch.manual_seed(0)
    heads = [MarkovHead(V, R, H, "vanilla") for _ in range(2)]
    heads[1].load_state_dict(heads[0].state_dict())
    embed = torch.randn(V, H)
    opts = [torch.optim.AdamW(h.parameters(), lr=1e-2) for h in heads]
    shared = [SharedW1(h, embed, 1e-2, (0.9, 0.999), schedule) for h in heads]
    data = batches(6, seen=10)
    for i, (prev, labels) in enumerate(data):
        for k in range(2):
            if k == 1 and i == 3:  # the second one "resumes" from a state dict at step 3
                state = shared[1].state_dict()
                shared[1] = SharedW1(heads[1], embed, 1e-2, (0.9, 0.999), schedule)
                shared[1].load_state_dict(state)
            toy_loss(heads[k].markov_w1.weight, heads[k].markov_w2, prev, labels).backward()
            opts[k].step(), shared[k].step(), opts[k].zero_grad()
    assert torch.equal(heads[0].markov_w1.weight, heads[1].markov_w1.weight)


def run(tmp_path, small_data, name, *extra):
    from dflash_train.cli.train import main as train_main

    out = tmp_path / name
    train_main([f"output_dir={out}", "max_steps=4", "model.variant=dspark", "model.markov_rank=16",
                "model.markov_w1_embed=true", f"data.train={small_data / 'train.jsonl'}",
                f"data.val={small_data / 'val.jsonl'}", "train.batch_size=4", "eval.max_samples=4",
                "eval.ddtree_budgets=[8]", "checkpoint_every=2", "log_every=1", *extra])
    return out


def test_a_run_resumes_exactly_saves_a_plain_dspark_head_and_decodes_losslessly(tmp_path, small_data):
    from dflash_train.checkpoint.folders import load_checkpoint, load_drafter
    from dflash_train.cli.eval import main as eval_main
    from dflash_train.cli.export import main as export_main

    full = run(tmp_path, small_data, "full")
    cut = tmp_path / "cut"  # the same run stopped after its step-2 checkpoint
    shutil.copytree(full, cut)
    for p in [cut / "final", cut / "checkpoints" / "step_000004"]:
        shutil.rmtree(p, ignore_errors=True)
    (cut / "summary.json").unlink()
    # P's moments
    assert load_checkpoint(cut / "checkpoints" / "step_000002")[1]["markov_embed"]["opt"]["state"]
    run(tmp_path, small_data, "cut")
    assert "resumed_from_step" in json.loads((cut / "summary.json").read_text())
    a, b = load_drafter(full / "final")[0], load_drafter(cut / "final")[0]
    for k, v in a.state_dict().items():
        torch.testing.assert_close(v, b.state_dict()[k], rtol=1e-6, atol=1e-7)

    config = json.loads((full / "final" / "config.json").read_text())
    assert "markov_w1_embed" not in json.dumps(config)  # the served head is the plain table
    export_main(["--format", "speculators", "--checkpoint", str(full / "final"), "--output",
                 str(tmp_path / "spec")])
    assert ("folded into the table every step (model.markov_w1_embed)" in (tmp_path / "spec"
                                                                           / "README.md").read_text())
    spec = load_drafter(tmp_path / "spec")[0]
    torch.testing.assert_close(spec.markov_head.markov_w1.weight, a.markov_head.markov_w1.weight)
    eval_main(["--drafter", str(tmp_path / "spec"), "--limit", "1", "--budgets", "8", "--max-new-tokens", "8",
               "--output", str(tmp_path / "eval")])
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert all(r["lossless"] is True for r in report["results"])


def test_it_is_refused_without_a_markov_head():
    from dflash_train.training.config import load_recipe
    from dflash_train.core.errors import UserError

    for variant in (["model.variant=dflash"], ["model.variant=dspark", "model.markov_rank=0"]):
        with pytest.raises(UserError, match=r"^recipe '.*': model.markov_w1_embed trains DSpark's "
                                            r"Markov W1 .* has none$"):
            load_recipe(None, ["model.markov_w1_embed=true", *variant])
