"""speculators' own DFlash model, run beside ours."""

import torch


def speculators_block_logits(spec, target, ids: torch.Tensor, a: int, B: int):
    """speculators' own DFlash model drafting the block [ids[a], MASK x (B-1)] after ids[:a]
    -> (its logits [1, B, V or N], the block ids [1, B])."""
    # speculators indexes hidden_states by its own aux ids directly (no +1)
    out = target.model.get_decoder()(input_ids=ids[:, :a], output_hidden_states=True)
    spec_taps = torch.cat([out.hidden_states[i] for i in spec.config.aux_hidden_state_layer_ids], -1)
    block = torch.full((1, B), spec.config.mask_token_id)
    block[0, 0] = ids[0, a]
    ctx = spec.hidden_norm(spec.fc(spec_taps))
    x = spec.embed_tokens(block)
    pos_emb = spec.rotary_emb(x, torch.arange(a + B)[None])
    for layer in spec.layers:
        x = layer(target_hidden=ctx, hidden_states=x, attention_mask=None, position_embeddings=pos_emb)
    return spec.lm_head(spec.norm(x)), block
