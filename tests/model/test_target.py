import pytest
import torch

from conftest import TINY_TARGET, broken_target
from dflash_train.core.errors import UserError
from dflash_train.model.target import build_target_layer_ids, check_tap_layers, load_target, target_forward


def test_default_taps_match_published_qwen3_8b():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(8, 2) == [1, 5]
    assert build_target_layer_ids(36, 1) == [18]


def test_taps_read_decoder_layer_outputs(tiny_target):
    """Tap k must be the raw output of decoder layer k (= output_hidden_states[k+1]),
    checked against forward hooks on the decoder layers themselves."""
    layers = tiny_target.model.get_decoder().layers
    seen = {}
    hooks = [layer.register_forward_hook(
                 lambda m, i, o, k=k: seen.__setitem__(k, o[0] if isinstance(o, tuple) else o))
             for k, layer in enumerate(layers)]
    try:
        ids = torch.randint(0, 1000, (2, 12))
        taps, last = target_forward(tiny_target, ids, torch.ones_like(ids), [1, 3, 5])
    finally:
        for h in hooks:
            h.remove()
    H = tiny_target.model.config.hidden_size
    assert taps.shape == (2, 12, 3 * H)
    for j, k in enumerate([1, 3, 5]):
        torch.testing.assert_close(taps[..., j * H:(j + 1) * H], seen[k], rtol=0, atol=0)
        # and not the neighbouring layer's output (the classic off-by-one)
        assert not torch.allclose(taps[..., j * H:(j + 1) * H], seen[k - 1])
    # the last hidden state is the final-normed output, which is what the LM head reads
    logits = tiny_target.model(input_ids=ids).logits
    torch.testing.assert_close(tiny_target.lm_head(last), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ids, msg", [([1, 1], "duplicates"), ([7], "out of range"), ([], "empty")])
def test_bad_taps_rejected(ids, msg):
    with pytest.raises(UserError, match=msg):
        check_tap_layers(ids, 8)


@pytest.mark.parametrize("how, message", [
    ("missing", r"its weights do not match its config.json: 22 missing \(e.g. model.layers.8."),
    ("unexpected", r"its weights do not match its config.json: 22 unexpected \(e.g. model.layers.6."),
    ("mis-shaped", r"its weights do not match its config.json: 24 of the wrong shape \(e.g. "
                   r"model.layers.0.mlp"),
    ("garbage", r"cannot load target .*: Error while deserializing header"),
])
def test_a_target_its_weights_do_not_fill_is_refused(tmp_path, how, message):
    """transformers would initialise the gaps at random and only warn: a drafter trained against
    that target learns nothing useful."""
    with pytest.raises(UserError, match=message):
        load_target(str(broken_target(tmp_path / how, how)))


def test_a_local_target_is_recorded_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(TINY_TARGET.parent)
    assert load_target("tiny-target/").name_or_path == str(TINY_TARGET)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="target not found: './tiny-targt'"):
        load_target("./tiny-targt")
