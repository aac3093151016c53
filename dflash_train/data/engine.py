"""A continuous-batching generation engine for Llama-family targets (regeneration's fast path).

    generate = static_generate(target, stop_ids, sampling, slots=48, max_len=512)
    generate([prompt_ids, ...], seed) -> [Generation, ...]      # regenerate.GenerateFn

Why: `model.generate` on a batch runs until its longest answer ends, so every row that stopped early
keeps costing a forward per step, and its dynamic cache re-allocates as it grows. Here a fixed number of
slots share one static KV cache [layers, slots, kv_heads, max_len, head_dim]; each step decodes one token
for every busy slot at its own position, and a slot whose answer ended takes the next prompt at once
(prefilled alone, causal). The arithmetic is the HF Llama forward's (RMSNorm, RoPE, GQA, SwiGLU, Qwen3's q/k
norms, tied or untied head) on the model's own weights, in the model's dtype.

Sampling: greedy at temperature 0; else temperature + top-p with one torch.Generator per prompt, seeded
from (seed, prompt index), so an answer does not depend on which slot or batch it ran in.
"""

import torch
import torch.nn.functional as F

from dflash_train.core.errors import UserError
from dflash_train.core.seeds import derived_generator
from dflash_train.data.regenerate import GenerateFn, Generation, Sampling
from dflash_train.model.sampling import tempered_probs
from dflash_train.model.target import Target


class LlamaWeights:
    """The tensors one decoding step needs, read from a transformers Llama model (shared, not copied)."""

    def __init__(self, model):
        cfg = model.config
        if cfg.model_type not in ("llama", "qwen3") or getattr(cfg, "attention_bias", False) \
                or getattr(cfg, "mlp_bias", False):
            raise ValueError("the static engine runs Llama and Qwen3 targets without biases, not "
                             f"{cfg.model_type!r}")
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        rope = (cfg.rope_parameters if getattr(cfg, "rope_parameters", None)
                else {"rope_type": "default", "rope_theta": cfg.rope_theta})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"the static engine supports default RoPE only, not {rope['rope_type']!r}")
        self.theta = rope["rope_theta"]
        m = model.model
        self.embed = m.embed_tokens.weight  # [V, H]
        self.norm = m.norm.weight
        self.head = model.lm_head.weight  # [V, H] (the embedding itself when tied)
        # Qwen3 normalises each head's q and k before RoPE; Llama does not (None)
        self.qk_norms = [(layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)
                         if cfg.model_type == "qwen3" else (None, None) for layer in m.layers]
        self.layers = [(layer.input_layernorm.weight, layer.self_attn.q_proj.weight,
                        layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight,
                        layer.self_attn.o_proj.weight, layer.post_attention_layernorm.weight,
                        layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight)
                       for layer in m.layers]
        self.dtype = self.embed.dtype


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def head_norm(x, w, eps):
    return x if w is None else rms_norm(x, w, eps)


def rope(x, cos, sin):
    """x [..., n, D] rotated at its positions; cos/sin [n, D] broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class StaticEngine:
    def __init__(self, model, slots: int, max_len: int):
        self.w = LlamaWeights(model)
        w = self.w
        n_layers = len(w.layers)
        self.k = torch.zeros(n_layers, slots, w.n_kv, max_len, w.head_dim, dtype=w.dtype)
        self.v = torch.zeros_like(self.k)
        self.slots, self.max_len = slots, max_len
        inv = 1.0 / (w.theta ** (torch.arange(0, w.head_dim, 2, dtype=torch.int64).float() / w.head_dim))
        freqs = torch.outer(torch.arange(max_len).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(w.dtype), emb.sin().to(w.dtype)  # [max_len, D]

    def _mlp(self, x, layer):
        g, u, d = layer[6], layer[7], layer[8]
        return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)

    @torch.no_grad()
    def prefill(self, slot: int, ids: list[int]) -> torch.Tensor:
        """Write a prompt's K/V into `slot` at positions 0..P-1 -> logits of its last token [V]."""
        w, P = self.w, len(ids)
        x = w.embed[torch.tensor(ids)]  # [P, H]
        cos, sin = self.cos[:P], self.sin[:P]
        for li, layer in enumerate(w.layers):
            h = rms_norm(x, layer[0], w.eps)
            q = F.linear(h, layer[1]).view(P, w.n_heads, w.head_dim).transpose(0, 1)  # [nh, P, D]
            k = F.linear(h, layer[2]).view(P, w.n_kv, w.head_dim).transpose(0, 1)  # [nkv, P, D]
            v = F.linear(h, layer[3]).view(P, w.n_kv, w.head_dim).transpose(0, 1)
            qn, kn = w.qk_norms[li]
            q, k = rope(head_norm(q, qn, w.eps), cos, sin), rope(head_norm(k, kn, w.eps), cos, sin)
            self.k[li, slot, :, :P] = k
            self.v[li, slot, :, :P] = v
            a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
            x = x + F.linear(a.transpose(0, 1).reshape(P, -1), layer[4])
            x = x + self._mlp(rms_norm(x, layer[5], w.eps), layer)
        return F.linear(rms_norm(x[-1:], w.norm, w.eps), w.head)[0]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One token for every slot at its own position: tokens/pos [slots] -> logits [slots, V].
        Every slot steps (an idle one on a dummy token at position 0, overwritten by its next prefill):
        the cache is then read as a view, where gathering the busy slots would copy it every layer."""
        w, S = self.w, self.slots
        T = int(pos.max()) + 1  # keys beyond the longest row are never read
        x = w.embed[tokens]  # [S, H]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [S, 1, D]
        visible = (torch.arange(T)[None] <= pos[:, None])[:, None, None]  # [S, 1, 1, T]
        rows = torch.arange(S)
        for li, layer in enumerate(w.layers):
            h = rms_norm(x, layer[0], w.eps)
            qn, kn = w.qk_norms[li]
            # q [S, nh, D], k [S, nkv, D]
            q = rope(head_norm(F.linear(h, layer[1]).view(S, w.n_heads, w.head_dim), qn, w.eps), cos, sin)
            k = rope(head_norm(F.linear(h, layer[2]).view(S, w.n_kv, w.head_dim), kn, w.eps), cos, sin)
            v = F.linear(h, layer[3]).view(S, w.n_kv, w.head_dim)
            self.k[li, rows, :, pos] = k
            self.v[li, rows, :, pos] = v
            keys, vals = self.k[li, :, :, :T], self.v[li, :, :, :T]  # [S, nkv, T, D] views
            a = F.scaled_dot_product_attention(q[:, :, None], keys, vals, attn_mask=visible, enable_gqa=True)
            x = x + F.linear(a.reshape(S, -1), layer[4])
            x = x + self._mlp(rms_norm(x, layer[5], w.eps), layer)
        return F.linear(rms_norm(x, w.norm, w.eps), w.head)


def pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """Next token of one row: argmax at temperature 0, else a top-p sample at `temperature`."""
    if temperature == 0:
        return int(logits.argmax())
    probs = tempered_probs(logits, temperature)
    if top_p < 1.0:
        p, idx = probs.sort(descending=True)
        keep = (p.cumsum(0) - p) < top_p  # the smallest head whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def generate_all(engine: StaticEngine, prompts: list[list[int]], stop_ids: list[int], max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[Generation]:
    """Answer every prompt, `engine.slots` at a time; a finished slot takes the next prompt at once."""
    stop = set(stop_ids)
    out: list[Generation | None] = [None] * len(prompts)
    rngs: list[torch.Generator | None] = [None] * len(prompts)  # one per prompt, when sampling
    free = list(range(engine.slots))[::-1]
    busy: dict[int, tuple[int, list[int], int]] = {}  # slot -> (prompt index, tokens so far, next position)
    todo = iter(range(len(prompts)))

    def take(i, logits, slot, P):
        if temperature > 0:
            rngs[i] = derived_generator(seed * 1_000_003 + i)  # regenerate's batch seeds reach 2**56
        t = pick(logits, temperature, top_p, rngs[i])
        finish(slot, i, [t], P)

    def finish(slot, i, toks, pos):
        if toks[-1] in stop:
            out[i] = Generation(toks[:-1], True)
            free.append(slot)
        elif len(toks) >= max_new_tokens or pos + 1 >= engine.max_len:
            out[i] = Generation(toks, False)
            free.append(slot)
        else:
            busy[slot] = (i, toks, pos)

    while True:
        while free:
            i = next(todo, None)
            if i is None:
                break
            slot = free.pop()
            if len(prompts[i]) + 1 > engine.max_len:
                raise UserError(f"a prompt has {len(prompts[i])} tokens; the static engine holds "
                                f"{engine.max_len} positions (prompt + answer): raise its max_len")
            take(i, engine.prefill(slot, prompts[i]), slot, len(prompts[i]))
        if not busy:
            break
        tokens = torch.zeros(engine.slots, dtype=torch.long)
        pos = torch.zeros(engine.slots, dtype=torch.long)
        for slot, (_, toks, p) in busy.items():
            tokens[slot], pos[slot] = toks[-1], p
        logits = engine.step(tokens, pos)
        if temperature == 0:
            nxt = logits.argmax(-1).tolist()
        for slot in sorted(busy):
            i, toks, p = busy.pop(slot)
            toks.append(nxt[slot] if temperature == 0 else pick(logits[slot], temperature, top_p, rngs[i]))
            finish(slot, i, toks, p + 1)
    return out


def static_generate(target: Target, stop_ids: list[int], s: Sampling, slots: int,
                    max_len: int = 0) -> GenerateFn:
    """regenerate.GenerateFn on the static engine (`--backend static`, CPU): the same answers as
    `transformers` at temperature 0 up to float ties (tests/data/test_engine.py compares them token for
    token). The cache holds max_len positions, grown for a call whose longest prompt + answer needs more."""
    if next(target.model.parameters()).device.type != "cpu":
        raise UserError("--backend static runs on the CPU: use --device cpu, or --backend transformers / "
                        "vllm")
    try:
        LlamaWeights(target.model)
    except ValueError as e:
        raise UserError(f"--backend static: {e}; use --backend transformers") from None
    engine = None

    def generate(prompts: list[list[int]], seed: int) -> list[Generation]:
        nonlocal engine
        need = max(len(p) for p in prompts) + s.max_new_tokens + 1
        if engine is None or engine.max_len < need:
            engine = StaticEngine(target.model, slots, max(need, max_len))
        return generate_all(engine, prompts, stop_ids, s.max_new_tokens, s.temperature, s.top_p, seed)

    return generate
