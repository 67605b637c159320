"""The flow of torch's FSDP2 example (pytorch/examples distributed/FSDP2: a meta-device
transformer sharded block by block, inspect_model, a checkpointer with the DCP API and with the
DTensor API, save then resume, torch's own clip_grad_norm_) written as a port to tandem would
have it: the script's code is the example's; the port changes the import of `fully_shard,
FSDPModule, MixedPrecisionPolicy` (`tandem.fsdp` instead of `torch.distributed.fsdp`) and the
fresh-start initialisation (`materialize(model, seed=0)` for `to_empty` +
`reset_parameters()`). A small model, and data drawn per step, so that a resumed run can be
compared with an uninterrupted one.

    tandem run -np 2 [--backend mpi] tests/scripts/fsdp2_port.py OUT_DIR [--mixed-precision]
        [--explicit-prefetching]

Runs, in one job, for `impl` tandem (and torch's FSDP2 where it runs: Gloo, and MPI through
tandem's process group) and each checkpointer (dcp, dtensor): STEPS steps then save, a fresh
meta-device model that loads that checkpoint and runs STEPS more then saves, and an
uninterrupted 2 * STEPS run that saves. Rank 0 writes OUT_DIR/summary.json: which files
equal which, and what inspect_model saw.
"""

import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import tandem.fsdp as tandem_fsdp  # the port: `from tandem.fsdp import fully_shard, ...`

STEPS = 3
VOCAB, SEQ, BATCH = 32, 8, 4


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = VOCAB
    max_seq_len: int = SEQ
    dim: int = 16
    n_heads: int = 4


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        b, s, _ = x.size()
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, None, 0)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.w1 = nn.Linear(args.dim, 4 * args.dim)
        self.w2 = nn.Linear(4 * args.dim, args.dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.w2(F.gelu(self.w1(self.ffn_norm(h))))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.size(1)))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


def inspect_model(model, fsdp):  # the example's utils.inspect_model
    assert isinstance(model, Transformer)
    assert isinstance(model, fsdp.FSDPModule)
    seen = set()
    for param in model.parameters():
        assert param.placements == (Shard(0),)
        assert param.dtype == torch.float32
        seen.add((type(param).__name__, str(param.placements), param.device_mesh.size()))
    return sorted(seen)


def inspect_mixed_precision(model):  # the example's utils.inspect_mixed_precision
    model.unshard()
    for param in model.parameters(recurse=False):
        assert param.dtype == torch.bfloat16
    model.reshard()


class Checkpointer:  # the example's checkpoint.py, with step-numbered folders
    def __init__(self, folder, dcp_api, step):
        self.folder, self.dcp_api, self.step = folder, dcp_api, step

    def load_model(self, model):
        full_sd = torch.load(f"{self.folder}/{self.step}/model.pt", mmap=True, weights_only=True,
                             map_location="cpu")
        if self.dcp_api:
            set_model_state_dict(model=model, model_state_dict=full_sd, options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True))
            return
        meta_sharded_sd = model.state_dict()
        sharded_sd = {}
        for param_name, full_tensor in full_sd.items():
            sharded_meta_param = meta_sharded_sd.get(param_name)
            sharded_tensor = distribute_tensor(full_tensor, sharded_meta_param.device_mesh,
                                               sharded_meta_param.placements)
            sharded_sd[param_name] = nn.Parameter(sharded_tensor)
        model.load_state_dict(sharded_sd, strict=False, assign=True)

    def load_optim(self, model, opt):
        full_sd = torch.load(f"{self.folder}/{self.step}/optim.pt", mmap=True, weights_only=True,
                             map_location="cpu")
        if self.dcp_api:
            set_optimizer_state_dict(model=model, optimizers=opt, optim_state_dict=full_sd,
                                     options=StateDictOptions(full_state_dict=True,
                                                              broadcast_from_rank0=True))
            return
        _init_optim_state(opt)
        param_groups = opt.state_dict()["param_groups"]
        state = opt.state_dict()["state"]
        for param_group, full_param_group in zip(param_groups, full_sd["param_groups"], strict=True):
            for key, value in full_param_group.items():
                if key != "params":
                    param_group[key] = value
            for pid, full_pid in zip(param_group["params"], full_param_group["params"], strict=True):
                if pid not in state:
                    continue
                for attr, full_tensor in full_sd["state"][full_pid].items():
                    sharded_tensor = state[pid][attr]
                    if isinstance(sharded_tensor, DTensor):
                        state[pid][attr] = distribute_tensor(
                            full_tensor, sharded_tensor.device_mesh, sharded_tensor.placements)
                    else:
                        state[pid][attr] = full_tensor
        opt.load_state_dict({"param_groups": param_groups, "state": state})

    def full_model_state_dict(self, model):
        if self.dcp_api:
            return get_model_state_dict(model=model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        out = {}
        for param_name, sharded_param in model.state_dict().items():
            full_param = sharded_param.full_tensor()
            if dist.get_rank() == 0:
                out[param_name] = full_param.cpu()
        return out

    def full_optimizer_state_dict(self, model, opt):
        if self.dcp_api:
            return get_optimizer_state_dict(model=model, optimizers=opt, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        sharded_sd = opt.state_dict()
        full_state = {}
        for group_id, sharded_group in sharded_sd["state"].items():
            group_state = {}
            for attr, sharded_tensor in sharded_group.items():
                full = sharded_tensor.full_tensor() if isinstance(sharded_tensor, DTensor) \
                    else sharded_tensor
                group_state[attr] = full.cpu()
            full_state[group_id] = group_state
        return {"param_groups": sharded_sd["param_groups"], "state": full_state}

    def save(self, model, optim, step):
        model_sd = self.full_model_state_dict(model)
        optim_sd = self.full_optimizer_state_dict(model, optim)
        if dist.get_rank() == 0:
            os.makedirs(f"{self.folder}/{step}", exist_ok=True)
            torch.save(model_sd, f"{self.folder}/{step}/model.pt")
            torch.save(optim_sd, f"{self.folder}/{step}/optim.pt")
        # The example saves at the end of one run and loads at the start of the next; here the
        # next run starts in the same processes, so no rank reads the files before rank 0 has
        # written them (rank 1 once read a half-written model.pt: "mmap can only be used...").
        dist.barrier()


def set_modules_to_prefetch(model, n):  # the example's two setters, in one
    for i, layer in enumerate(model.layers):
        after = [model.layers[i + j] for j in range(1, n + 1) if i + j < len(model.layers)]
        before = [model.layers[i - j] for j in range(1, n + 1) if i - j >= 0]
        if after:
            layer.set_modules_to_forward_prefetch(after)
        if before:
            layer.set_modules_to_backward_prefetch(before)


def train(fsdp, folder, dcp_api, mixed, start, steps, resume, prefetch=False):
    """The example's main(): returns what inspect_model saw."""
    torch.manual_seed(0)
    fresh_on_cpu = fsdp is torch_fsdp and not resume  # torch: the values of a CPU build
    args = ModelArgs()
    if fresh_on_cpu:
        model = Transformer(args)
    else:
        with torch.device("meta"):
            model = Transformer(args)
    kwargs = {}
    if mixed:
        kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)
    for layer in model.layers:
        fsdp.fully_shard(layer, **kwargs)
    fsdp.fully_shard(model, **kwargs)
    seen = inspect_model(model, fsdp)
    if prefetch:
        set_modules_to_prefetch(model, 1)
    checkpointer = Checkpointer(folder, dcp_api, start)
    if not resume:
        if fsdp is tandem_fsdp:
            fsdp.materialize(model, seed=0)  # the port's line for to_empty + reset_parameters
    else:
        checkpointer.load_model(model)
    if mixed:
        inspect_mixed_precision(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    if resume:
        checkpointer.load_optim(model, optim)
    for step in range(start, start + steps):
        if prefetch:
            model.unshard()
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
    checkpointer.save(model, optim, start + steps)
    return seen


def same(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a, b)
    return a == b


def closeness(a, b):
    """The largest absolute difference of two model state dicts (same names)."""
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


torch_fsdp = None


def main():
    global torch_fsdp
    out, mixed = sys.argv[1], "--mixed-precision" in sys.argv
    prefetch = "--explicit-prefetching" in sys.argv
    dist.init_process_group(backend=os.environ.get("FSDP2_PORT_BACKEND", "gloo"))
    import torch.distributed.fsdp as torch_fsdp_module

    torch_fsdp = torch_fsdp_module
    impls = {"tandem": tandem_fsdp, "torch": torch_fsdp}
    summary = {"backend": dist.get_backend(), "inspect": {}, "equal": {}, "torch_vs_tandem": {}}
    for name, fsdp in impls.items():
        for api in ("dcp", "dtensor"):
            folder = f"{out}/{name}/{api}"
            summary["inspect"][f"{name}/{api}"] = train(fsdp, f"{folder}/a", api == "dcp",
                                                        mixed, 0, STEPS, False, prefetch)
            train(fsdp, f"{folder}/a", api == "dcp", mixed, STEPS, STEPS, True, prefetch)
            train(fsdp, f"{folder}/b", api == "dcp", mixed, 0, 2 * STEPS, False, prefetch)
            dist.barrier()
            if dist.get_rank() == 0:
                for what in ("model", "optim"):
                    resumed = torch.load(f"{folder}/a/{2 * STEPS}/{what}.pt", weights_only=True)
                    whole = torch.load(f"{folder}/b/{2 * STEPS}/{what}.pt", weights_only=True)
                    summary["equal"][f"{name}/{api}/{what}"] = same(resumed, whole)
    if dist.get_rank() == 0:
        for api in ("dcp", "dtensor"):
            for step, run in ((STEPS, "a"), (2 * STEPS, "b")):
                mine, theirs = (torch.load(f"{out}/{name}/{api}/{run}/{step}/model.pt",
                                           weights_only=True) for name in ("tandem", "torch"))
                summary["torch_vs_tandem"][f"{api}/{step}"] = {
                    "equal": same(mine, theirs), "max_abs_diff": closeness(mine, theirs)}
        with open(f"{out}/summary.json", "w") as f:
            json.dump(summary, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
