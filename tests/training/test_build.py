"""training/build.py: a drafter started from the target's own top layers (model.init_layers_from_target), or
from a trained drafter (model.init_from)."""

import pytest
import torch

from conftest import TINY_TARGET
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
                assert (arch == "llama" and name.endswith(("q_norm.weight", "k_norm.weight"))
                        and bool((t == 1).all()))
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


def test_init_from_a_draft_vocabulary_drafter_takes_the_head_rows_of_the_target_trained_against(tiny_target,
                                                                                               tmp_path):
    """model.init_from a draft-vocabulary drafter with another model.target (of the same shape) kept the
    first target's frozen head rows: the drafter's logits came from a head that is not its verifier's.
    Its vocabulary stays (part of the trained drafter); the rows are this target's."""
    from dflash_train.checkpoint.folders import save_drafter
    from dflash_train.model.drafter import DFlashDrafter
    from dflash_train.model.vocab import DraftVocab
    from dflash_train.training.build import attach_draft_vocab, drafter_config_for

    V = tiny_target.model.config.vocab_size
    first = DFlashDrafter(drafter_config_for(tiny_target, ModelConfig(num_layers=1, draft_vocab_size=64)))
    kept = torch.arange(0, 128, 2)
    first.set_draft_vocab(DraftVocab(kept, V), tiny_target.lm_head.weight)
    save_drafter(tmp_path / "first", first, tiny_target)

    other = load_target(str(TINY_TARGET))  # another target of the same shape: other head weights
    with torch.no_grad():
        other.lm_head.weight.mul_(-2).add_(1)
    m = ModelConfig(num_layers=1, draft_vocab_size=64, init_from=str(tmp_path / "first"))
    drafter = init_drafter(other, m)
    built = attach_draft_vocab(drafter, other, {"input_ids": [kept.tolist()], "loss_mask": [[1] * len(kept)]})
    assert built == {"size": 64, "coverage": 1.0}
    assert torch.equal(drafter.d2t, first.d2t) and torch.equal(drafter.t2d, first.t2d)  # its vocabulary
    assert torch.equal(drafter.lm_head.weight, other.lm_head.weight[kept])  # this target's rows
    assert not torch.equal(drafter.lm_head.weight, first.lm_head.weight)
    assert not drafter.lm_head.weight.requires_grad  # still frozen
