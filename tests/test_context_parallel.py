"""Context parallelism (td.context) against one process, on real Gloo and MPI worlds.

Every rank builds the one-process model from the same seed and keeps a copy as the reference;
the other is converted with `td.context.parallelize` (ring or all-to-all) and runs on this
rank's part of each sequence (`td.context.split` of ids, positions and labels). The loss (mean
over the group of each rank's mean) and every gradient (averaged by a DistributedOptimizer over
the group, or over dp x cp on a mesh) must equal the reference's to 1e-5, for a causal model and
a bidirectional one, at sp = 2 and 4.
"""

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tandem as td
from tandem.parallel import context as cp
from tandem.testing import run_distributed

BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="no mpi4py"))]
VOCAB, EMBED, HEADS, SEQ = 11, 16, 4, 16


class MhaBlock(nn.Module):
    """Pre-norm block whose attention is an nn.MultiheadAttention (called as models do)."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.ln1, self.ln2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.attn = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(EMBED, 2 * EMBED), nn.GELU(), nn.Linear(2 * EMBED, EMBED))

    def forward(self, x):
        h = self.ln1(x)
        if self.causal:  # the mask is only a hint under is_causal=True: SDPA builds its own
            mask = torch.empty(x.shape[1], x.shape[1])
            a = self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        else:
            a, _ = self.attn(h, h, h)
        x = x + a
        return x + self.mlp(self.ln2(x))


class SdpaBlock(nn.Module):
    """A block that calls F.scaled_dot_product_attention itself (nanoGPT's way)."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.qkv, self.proj = nn.Linear(EMBED, 3 * EMBED), nn.Linear(EMBED, EMBED)
        self.ln = nn.LayerNorm(EMBED)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (z.view(b, t, HEADS, e // HEADS).transpose(1, 2)
                   for z in self.qkv(self.ln(x)).split(e, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, e))


class TinyLM(nn.Module):
    def __init__(self, causal: bool = True):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, EMBED), nn.Embedding(SEQ, EMBED)
        self.blocks = nn.Sequential(MhaBlock(causal), SdpaBlock(causal))
        self.head = nn.Linear(EMBED, VOCAB)

    def forward(self, ids, positions):
        return self.head(self.blocks(self.embed(ids) + self.pos(positions)))


def _batch(step: int, rows: int = 4):
    generator = torch.Generator().manual_seed(700 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=generator)
    positions = torch.arange(SEQ).expand(rows, SEQ)
    return ids[:, :-1], positions, ids[:, 1:]


def _loss(model, ids, positions, labels):
    return F.cross_entropy(model(ids, positions).reshape(-1, VOCAB), labels.reshape(-1))


def _differences(name, got: dict, expected: dict, tol=1e-5) -> list[str]:
    errors = []
    for key in sorted(expected):
        a, b = got[key], expected[key]
        if not torch.allclose(a, b, rtol=tol, atol=tol):
            errors.append(f"rank {td.rank()} {name} {key}: max difference {(a - b).abs().max().item():.3g}")
    return errors


def check_matches_one_process(style: str, causal: bool, cp_size: int):
    """dp = world / cp_size replicas of a cp_size-way sequence split (dp x cp on a mesh)."""
    mesh = td.mesh(dp=td.size() // cp_size, cp=cp_size)
    torch.manual_seed(0)
    model = TinyLM(causal)
    reference = copy.deepcopy(model)
    cp.parallelize(model, group=mesh.cp_group, style=style)
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), group=mesh.dp_cp_group)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    errors = []
    for step in range(3):
        ids, positions, labels = _batch(step)
        rows = ids.shape[0] // mesh.dp
        mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)  # the dp split: rows
        parts = cp.split(ids[mine], positions[mine], labels[mine], seq_dim=1, group=mesh.cp_group)
        loss = _loss(model, *parts)
        ref_loss = _loss(reference, ids, positions, labels)
        loss.backward()
        ref_loss.backward()
        whole = td.allreduce(loss.detach(), op="mean", group=mesh.dp_cp_group)
        if abs(whole.item() - ref_loss.item()) > 1e-5:
            errors.append(f"step {step}: loss {whole.item()} != {ref_loss.item()}")
        errors += _differences(f"step {step} gradient", {k: p.grad for k, p in model.named_parameters()},
                               {k: p.grad for k, p in reference.named_parameters()})
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    errors += _differences("after 3 steps", model.state_dict(), reference.state_dict())
    return errors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", ["ring", "alltoall"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_two_ranks_match_one_process(backend, style, causal):
    assert run_distributed(check_matches_one_process, 2, backend, args=(style, causal, 2)) == [[], []]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", ["ring", "alltoall"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_four_ranks_match_one_process(backend, style, causal):
    """sp = 4 alone, then dp = 2 x cp = 2 on the same world."""
    assert run_distributed(check_matches_one_process, 4, backend, args=(style, causal, 4)) == [[]] * 4
    assert run_distributed(check_matches_one_process, 4, backend, args=(style, causal, 2)) == [[]] * 4
