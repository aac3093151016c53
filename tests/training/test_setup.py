"""training/setup.py: the data order a resumed run continues exactly, the precision and attention kernel
a recipe gets."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from accelerate import skip_first_batches
from torch.utils.data import DataLoader

import dflash_train.training.setup as setup
from dflash_train.core.errors import UserError
from dflash_train.training.config import load_recipe
from dflash_train.training.setup import EpochSampler, choose_precision, set_attention, train_batches


def epoch_order(n, seed, epoch) -> list[int]:
    sampler = EpochSampler(n, seed)
    sampler.epoch = epoch
    return list(sampler)


def test_an_epochs_order_is_a_permutation_fixed_by_seed_and_epoch():
    orders = {(seed, epoch): epoch_order(20, seed, epoch) for seed in (0, 1) for epoch in (0, 1, 2)}
    for order in orders.values():
        assert sorted(order) == list(range(20))
    assert orders[(0, 1)] == epoch_order(20, 0, 1)  # a fresh sampler (a resumed run) gives the same order
    assert len({tuple(o) for o in orders.values()}) == len(orders)  # every (seed, epoch) its own


def test_batches_resumed_mid_epoch_continue_the_uninterrupted_stream():
    """10 rows in batches of 3 (drop_last: 3 per epoch): from (epoch 1, 2 batches in) the stream is
    the uninterrupted one's from its 6th batch on, across the next epoch's start."""
    accelerator = SimpleNamespace(skip_first_batches=skip_first_batches)

    def stream(epoch, skip):
        sampler = EpochSampler(10, seed=5)
        loader = DataLoader(list(range(10)), batch_size=3, sampler=sampler, drop_last=True)
        return [(e, i, b.tolist()) for e, i, b in itertools.islice(train_batches(loader, sampler, accelerator,
                                                                                 epoch, skip), 6)]

    whole = stream(0, 0) + stream(2, 0)  # epochs 0, 1 then 2, 3
    assert [(e, i) for e, i, _ in whole[:6]] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert [b for _, _, b in whole[3:6]] == [epoch_order(10, 5, 1)[k:k + 3] for k in (0, 3, 6)]
    assert stream(1, 2) == whole[5:11]


def recipe(*overrides):
    return load_recipe(None, list(overrides))


@pytest.mark.parametrize("cuda_bf16, cpu_bf16, asked, gets", [
    (False, False, "fp32", "no"), (False, False, "auto", "no"), (False, True, "auto", "no"),
    (True, False, "auto", "bf16"), (True, False, "fp32", "no"), (False, True, "bf16", "bf16"),
    (True, False, "bf16", "bf16")])
def test_bf16_only_where_it_runs_and_auto_only_on_a_gpu(cuda_bf16, cpu_bf16, asked, gets, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_bf16)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    monkeypatch.setattr(setup, "native_bf16", lambda device: cpu_bf16)
    assert choose_precision(recipe(f"train.precision={asked}")) == gets


def test_bf16_asked_where_it_does_not_run_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(setup, "native_bf16", lambda device: False)
    with pytest.raises(UserError, match="train.precision=bf16 needs a GPU"):
        choose_precision(recipe("train.precision=bf16"))


@pytest.mark.parametrize("attention, device, flex", [("auto", "cpu", False), ("auto", "cuda", True),
                                                     ("sdpa", "cuda", False), ("flex", "cuda", True)])
def test_flex_attention_on_cuda_only(attention, device, flex):
    drafter = SimpleNamespace()
    set_attention(drafter, recipe(f"train.attention={attention}", "train.gradient_checkpointing=true"),
                  torch.device(device))
    assert drafter.flex_attention is flex and drafter.gradient_checkpointing is True


def test_flex_attention_asked_on_a_cpu_is_refused():
    with pytest.raises(UserError, match="train.attention=flex needs CUDA"):
        set_attention(SimpleNamespace(), recipe("train.attention=flex"), torch.device("cpu"))
