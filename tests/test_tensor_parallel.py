"""Tensor parallelism and branches against the one-process model, on real Gloo and MPI worlds.

Every rank builds the one-process model from the same seed, keeps a copy as the reference,
converts the other with `td.parallelize`, and trains both on the same batches: the loss, every
gradient (gathered back to one-process shapes) and the parameters after 10 SGD-with-momentum
steps must match to 1e-5.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tandem as td
from tandem.testing import run_distributed

VOCAB, EMBED, HEADS, HIDDEN, SEQ = 12, 12, 6, 24, 5  # divisible by tp = 2 and 3
PLAN = {"embed": "embedding", "block.attn": "attention", "block.mlp.0": "colwise",
        "block.mlp.2": "rowwise", "head": "colwise"}


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, attention, LayerNorm, MLP, residuals."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.attn = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(EMBED, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, EMBED))

    def forward(self, x):
        h = self.ln1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        x = x + self.attn(h, h, h, need_weights=False, is_causal=True, attn_mask=mask)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.block = Block()
        self.head = nn.Linear(EMBED, VOCAB)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def _batch(step: int, rows: int = 4, first: int = 0, device: str = "cpu"):
    generator = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, VOCAB, (8, SEQ + 1), generator=generator)[first : first + rows].to(device)
    return ids[:, :-1], ids[:, 1:]


def _grads_as_full(model) -> dict:
    """The gradients, gathered to one-process shapes (parameters swapped with their grads)."""
    params = list(model.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return td.fsdp.full_state_dict(model)
    finally:
        for p, data in zip(params, saved, strict=True):
            p.data = data


def _differences(name, got: dict, expected: dict, tol=1e-5) -> list[str]:
    errors = [f"{name}: keys {sorted(set(got) ^ set(expected))}"] if set(got) != set(expected) else []
    for key in sorted(set(got) & set(expected)):
        a, b = got[key].cpu(), expected[key].cpu()
        if not torch.allclose(a, b, rtol=tol, atol=tol):
            worst = (a - b).abs().max().item()
            errors.append(f"rank {td.rank()} {name} {key}: max difference {worst:.3g}")
    return errors


def check_transformer_matches_one_process(device: str = "cpu"):
    """Models and data on `device` (test_cuda_parallel.py runs this on the GPU)."""
    torch.manual_seed(0)
    model = TinyLM().to(device)
    reference = copy.deepcopy(model)
    td.parallelize(model, PLAN)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    errors = []
    for step in range(10):
        ids, target = _batch(step, device=device)
        loss = td.tensor.vocab_parallel_cross_entropy(model(ids), target)
        ref_loss = F.cross_entropy(reference(ids).reshape(-1, VOCAB), target.reshape(-1))
        loss.backward()
        ref_loss.backward()
        if abs(loss.item() - ref_loss.item()) > 1e-5:
            errors.append(f"step {step}: loss {loss.item()} != {ref_loss.item()}")
        if step == 0:
            expected = {k: p.grad for k, p in reference.named_parameters()}
            errors += _differences("gradient", _grads_as_full(model), expected)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    errors += _differences("after 10 steps", td.fsdp.full_state_dict(model), reference.state_dict())
    return errors


class TwoBranch(nn.Module):
    """Two paths over the same input, concatenated or summed, then a shared head."""

    def __init__(self, join: str):
        super().__init__()
        self.paths = nn.ModuleList([nn.Sequential(nn.Linear(8, 6), nn.Tanh()),
                                    nn.Sequential(nn.Linear(8, 6), nn.ReLU())])
        self.join = join
        self.head = nn.Linear(12 if join == "cat" else 6, 3)

    def forward(self, x):
        outputs = [path(x) for path in self.paths]
        return self.head(torch.cat(outputs, -1) if self.join == "cat" else sum(outputs))


class Joined(nn.Module):
    """TwoBranch with its paths on the two ranks."""

    def __init__(self, model: TwoBranch):
        super().__init__()
        self.branches = td.tensor.Branches(list(model.paths), join=model.join)
        self.head = model.head

    def forward(self, x):
        return self.head(self.branches(x))


def check_branches_match_one_process():
    errors = []
    for join in ("cat", "sum"):
        torch.manual_seed(1)
        reference = TwoBranch(join)
        model = Joined(copy.deepcopy(reference))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2)).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        out, ref_out = model(x), reference(x_ref)
        out.square().sum().backward()
        ref_out.square().sum().backward()
        if not torch.allclose(out, ref_out, atol=1e-6):
            errors.append(f"{join}: output differs")
        if not torch.allclose(x.grad, x_ref.grad, atol=1e-6):
            errors.append(f"{join}: input gradient differs")
        mine = reference.paths[td.rank()]
        for p, q in zip(model.branches.mine[0].parameters(), mine.parameters(), strict=True):
            if not torch.allclose(p.grad, q.grad, atol=1e-6):
                errors.append(f"{join}: branch {td.rank()} gradient differs")
        if not torch.allclose(model.head.weight.grad, reference.head.weight.grad, atol=1e-6):
            errors.append(f"{join}: head gradient differs")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        for _ in range(10):  # the first step's gradients are already there
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            model(x.detach()).square().sum().backward()
            reference(x.detach()).square().sum().backward()
        trained = {**{f"path.{k}": v for k, v in model.branches.mine[0].state_dict().items()},
                   **{f"head.{k}": v for k, v in model.head.state_dict().items()}}
        expected = {**{f"path.{k}": v for k, v in mine.state_dict().items()},
                    **{f"head.{k}": v for k, v in reference.head.state_dict().items()}}
        errors += _differences(f"{join} after 10 steps", trained, expected)
    return errors


def check_dp_times_tp():
    """dp=2 × tp=2: each replica trains on half of the batch; gradients averaged over dp only."""
    mesh = td.mesh(dp=2, tp=2)
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    td.parallelize(model, PLAN, group=mesh.tp_group)
    opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), group=mesh.dp_group)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        ids, target = _batch(step, rows=2, first=2 * mesh.dp_rank)
        td.tensor.vocab_parallel_cross_entropy(model(ids), target, group=mesh.tp_group).backward()
        opt.step()
        opt.zero_grad()
        ids, target = _batch(step)
        F.cross_entropy(reference(ids).reshape(-1, VOCAB), target.reshape(-1)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return _differences("dp x tp after 5 steps", td.fsdp.full_state_dict(model), reference.state_dict())


def check_bad_input():
    messages = []
    for plan, kind in [({"embed": "colwise"}, TypeError), ({"blok.attn": "attention"}, ValueError),
                       ({"head": "diagonal"}, ValueError)]:
        try:
            td.parallelize(TinyLM(), plan)
        except kind as error:
            messages.append(str(error))
    try:
        td.tensor.ColumnParallelLinear(8, 10)  # 10 rows on 3 ranks
    except ValueError as error:
        messages.append(str(error))
    return messages


def check_attention_masks_match_one_process():
    """Every mask nn.MultiheadAttention takes means the same to the tensor-parallel layer: a
    boolean one (True = not attended, the reverse of SDPA's), a float one, one per batch row and
    head (3-D, this rank keeps its heads), and the `is_causal` hint beside the causal mask."""
    torch.manual_seed(3)
    reference = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
    model = nn.Sequential(copy.deepcopy(reference))
    td.parallelize(model, {"0": "attention"})
    x = torch.randn(2, SEQ, EMBED)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
    per_head = torch.randn(2 * HEADS, SEQ, SEQ)
    cases = {"bool causal": {"attn_mask": causal},
             "float causal": {"attn_mask": nn.Transformer.generate_square_subsequent_mask(SEQ)},
             "per head": {"attn_mask": per_head},
             "per head, bool": {"attn_mask": per_head > 0.5},
             "is_causal hint": {"attn_mask": causal, "is_causal": True}}
    errors = []
    for name, masks in cases.items():
        got = model[0](x, x, x, need_weights=False, **masks)[0]
        expected = reference(x, x, x, need_weights=False, **masks)[0]
        if not torch.allclose(got, expected, atol=1e-5):
            errors.append(f"rank {td.rank()} {name}: max difference "
                          f"{(got - expected).abs().max().item():.3g}")
    return errors


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_attention_masks_mean_what_they_mean_to_multihead_attention(backend):
    results = run_distributed(check_attention_masks_match_one_process, 3, backend)
    assert results == [[]] * 3, "\n".join(e for errors in results for e in errors)


@pytest.mark.parametrize("backend,world_size", [("gloo", 2), ("gloo", 3), ("mpi", 2), ("mpi", 3)])
def test_transformer_block_equals_one_process(backend, world_size):
    results = run_distributed(check_transformer_matches_one_process, world_size, backend)
    assert results == [[]] * world_size, "\n".join(e for errors in results for e in errors)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_two_branches_on_two_ranks_equal_one_process(backend):
    results = run_distributed(check_branches_match_one_process, 2, backend)
    assert results == [[], []], results


def test_data_parallel_times_tensor_parallel_equals_one_process():
    results = run_distributed(check_dp_times_tp, 4, "gloo", timeout=240)
    assert results == [[]] * 4, "\n".join(e for errors in results for e in errors)


def test_bad_plans_and_sizes_are_named():
    messages = run_distributed(check_bad_input, 3, "gloo")[0]
    assert len(messages) == 4, messages
    assert "needs an nn.Linear, but 'embed' is Embedding" in messages[0]
    assert "'blok.attn', which is not a layer of TinyLM; did you mean 'block.attn'" in messages[1]
    assert "'diagonal': choose one of colwise" in messages[2]
    assert "out_features = 10 is not divisible by tp = 3" in messages[3]
    assert "e.g. 9 or 12" in messages[3]


def check_half_precision_loss():
    """bf16 logit slices: the loss is float32's, the gradient comes back in bf16."""
    generator = torch.Generator().manual_seed(7)
    full = torch.randn(6, 4 * td.size(), generator=generator)
    target = torch.randint(full.shape[1], (6,), generator=generator)
    mine = full.chunk(td.size(), dim=1)[td.rank()].bfloat16().requires_grad_()
    loss = td.tensor.vocab_parallel_cross_entropy(mine, target)
    loss.backward()
    reference = full.bfloat16().float().requires_grad_()
    F.cross_entropy(reference, target).backward()
    expected = reference.grad.chunk(td.size(), dim=1)[td.rank()]
    return (loss.dtype == torch.float32 and mine.grad.dtype == torch.bfloat16
            and abs(loss.item() - F.cross_entropy(reference, target).item()) < 1e-6
            and torch.allclose(mine.grad.float(), expected, atol=1e-2))


def test_half_precision_logits_are_reduced_in_float32():
    assert run_distributed(check_half_precision_loss, 2, "gloo") == [True, True]


def check_mismatched_groups():
    groups = [td.new_group([0, 1]), td.new_group([1, 2]), td.new_group([0, 2])]
    try:
        td.parallelize(TinyLM(), PLAN, group=groups[td.rank()])
    except td.CollectiveMismatchError as error:
        return str(error)
    return "no error"


def test_ranks_with_different_tp_groups_are_named():
    messages = run_distributed(check_mismatched_groups, 3, "gloo")
    assert len(set(messages)) == 1, messages  # the same error on every rank
    assert "rank 0 uses tp group [0, 1], but rank 1 of it uses [1, 2]" in messages[0]


def check_save_consolidated(path):
    torch.manual_seed(0)
    model = td.parallelize(TinyLM(), PLAN)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, target = _batch(0)
    td.tensor.vocab_parallel_cross_entropy(model(ids), target).backward()
    opt.step()
    td.save(td.fsdp.full_state_dict(model), path)  # every rank calls it; rank 0 writes
    return td.tensor.vocab_parallel_cross_entropy(model(ids), target).item()


def check_load_resharded(path):
    model = TinyLM()
    model.load_state_dict(td.load(path))  # the one-process state: any tp size can load it
    td.parallelize(model, PLAN)
    ids, target = _batch(0)
    return td.tensor.vocab_parallel_cross_entropy(model(ids), target).item()


def test_checkpoint_saved_at_tp3_loads_at_tp2(tmp_path):
    path = str(tmp_path / "tp.pt")
    saved = run_distributed(check_save_consolidated, 3, "gloo", args=(path,))
    loaded = run_distributed(check_load_resharded, 2, "gloo", args=(path,))
    assert loaded == pytest.approx([saved[0]] * 2, abs=1e-6)


def _stages():
    torch.manual_seed(3)
    return [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)),
            nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))]


def check_tp_inside_pipeline_stages():
    """pp=2 stages, each split over tp=2: 2 SGD steps equal the one-process model."""
    mesh = td.mesh(pp=2, tp=2)
    plan = {"0": "colwise", "2": "rowwise"}

    def stage(i):
        return lambda: td.parallelize(_stages()[i], plan, group=mesh.tp_group)

    pipe = td.Pipeline([stage(0), stage(1)], chunks=2, group=mesh.pp_group)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    reference = nn.Sequential(*_stages())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    y = torch.randn(4, 4, generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        pipe.train_step(x, y, F.mse_loss)
        opt.step()
        opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    mine = td.fsdp.full_state_dict(pipe.stage)
    expected = {k: v for k, v in reference[mesh.pp_rank].state_dict().items()}
    return _differences("tp inside pp", mine, expected)


def test_tensor_parallel_inside_pipeline_stages_equals_one_process():
    results = run_distributed(check_tp_inside_pipeline_stages, 4, "gloo", timeout=240)
    assert results == [[]] * 4, "\n".join(e for errors in results for e in errors)
