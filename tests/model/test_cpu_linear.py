"""The weight-streaming CPU linear: F.linear's values (against a float64 product), the same bits for a
row whatever the rows beside it, torch's path under autograd, and decoding through it still exactly
plain decoding's output."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import chat_prompt
from dflash_train.data.dataset import stop_token_ids
from dflash_train.decoding.decode import decode
from dflash_train.model import cpu_linear
from dflash_train.model.cpu_linear import (MAX_ROWS, StreamLinear, kernel, stream_linear, use_stream_linear,
                                           use_torch_linear)

needs_kernel = pytest.mark.skipif(kernel()[0] is None, reason=f"no streaming linear here: {kernel()[1]}")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 25, MAX_ROWS])
@pytest.mark.parametrize("in_features, out_features", [(8, 1), (64, 33), (136, 70)])
def test_equals_a_float64_product(rows, in_features, out_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    want = (x.double() @ w.double().T + b.double()).float()
    got = stream_linear(x, w, b)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * in_features ** 0.5)


@needs_kernel
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(30, 96, generator=g), torch.randn(100, 96, generator=g)
    together = stream_linear(x, w)
    for i in range(30):
        assert torch.equal(stream_linear(x[i : i + 1], w)[0], together[i])
    assert torch.equal(stream_linear(x[3:20], w), together[3:20])  # a block starting mid-way, 12 + 5 rows


@needs_kernel
def test_keeps_leading_shape_and_non_contiguous_input():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, generator=g).transpose(0, 1)  # [3, 2, 64], not contiguous
    w = torch.randn(40, 64, generator=g)
    torch.testing.assert_close(stream_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_module_uses_torch_under_autograd_and_for_many_rows():
    lin = nn.Linear(64, 16)
    ref = nn.Linear(64, 16)
    ref.load_state_dict(lin.state_dict())
    assert use_stream_linear(lin) == (1, None) and type(lin) is StreamLinear
    x = torch.randn(4, 64, requires_grad=True)
    lin(x).sum().backward()
    g = x.grad.clone()
    x.grad = None
    ref(x).sum().backward()
    assert torch.equal(g, x.grad)  # gradients flow: the forward was F.linear
    many = torch.randn(MAX_ROWS + 1, 64)
    with torch.no_grad():
        assert torch.equal(lin(many), F.linear(many, lin.weight, lin.bias))  # prefill-sized: torch's GEMM
    assert use_torch_linear(lin) == 1 and type(lin) is nn.Linear
    assert list(lin.state_dict()) == ["weight", "bias"]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 12, 13, MAX_ROWS])
def test_bf16_weights_stream_the_same_bits_as_their_fp32_values(rows):
    """Weights stored as bf16 and widened in registers: exactly the fp32 kernel on the same values."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 136, generator=g)
    w16 = torch.randn(70, 136, generator=g).bfloat16()
    b = torch.randn(70, generator=g)
    assert torch.equal(stream_linear(x, w16, b), stream_linear(x, w16.float(), b))
    torch.testing.assert_close(stream_linear(x, w16), (x.double() @ w16.double().T).float(), rtol=1e-5,
                               atol=1e-3)


@needs_kernel
def test_a_linear_keeps_a_bf16_copy_only_when_it_loses_nothing_and_drops_it_when_the_weight_changes():
    exact, inexact = nn.Linear(64, 16), nn.Linear(64, 16)
    with torch.no_grad():
        exact.weight.copy_(exact.weight.bfloat16().float())  # bf16 values held in fp32 (a bf16 export)
    x = torch.randn(3, 64)
    with torch.no_grad():
        want_exact, want_inexact = stream_linear(x, exact.weight,
                                                 exact.bias), stream_linear(x, inexact.weight,
                                                                                          inexact.bias)
    use_stream_linear(exact), use_stream_linear(inexact)
    assert exact.weight_bf16 is not None and exact.weight_bf16.dtype == torch.bfloat16
    assert inexact.weight_bf16 is None  # rounding would change the model: fp32 stays
    assert list(exact.state_dict()) == ["weight", "bias"]  # the copy is not part of the model
    calls = []
    real = cpu_linear.stream_linear
    with torch.no_grad():
        cpu_linear.stream_linear = lambda x, w, b=None: calls.append(w.dtype) or real(x, w, b)
        try:
            assert torch.equal(exact(x), want_exact) and torch.equal(inexact(x), want_inexact)
            exact.weight.mul_(2)  # changed in place (load_state_dict, a training step): the copy is stale
            assert torch.equal(exact(x), real(x, exact.weight, exact.bias))
        finally:
            cpu_linear.stream_linear = real
    assert calls == [torch.bfloat16, torch.float32, torch.float32]
    assert use_torch_linear(exact) == 1 and "weight_bf16" not in exact.__dict__


def test_only_fp32_cpu_linears_with_whole_vectors_switch():
    strided = nn.Linear(64, 8)
    # [8, 64] but not contiguous: would be copied per call
    strided.weight = nn.Parameter(torch.randn(64, 8).T)
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(12, 8), nn.Linear(64, 8).to(torch.bfloat16), strided)
    n, why = use_stream_linear(model)
    if why is not None:
        assert n == 0
        return
    assert n == 1 and [type(m) for m in model] == [StreamLinear, nn.Linear, nn.Linear, nn.Linear]


@needs_kernel
def test_decoding_through_it_is_still_plain_decoding(tiny_target, trained_drafter_dir):
    from dflash_train.checkpoint.folders import load_drafter

    drafter = load_drafter(trained_drafter_dir)[0].eval()
    stops = stop_token_ids(tiny_target.model, tiny_target.tokenizer)
    ids = chat_prompt(tiny_target.tokenizer, "Tell me about Oakgate.")
    before = decode(tiny_target, None, ids, "ar", max_new_tokens=40, stop_ids=stops).tokens
    switched = use_stream_linear(tiny_target.model)[0] + use_stream_linear(drafter)[0]
    try:
        assert switched > 0
        plain = decode(tiny_target, None, ids, "ar", max_new_tokens=40, stop_ids=stops)
        chain = decode(tiny_target, drafter, ids, "dflash", max_new_tokens=40, stop_ids=stops)
        tree = decode(tiny_target, drafter, ids, "ddtree", budget=16, max_new_tokens=40, stop_ids=stops)
    finally:
        use_torch_linear(tiny_target.model)
        use_torch_linear(drafter)
    assert plain.tokens == before
    assert chain.tokens == plain.tokens and tree.tokens == plain.tokens
    assert tree.tau > 1  # the drafter's guesses were accepted through the streamed linears


def test_without_a_compiler_torch_stays_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_linear, "_kernel", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    model = nn.Linear(64, 8)
    n, why = use_stream_linear(model)
    assert n == 0 and type(model) is nn.Linear
    assert why and ("no-such-cc" in why or "AVX2" in why)
    assert not any(tmp_path.rglob("*.so"))  # nothing half-built left behind
    monkeypatch.setattr(cpu_linear, "_kernel", None)  # the next caller builds for real again


@needs_kernel
def test_bf16_weights_stream_their_bf16_copies_and_decode_losslessly(trained_drafter_dir):
    """dflash-eval --target-dtype bf16-weights: every weight rounded to bf16 (held in fp32), so every
    target and drafter linear streams a bf16 copy; decoding through them is plain decoding of the
    rounded model (torch's linear over the same rounded weights gives the same tokens), and the chain
    and DDTree still give exactly those tokens."""
    from conftest import TINY_TARGET
    from dflash_train.checkpoint.folders import load_drafter
    from dflash_train.model.target import load_target, round_weights_to_bf16

    target, drafter = load_target(TINY_TARGET), load_drafter(trained_drafter_dir)[0].eval()
    before = {n: p.clone() for n, p in target.model.named_parameters()}
    round_weights_to_bf16(target.model)
    round_weights_to_bf16(drafter)
    changed = 0
    for n, p in target.model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n].bfloat16().float()), n
        changed += not torch.equal(p, before[n])
    assert changed > 0  # the tiny target's fp32 weights were not bf16 values already
    stops = stop_token_ids(target.model, target.tokenizer)
    ids = chat_prompt(target.tokenizer, "Tell me about Oakgate.")
    by_torch = decode(target, None, ids, "ar", max_new_tokens=40, stop_ids=stops).tokens
    use_stream_linear(target.model), use_stream_linear(drafter)
    streamed = [m for model in (target.model, drafter) for m in model.modules() if type(m) is StreamLinear]
    assert streamed and all(m.weight_bf16 is not None for m in streamed)  # half the bytes, every one
    plain = decode(target, None, ids, "ar", max_new_tokens=40, stop_ids=stops)
    chain = decode(target, drafter, ids, "dflash", max_new_tokens=40, stop_ids=stops)
    tree = decode(target, drafter, ids, "ddtree", budget=16, max_new_tokens=40, stop_ids=stops)
    assert plain.tokens == by_torch
    assert chain.tokens == plain.tokens and tree.tokens == plain.tokens
