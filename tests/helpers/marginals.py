"""Exact reference distributions for the lossless-sampling tests, by enumeration."""

import torch


@torch.no_grad()
def next_two_marginals(model, prompt: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own distribution of the 2nd and 3rd sampled tokens after `prompt` [1, P] at
    temperature 1, summed exactly over every first (and second) token: (p2 [V], p3 [V]) in float64."""
    p1 = torch.softmax(model(prompt).logits[0, -1].double(), -1)
    p2, p3 = torch.zeros(V, dtype=torch.float64), torch.zeros(V, dtype=torch.float64)
    for a in range(V):
        after_a = torch.cat([prompt, torch.tensor([[a]])], 1)
        pa = p1[a] * torch.softmax(model(after_a).logits[0, -1].double(), -1)
        p2 += pa
        for b in range(V):
            seq = torch.cat([prompt, torch.tensor([[a, b]])], 1)
            p3 += pa[b] * torch.softmax(model(seq).logits[0, -1].double(), -1)
    return p2, p3


def random_target_and_drafter(V: int = 12, **drafter_fields) -> tuple:
    """A 4-layer random Qwen3 target over V tokens (seed 0; lm_head scaled for spread, not flat,
    next-token distributions) and an untrained 1-layer block-4 drafter for it (`drafter_fields`: a
    variant's own): (Target, DFlashDrafter), both in eval mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_train.model.drafter import DFlashDrafter, DrafterConfig
    from dflash_train.model.target import Target

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # spread but not flat next-token distributions
    target = Target(model, tokenizer=None, name_or_path="random", revision=None)
    drafter = DFlashDrafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          vocab_size=V, block_size=4, mask_token_id=V - 1,
                                          target_layer_ids=[1], num_target_layers=4, **drafter_fields)).eval()
    return target, drafter
