"""DFlash2: the local convolutions and the candidate selector, against speculators' DFlash2DraftModel,
DFlash (identity initialisation) and the block structure."""

import dataclasses

import pytest
import torch

from dflash_train.model.drafter import ContextCache, DFlashDrafter
from dflash_train.model.loss import dflash_loss
from dflash_train.model.target import target_forward
from dflash_train.model.variants import dflash2
from dflash_train.model.variants.dflash2 import GroupedDynamicConv
from dflash_train.training.config import LossConfig
from helpers.dflash2 import B, dflash2_config, randomize


@pytest.fixture(scope="module")
def setup(tiny_target):
    cfg = dflash2_config(tiny_target)
    torch.manual_seed(0)
    return tiny_target, randomize(DFlashDrafter(cfg)).eval(), cfg


def train_hidden(target, drafter, ids, anchors, block_embeds=None):
    """The training forward over anchored blocks of ids [1, T] -> hidden [A, B, H]."""
    cfg = drafter.config
    taps, _ = target_forward(target, ids, torch.ones_like(ids), cfg.target_layer_ids)
    A = anchors.shape[1]
    if block_embeds is None:
        block = torch.full((1, A, B), cfg.mask_token_id)
        block[:, :, 0] = ids.gather(1, anchors)
        block_embeds = target.embed(block.view(1, A * B))
    return drafter(block_embeds, taps, anchors, torch.ones_like(ids, dtype=torch.bool)).view(A, B, -1)


def cached_hidden(target, drafter, ids, anchor):
    cfg = drafter.config
    taps, _ = target_forward(target, ids[:, :anchor], torch.ones_like(ids[:, :anchor]), cfg.target_layer_ids)
    cache = ContextCache(cfg.num_hidden_layers)
    drafter.extend_context(cache, taps, torch.arange(anchor)[None])
    block = torch.full((1, B), cfg.mask_token_id)
    block[0, 0] = ids[0, anchor]
    return drafter.forward_cached(target.embed(block), torch.arange(anchor, anchor + B)[None], cache)[0]


def test_parameter_names_are_speculators_dflash2_names(setup):
    from speculators.models.dflash2 import DFlash2DraftModel

    from dflash_train.checkpoint.formats import speculators_config

    target, drafter, cfg = setup
    spec = DFlash2DraftModel(speculators_config(cfg, "v", ["Qwen3ForCausalLM"], {}, None))
    verifier_owned = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                      "verifier_norm.weight"}
    theirs = {k: v.shape for k, v in spec.state_dict().items() if k not in verifier_owned}
    assert theirs == {k: v.shape for k, v in drafter.state_dict().items()}


@torch.no_grad()
def test_untrained_dflash2_is_dflash(tiny_target):
    """Identity initialisation: a fresh DFlash2 drafter computes exactly what a DFlash drafter with
    the same backbone weights computes, in training and in decoding."""
    cfg = dflash2_config(tiny_target)
    torch.manual_seed(3)
    fresh = DFlashDrafter(cfg).eval()
    plain = DFlashDrafter(dataclasses.replace(cfg, variant="dflash", conv_kernel_size=0, conv_group_size=0,
                                              selector_rank=0, selector_top_k=0)).eval()
    missing, unexpected = plain.load_state_dict(fresh.state_dict(), strict=False)
    assert missing == [] and all("_conv." in k or k.startswith("candidate_selector.") for k in unexpected)
    # base[:, 0] = 1 only
    assert fresh.layers[0].attention_conv.base_kernel.abs().sum() == 2 * cfg.hidden_size
    ids = torch.randint(0, 1000, (1, 40))
    anchors = torch.tensor([[3, 11, 20, 31]])
    assert torch.equal(train_hidden(tiny_target, fresh, ids, anchors),
                       train_hidden(tiny_target, plain, ids, anchors))
    assert torch.equal(cached_hidden(tiny_target, fresh, ids, 17), cached_hidden(tiny_target, plain, ids, 17))


def test_conv_reads_only_earlier_slots_of_its_own_block():
    """The convolution pair alone (input side, then output side, k = 2 taps each): output slot s of
    block i depends on input slots s-2..s of block i and on nothing else (not on block i-1's last
    slots, which directly precede it in the row)."""
    torch.manual_seed(0)
    conv = GroupedDynamicConv(32, block_size=4, kernel_size=2, group_size=8)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.3)
    x = torch.randn(1, 12, 32, requires_grad=True)  # 3 blocks of 4 slots
    y, delta = conv.prepare(x)
    out = conv.finish(y, delta)
    for row in range(12):
        (grad,) = torch.autograd.grad(out[0, row].sum(), x, retain_graph=True)
        reads = set(torch.nonzero(grad[0].abs().sum(-1)).flatten().tolist())
        block, slot = divmod(row, 4)
        assert reads == {block * 4 + s for s in (slot - 2, slot - 1, slot) if s >= 0}, row


@torch.no_grad()
def test_conv_never_mixes_two_blocks(setup):
    """Changing block j's tokens (its last slot included, which sits right before block j+1 in the
    training row) leaves every other block's hidden states unchanged."""
    target, drafter, cfg = setup
    ids = torch.randint(0, 1000, (1, 48))
    anchors = torch.tensor([[4, 12, 20, 30]])
    A = anchors.shape[1]
    block = torch.full((1, A, B), cfg.mask_token_id)
    block[:, :, 0] = ids.gather(1, anchors)
    embeds = target.embed(block.view(1, A * B))
    base = train_hidden(target, drafter, ids, anchors, embeds)
    for j in range(A):
        changed = embeds.clone()
        changed[0, j * B : (j + 1) * B] = target.embed(torch.randint(0, 1000, (B,)))
        new = train_hidden(target, drafter, ids, anchors, changed)
        for i in range(A):
            if i == j:
                assert not torch.allclose(new[i], base[i])
            else:
                torch.testing.assert_close(new[i], base[i], rtol=0, atol=1e-6)


@torch.no_grad()
def test_training_and_cached_forward_agree(setup):
    target, drafter, cfg = setup
    ids = torch.randint(0, 1000, (1, 40))
    anchors = torch.tensor([[3, 10, 11, 25, 31]])
    train = train_hidden(target, drafter, ids, anchors)
    for j, a in enumerate(anchors[0].tolist()):
        torch.testing.assert_close(train[j], cached_hidden(target, drafter, ids, a), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_forward_and_loss_equal_speculators_dflash2(setup):
    """speculators' own DFlash2DraftModel with our weights: its anchored-block forward gives our
    hidden states and unary logits on the same anchors, its selector our candidate scores, and its
    DFlash2 objective (CE + D-PACE, plus the selector's candidate CE) our loss."""
    from speculators.losses import eager
    from speculators.models.dflash2 import DFlash2DraftModel
    from speculators.models.dflash2.metrics import compute_metrics, selector_training_candidates

    from dflash_train.checkpoint.formats import speculators_config

    target, drafter, cfg = setup
    spec_cfg = speculators_config(cfg, "v", ["Qwen3ForCausalLM"], {}, None)
    spec_cfg.transformer_layer_config._attn_implementation = "sdpa"
    spec = DFlash2DraftModel(spec_cfg).eval()
    spec.load_state_dict(drafter.state_dict(), strict=False)
    spec.embed_tokens.weight.copy_(target.embed.weight)
    spec.lm_head.weight.copy_(target.lm_head.weight)
    spec.verifier_lm_head.weight.copy_(target.lm_head.weight)
    spec.verifier_norm.weight.copy_(target.model.model.norm.weight)

    T, A = 56, 5
    ids = torch.randint(0, 1000, (1, T))
    out = target.model.model(input_ids=ids, output_hidden_states=True)
    spec_taps = torch.cat([out.hidden_states[i] for i in spec_cfg.aux_hidden_state_layer_ids], -1)
    # speculators reads the final layer's output BEFORE the final norm (transformers' last entry is after it)
    pre_norm_last = _pre_norm_last_hidden(target, ids)
    torch.manual_seed(5)
    hidden, logits, targets, loss_mask, block_idx = spec._backbone_forward(
        spec_taps, ids, torch.ones_like(ids), pre_norm_last, torch.zeros_like(ids), max_anchors=A)
    anchors = block_idx.view(A, B)[:, 0][None]

    ours = train_hidden(target, drafter, ids, anchors)  # [A, B, H]
    torch.testing.assert_close(ours, hidden.view(A, B, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target.lm_head(ours), logits.view(A, B, -1), rtol=1e-5, atol=1e-5)

    # the selector on speculators' training candidates, predecessors = the data's previous tokens
    pred = spec._predecessor_ids(ids, block_idx)  # [A, B]
    cands, positions, contains = selector_training_candidates(
        logits.topk(cfg.selector_top_k, dim=-1).indices, targets.argmax(-1))
    spec_scores = spec.candidate_selector.score_candidates(logits, hidden, pred.reshape(1, -1), cands)
    block_tokens = torch.cat([ids.gather(1, anchors)[..., None], ids[0, block_idx].view(1, A, B)[..., 1:]],
                             -1)
    # [1, A, K, r]
    context = drafter.candidate_selector(ours[None, :, 1:], dflash2.predecessors(block_tokens))
    c = cands.view(A, B, -1)[None, :, 1:]
    our_scores = dflash2.candidate_scores(target.lm_head(ours)[None, :, 1:].gather(-1, c), context,
                                          drafter.candidate_selector.successor_codebook, c)
    torch.testing.assert_close(our_scores, spec_scores.view(1, A, B, -1)[:, :, 1:], rtol=1e-5, atol=1e-5)

    spec_loss, metrics = compute_metrics(
        unary_logits=logits, targets=targets, training_candidate_ids=cands, candidate_logits=spec_scores,
        target_positions=positions, contains_target=contains, loss_mask=loss_mask, block_size=B,
        top_k=cfg.selector_top_k, loss_config={"ce": (eager.ce_loss, 1.0)}, tv_loss_fn=eager.tv_loss,
        per_position_loss_weight="dpace")
    lcfg = LossConfig(position_weight="dpace", chunk_slots=2 * (B - 1))  # chunks of two blocks
    # [1, A, K, H]
    t_hidden = target.model.model.norm(pre_norm_last)[0, (block_idx.view(A, B)[:, 1:] - 1)][None]
    valid = torch.ones(1, A, B - 1, dtype=torch.bool)
    base, m = dflash_loss(ours[None, :, 1:], t_hidden, target.lm_head,
                          ids[0, block_idx].view(1, A, B)[..., 1:], valid, lcfg)
    selector, correct, _ = dflash2.selector_loss(drafter.candidate_selector, ours[None, :, 1:], block_tokens,
                                                 target.lm_head, m["labels"], valid, lcfg, valid.sum())
    torch.testing.assert_close(base + selector, spec_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(selector, metrics["selector_loss_sum"], rtol=1e-5, atol=1e-6)
    # speculators' greedy-selector EAL counts equal ours from the same per-slot hits
    accepted = torch.cumprod(correct[0].long(), dim=1).sum(1)
    assert metrics["eal_sum"].item() == pytest.approx((accepted + 1).sum().item())


def _pre_norm_last_hidden(target, ids):
    """The target's last decoder layer output before the final norm (speculators' verifier state)."""
    captured = {}
    hook = target.model.model.norm.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0]))
    try:
        target.model.model(input_ids=ids)
    finally:
        hook.remove()
    return captured["x"]


@pytest.mark.parametrize("position_weight", ["exp", "dpace"])
def test_chunked_selector_loss_equals_unchunked(setup, position_weight):
    """Chunks of blocks give the whole batch's selector loss and gradients (for the selector's
    parameters and, through U(b) and W_h h, for the backbone)."""
    target, drafter, cfg = setup
    torch.manual_seed(4)
    b, A, K, H = 2, 3, B - 1, cfg.hidden_size
    hidden0 = torch.randn(b, A, K, H)
    block_tokens = torch.randint(0, 1000, (b, A, B))
    labels = torch.randint(0, 1000, (b, A, K))
    labels[0, 0] = target.lm_head(hidden0[0, 0]).argmax(-1)  # some labels among the candidates
    valid = torch.rand(b, A, K) > 0.2
    results = []
    for chunk_slots in [0, K, 2 * K]:
        lcfg = LossConfig(position_weight=position_weight, chunk_slots=chunk_slots, until_first_failure=True)
        drafter.zero_grad()
        hidden = hidden0.clone().requires_grad_()
        loss, correct, contains = dflash2.selector_loss(drafter.candidate_selector, hidden, block_tokens,
                                                        target.lm_head, labels, valid, lcfg, 7.0)
        loss.backward()
        sel = drafter.candidate_selector
        results.append((loss.detach(), correct, contains, hidden.grad, sel.predecessor_codebook.grad.clone(),
                        sel.successor_codebook.grad.clone(), sel.hidden_projection.weight.grad.clone()))
    assert results[0][0] > 0 and results[0][2].any()
    for other in results[1:]:
        for x, y in zip(results[0], other):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("override, message", [
    ("model.conv_group_size=48", "does not divide the target's hidden size 128"),
    ("model.conv_kernel_size=9", "exceeds model.block_size 8"),
    ("model.selector_top_k=5000", "exceeds the target's vocabulary (1024)"),
    ("loss.selector_weight=-1", "'loss.selector_weight'"),
])
def test_bad_dflash2_settings_are_one_line_errors(override, message, tmp_path, capsys):
    from dflash_train.cli.train import main

    with pytest.raises(SystemExit) as e:
        main([f"output_dir={tmp_path / 'o'}", "model.variant=dflash2", override])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]  # (transformers' load bar aside)
    assert e.value.code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "o" / "final").exists()
