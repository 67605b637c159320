"""Every torch optimizer under every way of splitting equals one process, or is refused with
the reason and the alternative (issue 40). One world per engine steps every optimizer in turn.
HSDP (td.fully_shard over td.mesh(dp=2, shard=2), 4 ranks) refuses as fully_shard does; a
td.Pipeline of 2 stages gives each rank whole parameters (its stage's), so any optimizer is
exact there.

fully_shard hands the optimizer flat 1-D shards, tensor parallelism slices of each matrix: exact
for an element-wise update (SGD, Adam, ...), another algorithm for Adafactor, Muon or LAMB, which
are refused there (`parallel/layout/elementwise.py`). ZeroOptimizer shards those by whole
parameters (each stepped whole by one rank): exact too. DistributedOptimizer and the DDP wrapper
keep the whole parameters on every rank: any optimizer is exact there. Sharded cells
(ZeroOptimizer's flat Adam and whole Muon, fully_shard's Adam) saved by td.Checkpointer on 2
ranks and restored on 3 go on as one process.
"""

import pytest
import torch

import tandem as td
from tandem.parallel.layout.elementwise import why_not_elementwise
from tandem.testing import run_distributed

STEPS = 3
ROWS = 8


class Lamb(torch.optim.Optimizer):
    """A short LAMB: Adam's direction scaled by the trust ratio ||p|| / ||update|| per tensor."""

    def __init__(self, params, lr=0.01, betas=(0.9, 0.999), eps=1e-6):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = state["m"] / (state["v"].sqrt() + group["eps"])
                ratio = p.norm() / update.norm().clamp(min=1e-12)
                p.add_(update, alpha=-group["lr"] * float(ratio))


class HandSgd(torch.optim.Optimizer):
    """A user's element-wise optimizer tandem does not know: the probe accepts it."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


optim = torch.optim
OPTIMIZERS = {  # name -> a maker over parameters
    "SGD momentum nesterov": lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "Adam": lambda ps: optim.Adam(ps, lr=0.01),
    "AdamW amsgrad": lambda ps: optim.AdamW(ps, lr=0.01, amsgrad=True),
    "Adamax": lambda ps: optim.Adamax(ps, lr=0.01),
    "NAdam": lambda ps: optim.NAdam(ps, lr=0.01),
    "RAdam": lambda ps: optim.RAdam(ps, lr=0.01),
    "Adagrad": lambda ps: optim.Adagrad(ps, lr=0.05),
    "Adadelta": lambda ps: optim.Adadelta(ps, lr=0.5),
    "RMSprop": lambda ps: optim.RMSprop(ps, lr=0.01),
    "Rprop": lambda ps: optim.Rprop(ps, lr=0.01),
    "ASGD": lambda ps: optim.ASGD(ps, lr=0.05),
    "Adafactor": lambda ps: optim.Adafactor(ps, lr=0.01),
    "Muon": lambda ps: optim.Muon(ps, lr=0.01),
    "Lamb (hand-written)": lambda ps: Lamb(ps),
    "HandSgd (unknown, element-wise)": lambda ps: HandSgd(ps),
}
NOT_ELEMENTWISE = {"Adafactor", "Muon", "Lamb (hand-written)"}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # matrices only: Muon steps 2-D parameters alone
    return torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3, bias=False))


def _batch(step: int, rows: int = ROWS):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 6, generator=generator), torch.randn(rows, 3, generator=generator)


def _train(model, optimizer, rows, steps=range(STEPS), batch_rows=ROWS) -> None:
    for step in steps:
        x, y = _batch(step, batch_rows)
        optimizer.zero_grad()
        if isinstance(model, td.Pipeline):  # x read on the first stage, y on the last
            model.train_step(x, y, torch.nn.functional.mse_loss)
        else:
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()


def _wrapped(wrapper: str, make):
    """(the model, what the loop calls, the optimizer) for `wrapper`."""
    model = _model()
    if wrapper == "ZeroOptimizer":
        return model, model, td.ZeroOptimizer(make(model.parameters()))
    if wrapper == "DistributedOptimizer":
        return model, model, td.DistributedOptimizer(make(model.parameters()))
    if wrapper == "fully_shard":
        td.fully_shard(model)
    elif wrapper == "HSDP":  # 2 replicas of 2 shards
        td.fully_shard(model, mesh=td.mesh(dp=2, shard=2))
    elif wrapper == "pipeline":  # 2 stages, each rank its own stage's parameters
        pipe = td.Pipeline(model, chunks=2)
        return pipe, pipe, make(pipe.parameters())
    elif wrapper == "tensor parallel":
        td.parallelize(model, {"0": "colwise", "2": "rowwise"})
    else:
        return model, td.DistributedDataParallel(model), make(model.parameters())
    return model, model, make(model.parameters())


def check_matrix(wrapper: str):
    td.init()
    share = ROWS // td.size()
    mine = slice(td.rank() * share, (td.rank() + 1) * share)
    if wrapper in ("tensor parallel", "pipeline"):  # every rank computes on the whole batch
        mine = slice(None)
    outcome = {}
    for name, make in OPTIMIZERS.items():
        reference = _model()
        _train(reference, make(reference.parameters()), slice(None))
        try:
            model, net, optimizer = _wrapped(wrapper, make)
            _train(net, optimizer, mine)
        except ValueError as refusal:
            outcome[name] = ("refused", str(refusal))
            continue
        full = td.fsdp.full_state_dict(model)  # the one-process tensors, gathered where split
        outcome[name] = ("difference", max((full[k] - v).abs().max().item()
                                           for k, v in reference.state_dict().items()))
    return outcome


SHARDED = {"fully_shard": "td.DistributedDataParallel",  # ZeroOptimizer: whole parameters
           "HSDP": "td.DistributedDataParallel",  # a Pipeline's stages: whole parameters too
           "tensor parallel": "element-wise optimizer"}
WORLD = {"HSDP": 4}  # td.mesh(dp=2, shard=2); the others 2 ranks (a pipeline: 2 stages)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("wrapper", ["ZeroOptimizer", "fully_shard", "HSDP", "tensor parallel",
                                     "pipeline", "DistributedOptimizer", "DDP"])
def test_every_optimizer_equals_one_process_or_is_refused_with_the_reason(wrapper, backend):
    outcomes = run_distributed(check_matrix, WORLD.get(wrapper, 2), backend, args=(wrapper,))
    assert all(outcome.keys() == outcomes[0].keys() for outcome in outcomes)
    for name in OPTIMIZERS:
        for outcome in outcomes[1:]:  # every rank the same outcome (a refusal on all of them)
            assert outcome[name][0] == outcomes[0][name][0], (name, outcome[name], outcomes[0][name])
        kind, value = outcomes[0][name]
        if wrapper in SHARDED and name in NOT_ELEMENTWISE:
            assert kind == "refused", f"{name}: {value}"
            if wrapper in ("fully_shard", "HSDP") and name == "Muon":
                assert "Muon only supports 2D parameters" in value  # torch's, at construction
                continue
            short = name.split(" ")[0]
            split = "tensor parallelism" if wrapper == "tensor parallel" else "td.fully_shard"
            assert f"{short} under {split}" in value and SHARDED[wrapper] in value, value
            assert "optimizer.elementwise = True" in value
        else:
            assert kind == "difference", f"{name} under {wrapper}: {value}"
            assert value < 1e-6, f"{name} under {wrapper}: {value} from one process"


def test_the_rule_knows_torchs_optimizers_and_probes_the_others():
    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert why_not_elementwise(torch.optim.AdamW(params, amsgrad=True)) is None
    assert "factors its second moment" in why_not_elementwise(torch.optim.Adafactor(params))
    assert "needs a closure" in why_not_elementwise(torch.optim.LBFGS(params))
    assert "updates a tensor as a whole" in why_not_elementwise(Lamb(params))
    assert why_not_elementwise(HandSgd(params)) is None


class NeedsClosure(torch.optim.Optimizer):
    """An optimizer the probe cannot run: its step needs a closure."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    def step(self, closure):
        loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"])
        return loss


def check_unclassifiable_optimizer():
    td.init()
    model = _model()
    try:
        td.ZeroOptimizer(NeedsClosure(model.parameters()))
    except ValueError as refusal:
        message = str(refusal)
    else:
        message = None
    said = td.ZeroOptimizer(NeedsClosure(model.parameters()), elementwise=True)
    return message, type(said).__name__


def test_an_optimizer_tandem_cannot_classify_is_refused_with_the_flag_and_the_flag_settles_it():
    message, built = run_distributed(check_unclassifiable_optimizer, 2)[0]
    assert "NeedsClosure under td.ZeroOptimizer" in message
    assert "could not be checked" in message and "optimizer.elementwise = True" in message
    assert built == "ZeroOptimizer"


RESHARDED = {"ZeroOptimizer": ["Adam", "Muon"], "fully_shard": ["Adam"]}  # flat and whole


def check_resharded(wrapper: str, directory: str, first: int, last: int):
    """Restore (after `first` steps) on this world, train to `last`, save: each optimizer's
    difference from one process after `last` steps. 12 rows: 6 or 4 per rank."""
    td.init()
    share = 12 // td.size()
    mine = slice(td.rank() * share, (td.rank() + 1) * share)
    outcome = {}
    for name in RESHARDED[wrapper]:
        make = OPTIMIZERS[name]
        reference = _model()
        _train(reference, make(reference.parameters()), slice(None), range(last), 12)
        model, net, optimizer = _wrapped(wrapper, make)
        checkpointer = td.Checkpointer(f"{directory}/{name}", keep=1)
        if first:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(0.5)  # the checkpoint, not the seed, must bring the values back
            assert checkpointer.restore(model=model, optimizer=optimizer) == first  # the next step
        _train(net, optimizer, mine, range(first, last), 12)
        checkpointer.save(last - 1, model=model, optimizer=optimizer)
        full = td.fsdp.full_state_dict(model)
        outcome[name] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return outcome


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_sharded_optimizer_resumes_from_2_ranks_on_3_as_one_process(backend, tmp_path):
    for wrapper in RESHARDED:
        for world, first, last in ((2, 0, 2), (3, 2, 3)):
            for rank, outcome in enumerate(run_distributed(
                    check_resharded, world, backend, args=(wrapper, str(tmp_path / wrapper), first, last))):
                for name, diff in outcome.items():
                    assert diff < 1e-6, (wrapper, name, world, rank, diff)
