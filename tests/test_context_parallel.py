"""Context parallelism (td.context) against one process, on real Gloo and MPI worlds.

Every rank builds the one-process model from the same seed and keeps a copy as the reference;
the other is converted with `td.context.parallelize` (ring or all-to-all) and runs on this
rank's part of each sequence (`td.context.split` of ids, positions and labels). The loss (mean
over the group of each rank's mean) and every gradient (averaged by a DistributedOptimizer over
the group, or over dp x cp on a mesh) must equal the reference's to 1e-5, for a causal model and
a bidirectional one, at sp = 2 and 4; and so must `torch.compile` of the split model (its
attention calls the split's operators inside the graph), with activation checkpointing too.
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
    model.eval()
    reference.eval()
    with torch.no_grad():  # evaluation too (nn.MultiheadAttention's fast path is not taken)
        logits = cp.gather(model(*parts[:2]), seq_dim=1, group=mesh.cp_group)
        expected = reference(ids[mine], positions[mine])
    errors += _differences("evaluation", {"logits": logits}, {"logits": expected})
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


class Skipper(nn.Module):
    """Two attention blocks; rank 1 skips the first one in its first forward."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([SdpaBlock(True), SdpaBlock(True)])

    def forward(self, x, skip: bool):
        for i, block in enumerate(self.blocks):
            if not (skip and i == 0):
                x = block(x)
        return x


class NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(EMBED, EMBED)

    def forward(self, x):
        return self.mlp(x)


class MaskedSdpa(nn.Module):
    def __init__(self, mask_length: int):
        super().__init__()
        self.mask_length = mask_length
        self.qkv = nn.Linear(EMBED, 3 * EMBED)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (z.view(b, t, HEADS, e // HEADS).transpose(1, 2) for z in self.qkv(x).split(e, dim=2))
        n = self.mask_length
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def check_bad_inputs():
    """Each case's error, on every rank (sp = 2); the ranks keep going after each."""
    torch.manual_seed(0)
    x = torch.randn(2, SEQ, EMBED)
    found = {}
    odd_heads = nn.Sequential(nn.MultiheadAttention(12, 3, batch_first=True))
    found["heads"] = _error(lambda: cp.parallelize(odd_heads, style="alltoall"))
    found["length"] = _error(lambda: cp.split(torch.zeros(2, 10), seq_dim=1))
    masked = cp.parallelize(MaskedSdpa(SEQ), style="ring")
    found["ring mask"] = _error(lambda: masked(cp.split(x)))
    local_mask = cp.parallelize(MaskedSdpa(SEQ // 2), style="alltoall")
    found["local mask"] = _error(lambda: local_mask(cp.split(x)))
    whole_mask = cp.parallelize(MaskedSdpa(SEQ), style="alltoall")  # a mask over the whole sequence
    reference = F.scaled_dot_product_attention(
        *(z.view(2, SEQ, HEADS, -1).transpose(1, 2) for z in whole_mask.qkv(x).split(EMBED, dim=2)),
        attn_mask=torch.ones(SEQ, SEQ, dtype=torch.bool).tril())
    found["whole mask equal"] = torch.allclose(whole_mask(cp.split(x)), cp.split(reference, seq_dim=2),
                                               atol=1e-6)
    none = cp.parallelize(NoAttention())
    found["no attention"] = _error(lambda: none(cp.split(x)))
    weights = cp.parallelize(MhaBlock(False))
    found["weights"] = _error(lambda: weights.attn(x, x, x, need_weights=True))
    for style in ("ring", "alltoall"):
        skipper = cp.parallelize(Skipper(), style=style)
        found[f"skip {style}"] = _error(lambda s=skipper: s(cp.split(x), td.rank() == 1))
        # the ranks meet again: a forward that every rank runs whole still works
        found[f"after skip {style}"] = tuple(skipper(cp.split(x), False).shape)
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_are_named(backend):
    results = run_distributed(check_bad_inputs, 2, backend)
    assert results[0] == results[1] or all(r.keys() == results[0].keys() for r in results)
    for found in results:
        assert "3 attention heads" in found["heads"] and "style='ring'" in found["heads"], found["heads"]
        assert "SequenceSplitError" in found["length"] and "multiple of 4" in found["length"]
        assert "Pad the batch to 12" in found["length"], found["length"]
        assert "ContextParallelError" in found["ring mask"] and "style='alltoall'" in found["ring mask"]
        assert "whole sequence's (query, key) = (16, 16)" in found["local mask"], found["local mask"]
        assert found["whole mask equal"]
        assert "made no attention call" in found["no attention"], found["no attention"]
        assert "need_weights=False" in found["weights"], found["weights"]
        for style in ("ring", "alltoall"):
            error = found[f"skip {style}"]
            assert error.startswith("DivergedError"), error
            assert "rank 0: attention call #1 of this forward of Skipper, in 'blocks.0'" in error, error
            assert "rank 1: attention call #1 of this forward of Skipper, in 'blocks.1'" in error, error
            assert found[f"after skip {style}"] == (2, SEQ // 2, EMBED)


def test_head_tail_layout_and_blocks_without_processes():
    """The layout's pure functions, and the ring's block kernels (fused CPU and plain math)
    against plain attention: outputs, log-sum-exps and the flash-style backward."""
    from tandem.parallel.context import layout, ring

    assert layout.chunk_order(2) == [0, 3, 1, 2]
    assert layout.positions_of(1, 2, 8).tolist() == [2, 3, 4, 5]
    assert sorted(layout.gathered_positions(4, 16).tolist()) == list(range(16))
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for causal in (True, False):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        dout = torch.randn_like(expected)
        grads = torch.autograd.grad(expected, (q, k, v), dout)
        for fused in (True, False):
            ring._fused, kernel = (lambda t, f=fused: f), ring._fused
            try:
                out, lse = ring._block(q.detach(), k.detach(), v.detach(), 0.5, causal)
                got = ring._block_backward(dout, q.detach(), k.detach(), v.detach(), out, lse,
                                           0.5, causal)
            finally:
                ring._fused = kernel
            assert torch.allclose(out, expected, atol=1e-10), (causal, fused)
            for a, b in zip(got, grads, strict=True):
                assert torch.allclose(a, b, atol=1e-10), (causal, fused)


def check_checkpointed_matches_one_process(style: str):
    """Blocks recomputed in backward (td.checkpoint_wrapper, then the split): the recomputed
    attention runs over the group again, and the gradients are one process's."""
    torch.manual_seed(0)
    model = TinyLM(True)
    reference = copy.deepcopy(model)
    td.memory.checkpoint_wrapper(model, policy=(MhaBlock, SdpaBlock))
    cp.parallelize(model, style=style)
    ids, positions, labels = _batch(0)
    _loss(model, *cp.split(ids, positions, labels)).backward()
    _loss(reference, ids, positions, labels).backward()
    grads = {k: td.allreduce(p.grad, op="mean") for k, p in model.named_parameters()}
    return _differences("checkpointed gradient", grads,
                        {k: p.grad for k, p in reference.named_parameters()})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", ["ring", "alltoall"])
def test_activation_checkpointing_matches_one_process(backend, style):
    assert run_distributed(check_checkpointed_matches_one_process, 2, backend, args=(style,)) == [[], []]


def check_operations_per_step(checks: bool) -> dict:
    """Operations issued and host reads of one training step of one attention block."""
    import test_hot_paths as hot

    from tandem import runtime

    runtime.state().checks = checks  # read when the model is converted, as by td.init(checks=)
    try:
        counted = {}
        for style in ("ring", "alltoall"):
            torch.manual_seed(0)
            model = cp.parallelize(SdpaBlock(True), style=style)
            x = cp.split(torch.randn(2, SEQ, EMBED))
            counted[style] = [hot._per_step(lambda m=model, x=x: m(x).square().mean().backward())
                              for _ in range(2)][1]
    finally:
        runtime.state().checks = True
    return counted


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_makes_the_theoretical_messages_and_no_agreement_of_its_own(backend):
    on, off = (run_distributed(check_operations_per_step, 2, backend, args=(flag,))[0]
               for flag in (True, False))
    # sp = 2. Ring: one exchange forward (a send and a receive), two backward (the block with
    # its gradients, then the gradients home). All-to-all: two forward, two backward.
    assert off == {"ring": (6, []), "alltoall": (4, [])}, off
    # With checks, the model's forward and backward each open with one agreement; the
    # attention calls add none (their headers ride in the messages, read where they arrived).
    assert on["ring"][0] == 8 and on["alltoall"][0] == 6, on
    assert set(on["ring"][1]) | set(on["alltoall"][1]) == {"tolist"}, on


def check_checkpoint_round_trip(directory: str):
    """Save a split model and its optimizer after 2 steps, restore them into fresh ones (their
    values overwritten), take a third step: one process's parameters after 3 steps."""
    def build():
        torch.manual_seed(0)
        model = cp.parallelize(TinyLM(True), style="ring")
        opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=model.named_parameters())
        return model, opt

    def train(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            _loss(model, *cp.split(*_batch(step))).backward()
            opt.step()

    model, opt = build()
    train(model, opt, range(2))
    td.Checkpointer(directory, keep=1).save(1, model=model, optimizer=opt)
    fresh, fresh_opt = build()
    with torch.no_grad():
        for p in fresh.parameters():
            p.fill_(0.5)  # the checkpoint, not the seed, must bring the values back
    restored = td.Checkpointer(directory).restore(model=fresh, optimizer=fresh_opt)
    train(fresh, fresh_opt, range(2, 3))
    torch.manual_seed(0)
    reference = TinyLM(True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        ref_opt.zero_grad()
        _loss(reference, *_batch(step)).backward()
        ref_opt.step()
    return restored, _differences("restored and trained", fresh.state_dict(), reference.state_dict())


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_restores_a_split_model(backend, tmp_path):
    assert run_distributed(check_checkpoint_round_trip, 2, backend, args=(str(tmp_path),)) == [(2, [])] * 2


# -- torch.compile ------------------------------------------------------------------------------


class MixedLM(TinyLM):
    """TinyLM with a causal nn.MultiheadAttention block and a bidirectional SDPA one: both
    masks and both ways to attention in one compiled graph."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(MhaBlock(True), SdpaBlock(False))


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def check_compiled_matches_one_process(style: str, compiler: str, checkpointed: bool, evaluate: bool):
    """torch.compile of the whole split model against the eager one-process model: 3 training
    steps (and an evaluation), loss and every gradient to 1e-5. Returns the errors, the
    attention calls counted in each forward (as the graph ran) and the graph breaks of the
    first step (the model's entry and exit, where its agreement and its mode run outside the
    graph; none at an attention call), none after it."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = MixedLM()
    reference = copy.deepcopy(model)
    if checkpointed:
        td.memory.checkpoint_wrapper(model, policy=(MhaBlock, SdpaBlock))
    cp.parallelize(model, style=style)
    compiled = torch.compile(model, backend=compiler)
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    split = cp.apply._converted[model]
    errors, calls = [], []
    for step in range(3):
        ids, positions, labels = _batch(step)
        loss = _loss(compiled, *cp.split(ids, positions, labels))
        calls.append(split.calls)
        ref_loss = _loss(reference, ids, positions, labels)
        loss.backward()
        ref_loss.backward()
        whole = td.allreduce(loss.detach(), op="mean")
        if abs(whole.item() - ref_loss.item()) > 1e-5:
            errors.append(f"step {step}: loss {whole.item()} != {ref_loss.item()}")
        errors += _differences(f"step {step} gradient", {k: p.grad for k, p in model.named_parameters()},
                               {k: p.grad for k, p in reference.named_parameters()})
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if step == 0:
            breaks = _graph_breaks()
    if _graph_breaks() != breaks:
        errors.append(f"graph breaks after the first step: {breaks} -> {_graph_breaks()}")
    if evaluate:
        model.eval()
        reference.eval()
        with torch.no_grad():
            logits = cp.gather(compiled(*cp.split(ids, positions)), seq_dim=1)
            expected = reference(ids, positions)
        errors += _differences("evaluation", {"logits": logits}, {"logits": expected})
    return errors, calls, breaks


def _assert_compiled(results):
    for errors, calls, breaks in results:
        assert errors == [], errors
        assert calls == [2, 2, 2], calls  # the two blocks' attention, counted as the graph ran
        assert breaks <= 2, breaks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", ["ring", "alltoall"])
def test_compiled_model_matches_one_process(backend, style):
    """AOTAutograd's graphs (backend="aot_eager"): the split's operators and their backward."""
    _assert_compiled(run_distributed(check_compiled_matches_one_process, 2, backend,
                                     args=(style, "aot_eager", False, True), timeout=600))


def test_compiled_by_inductor_matches_one_process():
    """The default compiler: inductor's code calls the ring's operators (their fakes' shapes
    and strides hold, forward and backward)."""
    _assert_compiled(run_distributed(check_compiled_matches_one_process, 2, "gloo",
                                     args=("ring", "inductor", False, False), timeout=900))


@pytest.mark.parametrize(("backend", "style"), [("gloo", "ring"), pytest.param(
    "mpi", "alltoall", marks=BACKENDS[1].marks)])
def test_compiled_and_checkpointed_matches_one_process(backend, style):
    """td.checkpoint_wrapper under torch.compile: each checkpointed block runs outside the
    graph, eagerly, under the split (a break at each, none elsewhere), and its recomputation
    attends over the group again."""
    for errors, calls, breaks in run_distributed(check_compiled_matches_one_process, 2, backend,
                                                 args=(style, "aot_eager", True, False),
                                                 timeout=600):
        assert errors == [], errors
        assert calls == [2, 2, 2], calls
        assert breaks <= 2 + 2, breaks


def check_compiled_divergence(style: str):
    """A compiled Skipper whose rank 1 skips the first block (its graph has one attention call
    fewer): every rank names each rank's call (the headers ride in the operators' messages); a
    model without attention is named compiled too."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(2, SEQ, EMBED)
    found = {}
    skipper = torch.compile(cp.parallelize(Skipper(), style=style), backend="aot_eager")
    found["skip"] = _error(lambda: skipper(cp.split(x), td.rank() == 1))
    found["after skip"] = tuple(skipper(cp.split(x), False).shape)
    none = torch.compile(cp.parallelize(NoAttention()), backend="aot_eager")
    found["no attention"] = _error(lambda: none(cp.split(x)))
    return found


@pytest.mark.parametrize(("backend", "style"), [("gloo", "ring"), pytest.param(
    "mpi", "alltoall", marks=BACKENDS[1].marks)])
def test_compiled_rank_that_skips_an_attention_call_is_named(backend, style):
    for found in run_distributed(check_compiled_divergence, 2, backend, args=(style,), timeout=600):
        error = found["skip"]
        assert error.startswith("DivergedError"), error
        assert "rank 0: attention call #1 of this forward of Skipper, in 'blocks.0'" in error, error
        assert "rank 1: attention call #1 of this forward of Skipper, in 'blocks.1'" in error, error
        assert found["after skip"] == (2, SEQ // 2, EMBED)  # the ranks meet again
        assert "made no attention call" in found["no attention"], found["no attention"]
