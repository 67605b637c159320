"""Every torch optimizer under every way of splitting equals one process, or is refused with
the reason and the alternative (issue 40). One world per engine steps every optimizer in turn.
HSDP (td.fully_shard over td.mesh(dp=2, shard=2), 4 ranks) refuses as fully_shard does; a
td.Pipeline of 2 stages gives each rank whole parameters (its stage's), so any optimizer that steps
each tensor on its own is exact there.

fully_shard hands the optimizer flat 1-D shards, tensor parallelism slices of each matrix: exact
for an element-wise update (SGD, Adam, ...), another algorithm for Adafactor, Muon or LAMB, which
are refused there (`parallel/layout/elementwise.py`). ZeroOptimizer shards those by whole
parameters (each stepped whole by one rank): exact too. DistributedOptimizer and the DDP wrapper
keep the whole parameters on every rank: any optimizer is exact there. td.tensor.Branches gives
each rank whole branches (3 towers on 2 ranks: 1 tensor and 3): any optimizer that steps each
tensor on its own is exact there, alone or with ZeroOptimizer, DistributedOptimizer or DDP over
mesh.dp_group (dp=2 x tp=2, 4 ranks). LBFGS, whose step couples every parameter through one
history and calls a closure, is exact under DDP (each backward the closure runs is averaged) and
refused with the alternative everywhere else. SparseAdam trains a model whose every gradient is
sparse (nn.Embedding(sparse=True)): exact where ranks step whole tensors (a Pipeline's stages,
Branches alone), refused where gradients are averaged or cut (DistributedOptimizer, DDP,
ZeroOptimizer, fully_shard, HSDP, a vocabulary-parallel embedding), each naming SparseAdam and
tandem.horovod's hvd.DistributedOptimizer, which averages sparse gradients. Muon under
fully_shard and HSDP is refused at its construction (the shards are flat: torch's "only supports
2D parameters", with the cause and td.ZeroOptimizer, which steps each matrix whole).

Every optimizer a sharded wrapper takes (ZeroOptimizer: 14, fully_shard: 12) is saved by
td.Checkpointer on 2 ranks (HSDP: 4) and restored on 3 (HSDP's as fully_shard), and shrunk
from 3 ranks to 2 in memory the way td.elastic does after a lost rank (each rank's part as a
State commit takes it, the survivors' layout filled by the box intersection over the wire,
`elastic/transfer.reshard`): both go on as one process. (td.elastic.State refuses HSDP: its
mesh cannot change size.)
"""

import functools

import pytest
import torch

import tandem as td
from tandem.elastic import transfer
from tandem.parallel.layout import state_pieces
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
    "LBFGS": lambda ps: optim.LBFGS(ps, lr=0.5, max_iter=3),  # its step calls the closure
    "SparseAdam": lambda ps: optim.SparseAdam(list(ps), lr=0.01),  # over sparse gradients only
}
SPARSE = {"SparseAdam"}  # trains models whose every gradient is sparse (embeddings)
NOT_ELEMENTWISE = {"Adafactor", "Muon", "Lamb (hand-written)"}
COUPLED = {"LBFGS"}  # one history over all parameters: no rank may step a share of them


class Scale(torch.nn.Module):
    """Each feature times a weight kept in an nn.Embedding(sparse=True) (a sparse gradient
    on float inputs, so that SparseAdam can train a layer after the first)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(features, 1, sparse=True)
        self.register_buffer("at", torch.arange(features))

    def forward(self, x):
        return x * self.table(self.at).view(-1)


def _model(sparse: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)  # matrices only: Muon steps 2-D parameters alone
    if sparse:  # every gradient sparse: SparseAdam's model
        return torch.nn.Sequential(torch.nn.Embedding(16, 3, sparse=True), Scale(3))
    return torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3, bias=False))


class Paths(torch.nn.Module):
    """Three paths over one input, concatenated: `mine`, as td.tensor.Branches names them."""

    def __init__(self, paths):
        super().__init__()
        self.mine = torch.nn.ModuleList(paths)

    def forward(self, x):
        return torch.cat([path(x) for path in self.mine], -1)


class Towers(torch.nn.Module):
    """Three towers of different depths (so a rank of 2 holds 1 tensor, the other 3) and a
    head; under td.tensor.Branches its state dict keeps these names."""

    def __init__(self, sparse: bool = False):
        super().__init__()
        torch.manual_seed(0)
        if sparse:  # every gradient sparse: SparseAdam's towers (1 tensor, and 3)
            def embedding(n):
                return torch.nn.Embedding(16, n, sparse=True)
            self.paths = Paths([embedding(1), embedding(1),
                                torch.nn.Sequential(embedding(1), Scale(1))])
            self.head = Scale(3)
            return
        linear = torch.nn.Linear
        self.paths = Paths([torch.nn.Sequential(linear(6, 4, bias=False), torch.nn.Tanh()),
                            linear(6, 3, bias=False),
                            torch.nn.Sequential(linear(6, 5, bias=False), torch.nn.Tanh(),
                                                linear(5, 2, bias=False))])
        self.head = linear(9, 3, bias=False)

    def forward(self, x):
        return self.head(self.paths(x))


def _branches(group=None, sparse: bool = False) -> Towers:
    """Towers with its paths spread over `group` (rank 0 of 2: path 0; rank 1: paths 1, 2)."""
    model = Towers(sparse)
    model.paths = td.tensor.Branches(list(model.paths.mine), group=group, join="cat")
    return model


def _reference(wrapper: str, sparse: bool = False) -> torch.nn.Module:
    return Towers(sparse) if wrapper.startswith("Branches") else _model(sparse)


def _batch(step: int, rows: int = ROWS, sparse: bool = False):
    generator = torch.Generator().manual_seed(100 + step)
    if sparse:  # token ids
        return torch.randint(0, 16, (rows,), generator=generator), torch.randn(rows, 3, generator=generator)
    return torch.randn(rows, 6, generator=generator), torch.randn(rows, 3, generator=generator)


def _loss(model, optimizer, x, y, rows):
    """One forward and backward (what LBFGS's closure runs, several times a step)."""
    optimizer.zero_grad()
    if isinstance(model, td.Pipeline):  # x read on the first stage, y on the last
        return model.train_step(x, y, torch.nn.functional.mse_loss)
    loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
    loss.backward()
    return loss


def _train(model, optimizer, rows, steps=range(STEPS), batch_rows=ROWS, sparse=False) -> None:
    for step in steps:
        x, y = _batch(step, batch_rows, sparse)
        if isinstance(getattr(optimizer, "optimizer", optimizer), torch.optim.LBFGS):
            optimizer.step(functools.partial(_loss, model, optimizer, x, y, rows))
        else:
            _loss(model, optimizer, x, y, rows)
            optimizer.step()


def _wrapped(wrapper: str, make, sparse: bool = False, group=None):
    """(the model, what the loop calls, the optimizer) for `wrapper` (ZeroOptimizer's and
    fully_shard's over `group`, default the world)."""
    if wrapper.startswith("Branches"):
        return _wrapped_branches(wrapper, make, sparse)
    model = _model(sparse)
    if wrapper == "ZeroOptimizer":
        return model, model, td.ZeroOptimizer(make(model.parameters()), group=group)
    if wrapper == "DistributedOptimizer":
        return model, model, td.DistributedOptimizer(make(model.parameters()))
    if wrapper == "fully_shard":
        td.fully_shard(model, group=group)
    elif wrapper == "HSDP":  # 2 replicas of 2 shards
        td.fully_shard(model, mesh=td.mesh(dp=2, shard=2))
    elif wrapper == "pipeline":  # 2 stages, each rank its own stage's parameters
        pipe = td.Pipeline(model, chunks=2)
        return pipe, pipe, make(pipe.parameters())
    elif wrapper == "tensor parallel":
        td.parallelize(model, {"0": "embedding"} if sparse else {"0": "colwise", "2": "rowwise"})
    else:
        return model, td.DistributedDataParallel(model), make(model.parameters())
    return model, model, make(model.parameters())


def _wrapped_branches(wrapper: str, make, sparse: bool = False):
    """td.tensor.Branches alone (a plain optimizer), or over mesh.tp_group with a wrapper over
    mesh.dp_group (the replicas of each rank's branches)."""
    if wrapper == "Branches":
        model = _branches(sparse=sparse)
        return model, model, make(model.parameters())
    mesh = td.mesh(dp=2, tp=2)
    model = _branches(mesh.tp_group, sparse)
    if wrapper == "Branches x ZeroOptimizer":
        return model, model, td.ZeroOptimizer(make(model.parameters()), group=mesh.dp_group)
    if wrapper == "Branches x DistributedOptimizer":
        return model, model, td.DistributedOptimizer(make(model.parameters()), group=mesh.dp_group)
    return model, td.DistributedDataParallel(model, group=mesh.dp_group), make(model.parameters())


def _rows(wrapper: str) -> slice:
    """This rank's rows of the batch: its data-parallel share (the whole batch where the ranks
    split the model only)."""
    if wrapper in ("tensor parallel", "pipeline", "Branches"):  # every rank: the whole batch
        return slice(None)
    if wrapper.startswith("Branches"):  # dp=2 x tp=2: the replica's share
        share, rank = ROWS // 2, td.mesh(dp=2, tp=2).dp_rank
    else:
        share, rank = ROWS // td.size(), td.rank()
    return slice(rank * share, (rank + 1) * share)


def check_matrix(wrapper: str):
    td.init()
    mine = _rows(wrapper)
    outcome = {}
    for name, make in OPTIMIZERS.items():
        sparse = name in SPARSE
        reference = _reference(wrapper, sparse)
        _train(reference, make(reference.parameters()), slice(None), sparse=sparse)
        try:
            model, net, optimizer = _wrapped(wrapper, make, sparse)
            _train(net, optimizer, mine, sparse=sparse)
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
BRANCHES = ["Branches", "Branches x ZeroOptimizer", "Branches x DistributedOptimizer", "Branches x DDP"]
WORLD = {"HSDP": 4, **{w: 4 for w in BRANCHES[1:]}}  # mesh(dp=2, shard=2 / tp=2); the others 2


def _refusal(wrapper: str, name: str) -> list[str] | None:
    """What the refusal of `name` under `wrapper` says (the optimizer, the split, the
    alternative); None: it equals one process."""
    short = name.split(" ")[0]
    zero = [f"{short} under td.ZeroOptimizer", "td.DistributedDataParallel(model)"]
    closure = [f"({short}'s step calls one)", "td.DistributedDataParallel(model)"]
    whole = [f"{short} under td.tensor.Branches", "td.DistributedDataParallel"]
    if name in SPARSE:  # whole tensors on one rank (a stage's, a branch's) take it as they are
        hvd = "hvd.DistributedOptimizer"
        return {"ZeroOptimizer": ["SparseAdam under td.ZeroOptimizer", hvd],
                "Branches x ZeroOptimizer": ["SparseAdam under td.ZeroOptimizer", hvd],
                "fully_shard": ["fully_shard", "sparse=True", "SparseAdam", hvd],
                "HSDP": ["fully_shard", "sparse=True", "SparseAdam", hvd],
                "tensor parallel": ["VocabParallelEmbedding", "SparseAdam", "sparse=False", hvd],
                **{w: ["sparse gradient", "SparseAdam", hvd, "AdamW"] for w in (
                    "DistributedOptimizer", "DDP", "Branches x DistributedOptimizer",
                    "Branches x DDP")}}.get(wrapper)
    if name in COUPLED:  # DDP averages every backward the closure runs: exact
        return {"ZeroOptimizer": zero, "Branches x ZeroOptimizer": zero,
                "DistributedOptimizer": closure, "Branches x DistributedOptimizer": closure,
                "fully_shard": [f"{short} under td.fully_shard", SHARDED["fully_shard"]],
                "HSDP": [f"{short} under td.fully_shard", SHARDED["HSDP"]],
                "tensor parallel": [f"{short} under tensor parallelism", SHARDED["tensor parallel"]],
                "pipeline": [f"{short} under td.Pipeline", "td.DistributedDataParallel"],
                "Branches": whole, "Branches x DDP": whole}.get(wrapper)
    if wrapper in SHARDED and name in NOT_ELEMENTWISE:
        if wrapper in ("fully_shard", "HSDP") and name == "Muon":
            # torch's words at construction, with the cause and the alternative
            return ["Muon only supports 2D parameters", "td.fully_shard", "td.ZeroOptimizer"]
        split = "tensor parallelism" if wrapper == "tensor parallel" else "td.fully_shard"
        return [f"{short} under {split}", SHARDED[wrapper], "optimizer.elementwise = True"]
    return None


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("wrapper", ["ZeroOptimizer", "fully_shard", "HSDP", "tensor parallel",
                                     "pipeline", "DistributedOptimizer", "DDP", *BRANCHES])
def test_every_optimizer_equals_one_process_or_is_refused_with_the_reason(wrapper, backend):
    outcomes = run_distributed(check_matrix, WORLD.get(wrapper, 2), backend, args=(wrapper,))
    assert all(outcome.keys() == outcomes[0].keys() for outcome in outcomes)
    for name in OPTIMIZERS:
        for outcome in outcomes[1:]:  # every rank the same outcome (a refusal on all of them)
            assert outcome[name][0] == outcomes[0][name][0], (name, outcome[name], outcomes[0][name])
        kind, value = outcomes[0][name]
        said = _refusal(wrapper, name)
        if said is not None:
            assert kind == "refused", f"{name} under {wrapper}: {value}"
            assert all(part in value for part in said), (said, value)
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


# Every optimizer each sharded wrapper takes (the others are refused above): ZeroOptimizer's
# flat shards and whole parameters, fully_shard's flat shards (element-wise ones only), and
# Branches' whole towers (any optimizer stepping each tensor on its own; 1 + 2 towers saved,
# 1 + 1 + 1 restored).
TAKEN = {"ZeroOptimizer": [n for n in OPTIMIZERS if n not in COUPLED | SPARSE],
         "fully_shard": [n for n in OPTIMIZERS if n not in NOT_ELEMENTWISE | COUPLED | SPARSE]}
RESHARDED = {**TAKEN, "HSDP": TAKEN["fully_shard"], "Branches": ["Adafactor", "Muon"]}
# (world, wrapper, first step, last step) of each save and restore: 2 ranks -> 3; HSDP (2
# replicas x 2 shards) saved on 4 and restored as fully_shard on 3
JOURNEYS = {**{w: [(2, w, 0, 2), (3, w, 2, 3)] for w in RESHARDED},
            "HSDP": [(4, "HSDP", 0, 2), (3, "fully_shard", 2, 3)]}


def check_resharded(wrapper: str, directory: str, first: int, last: int, names: list[str]):
    """Restore (after `first` steps) on this world, train to `last`, save: each optimizer's
    difference from one process after `last` steps. 12 rows: 6, 4 or 3 per rank."""
    td.init()
    share = 12 // td.size()
    mine = slice(None) if wrapper == "Branches" else slice(td.rank() * share, (td.rank() + 1) * share)
    outcome = {}
    for name in names:
        make = OPTIMIZERS[name]
        reference = _reference(wrapper)
        _train(reference, make(reference.parameters()), slice(None), range(last), 12)
        model, net, optimizer = _wrapped(wrapper, make)
        checkpointer = td.Checkpointer(f"{directory}/{name.split(' ')[0]}", keep=1)
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
    for journey, names in RESHARDED.items():
        for world, wrapper, first, last in JOURNEYS[journey]:
            for rank, outcome in enumerate(run_distributed(check_resharded, world, backend, args=(
                    wrapper, str(tmp_path / journey), first, last, names))):
                assert outcome.keys() == set(names)
                for name, diff in outcome.items():
                    assert diff < 1e-6, (journey, wrapper, name, world, rank, diff)


def check_shrunk(wrapper: str):
    """td.elastic's 3 -> 2 in memory: 3 ranks train 2 steps (12 rows, 4 each) and each takes
    its part of the sharded state as a State commit does (`state_pieces.take`); rank 2 leaves:
    the part of each rank goes into the layout of ranks 0 and 1 by the box intersection over
    the wire (`transfer.reshard`, what `State.sync` runs after a shrink; rank 2 sends its part
    and needs none, as a peer backup's holder sends the part of a rank that left), and the 2
    train step 3 (6 rows each). Each optimizer's difference from one process (ranks 0, 1)."""
    td.init()
    rank = td.rank()
    survivors = td.new_group([0, 1])
    outcome = {}
    for name in TAKEN[wrapper]:
        make = OPTIMIZERS[name]
        model, net, optimizer = _wrapped(wrapper, make)
        _train(net, optimizer, slice(rank * 4, rank * 4 + 4), range(2), 12)
        part = state_pieces.take({"model": model, "optimizer": optimizer}, [model])
        objects, models = {}, []
        if rank < 2:  # the survivors' layout: a fresh model (the seed's values) over the 2
            model, net, optimizer = _wrapped(wrapper, make, group=survivors)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(0.5)  # the parts, not the seed, must bring the values back
            objects, models = {"model": model, "optimizer": optimizer}, [model]
        holes = transfer.reshard([part], objects, models)
        if rank == 2:
            outcome[name] = holes
            continue
        _train(net, optimizer, slice(rank * 6, rank * 6 + 6), range(2, 3), 12)
        reference = _reference(wrapper)
        _train(reference, make(reference.parameters()), slice(None), range(3), 12)
        full = td.fsdp.full_state_dict(model)
        outcome[name] = (holes, max((full[k] - v).abs().max().item()
                                    for k, v in reference.state_dict().items()))
    return outcome


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("wrapper", list(TAKEN))
def test_a_sharded_optimizer_shrunk_in_memory_from_3_ranks_to_2_equals_one_process(wrapper, backend):
    """Every optimizer the wrapper takes. (HSDP has no elastic cell: td.elastic.State refuses
    state reduced over a mesh's groups, naming them.)"""
    *survivors, leaver = run_distributed(check_shrunk, 3, backend, args=(wrapper,))
    assert all(holes == {} for holes in leaver.values()), leaver
    for rank, outcome in enumerate(survivors):
        assert outcome.keys() == set(TAKEN[wrapper])
        for name, (holes, diff) in outcome.items():
            assert holes == {} and diff < 1e-6, (wrapper, name, rank, holes, diff)
