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


def test_only_fp32_cpu_linears_with_whole_vectors_switch():
    strided = nn.Linear(64, 8)
    strided.weight = nn.Parameter(torch.randn(64, 8).T)  # [8, 64] but not contiguous: would be copied per call
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
