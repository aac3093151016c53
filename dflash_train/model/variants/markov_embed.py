"""DSpark's Markov W1 trained through the target's input embedding (model.markov_w1_embed; issue 19's
previous-token head, our design).

The Markov head scores a slot given the token before it by W2 u, u = W1[x_{k-1}] (dspark.py). W1 is a
free [V, r] table, and a row learns only from the positions where its token was the predecessor: a
token that the training answers rarely put there, typically a sibling a draft tree offers off the
argmax path, keeps its initial row, so after it the tree's conditional scores are the marginal ones.
TreeFlash's answer is a previous-token MLP over the token's embedding. Ours keeps the served head as
it is and trains its table as

    W1 = T + Ê P        T [V, r] the table, Ê [V, H] the target's input embedding scaled to unit mean
                        row norm (frozen), P [H, r] learned

so every step moves every row, a token's by what tokens with nearby embeddings were taught. The sum
is what vLLM and every loader here read as W1, so nothing downstream changes: P is folded into the
table after each optimizer step (T += Ê P, P = 0). That is exact, not an approximation: the loss
depends on T and P only through W1, so dL/dT = g and dL/dP = Ê^T g (g = dL/dW1) whatever P is, and
Adam's moments (kept here for P) see the same gradients as they would for an unfolded T + Ê P; with
weight decay 0 the trajectory of W1 is the unfolded one (tests/training/test_markov_embed.py checks it
against the unfolded parametrisation). Only T is in the drafter and its optimizer; P's optimizer
state goes into the trainer state for resume.

P's learning rate is train.lr / sqrt(H): Adam moves each of P's H entries per column by about lr, and
a row's step Ê[x] P sums H of them, so unscaled the embedding path would step ~sqrt(H) times as far
as the table. The cost is two [V, H] x [H, r] products per step (0.3 s at SmolLM2's V=49,152, H=576,
r=256 on one CPU thread, vs ~9 s a step).
"""

import math

import torch


class SharedW1:
    """The side parameter P of one Markov head's W1 = T + Ê P, its AdamW (same betas and schedule as
    the drafter's), and the fold after each step."""

    def __init__(self, head, embed_weight: torch.Tensor, lr: float, betas: tuple[float, float], schedule):
        table = head.markov_w1.weight  # T [V, r]: the drafter's own parameter
        E = embed_weight.detach().to(table.device, torch.float32)
        if E.shape[0] != table.shape[0]:
            raise ValueError(f"the target's embedding has {E.shape[0]} rows, the Markov table "
                             f"{table.shape[0]}")
        self.head = head
        self.basis = E / E.norm(dim=1).mean()  # Ê [V, H]: rows of mean norm 1
        self.proj = torch.zeros(E.shape[1], table.shape[1], device=table.device,
                                requires_grad=True)  # P [H, r]
        self.opt = torch.optim.AdamW([self.proj], lr=lr / math.sqrt(E.shape[1]), betas=betas,
                                     weight_decay=0.0)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)

    def step(self) -> None:
        """After the drafter's optimizer step, before its gradients are cleared (g all-reduced and
        clipped): P's gradient Ê^T g, its AdamW step, and the fold T += Ê P (P back to 0)."""
        g = self.head.markov_w1.weight.grad  # [V, r]; None if no step reached the head
        if g is None:
            self.sched.step()
            return
        self.proj.grad = self.basis.T @ g.float()  # [H, r]
        self.opt.step()
        self.sched.step()
        with torch.no_grad():
            self.head.markov_w1.weight.add_((self.basis @ self.proj).to(self.head.markov_w1.weight.dtype))
            self.proj.zero_()
        self.proj.grad = None

    def state_dict(self) -> dict:
        return {"opt": self.opt.state_dict(), "sched": self.sched.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
