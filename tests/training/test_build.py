"""training/build.py: a drafter started from the target's own top layers (model.init_layers_from_target)."""

import pytest
import torch

from dflash_train.core.errors import UserError
from dflash_train.model.target import load_target
from dflash_train.training.build import init_drafter
from dflash_train.training.config import ModelConfig, load_recipe


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_drafter_layers_start_as_the_targets_top_layers(arch, qwen3_random_target_dir, llama_target_dir):
    folder = qwen3_random_target_dir if arch == "qwen3" else llama_target_dir
    target = load_target(str(folder))
    m = ModelConfig(target=str(folder), num_layers=2, mask_token_id=5, init_layers_from_target=True)
    drafter = init_drafter(target, m)
    decoder = target.model.get_decoder()
    N = target.num_layers
    for i, layer in enumerate(drafter.layers):
        theirs = decoder.layers[N - 2 + i].state_dict()
        for name, t in layer.state_dict().items():
            if name in theirs:
                assert torch.equal(t, theirs[name]), name
            else:  # Llama has no q_norm / k_norm: they keep their ones
                assert arch == "llama" and name.endswith(("q_norm.weight", "k_norm.weight")) and bool((t == 1).all())
        assert set(theirs) <= set(layer.state_dict())
    assert torch.equal(drafter.norm.weight, decoder.norm.weight)
    fresh = init_drafter(target, ModelConfig(target=str(folder), num_layers=2, mask_token_id=5))
    assert not torch.equal(fresh.layers[0].mlp.up_proj.weight, drafter.layers[0].mlp.up_proj.weight)


def test_init_layers_from_target_and_init_from_together_are_refused():
    with pytest.raises(UserError, match="both give the drafter's layers"):
        load_recipe(None, ["model.init_layers_from_target=true", "model.init_from=some/drafter"])


def test_more_drafter_layers_than_the_target_has_is_one_line(llama_target_dir):
    target = load_target(str(llama_target_dir))
    with pytest.raises(UserError, match="the drafter has 7 layers, the target only 6"):
        init_drafter(target, ModelConfig(target=str(llama_target_dir), num_layers=7, mask_token_id=5,
                                         target_layer_ids=[1], init_layers_from_target=True))
