"""Context parallelism at sp = 2 against one process: activation memory, time in collectives,
tokens per second; and torch's `context_parallel` in the same run, where it runs on CPU.

    python benchmarks/context_parallel.py                    # GPT-like model, T = 2048, CPU
    python benchmarks/context_parallel.py --seq 1024 --steps 3 --out /tmp/cp.json
    python benchmarks/context_parallel.py --compile   # and compiled rows (torch.compile, inductor)

One process first (this process, the whole sequence), then 2 ranks (`td.spawn`, Gloo, one
thread each), each with half of every sequence (`td.context.split`), once per form (ring,
all-to-all) and once with torch's `context_parallel` (`torch.distributed.tensor.experimental`)
over the same world. The model is a small causal transformer (embedding, positions, blocks of
nn.MultiheadAttention and an MLP, a head); each step is forward, cross-entropy, backward.

- activation memory: the heap in use right after forward (loss computed, autograd graph alive)
  minus before it, from glibc's `mallinfo2()` (CPU torch has no allocator statistics of its
  own), per rank; the ring form's target is <= 1/sp + 10 % of one process's;
- collectives: the seconds each rank waited in the split's messages (`wire.waited`: the ring's
  exposed waits, the all-to-alls whole) over the step's wall time;
- tokens/s: the global batch's tokens over the step's wall time (both ranks working on one
  batch), against one process's (`--compile`: a compiled form's against the compiled one
  process's).

Numbers are from whatever machine runs it: medians of the measured steps. On a shared 2-core
machine, two ranks with one thread each are compared with one process with one thread.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import tandem as td
from tandem.bench.results import write_json
from tandem.parallel import context as cp
from tandem.parallel.context import wire


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.empty(x.shape[1], x.shape[1])  # a hint only: is_causal=True builds the mask
        x = x + self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, positions):
        return self.head(self.blocks(self.embed(ids) + self.pos(positions)))


def heap_in_use() -> int:
    class _Mallinfo2(ctypes.Structure):  # made here: td.spawn sends this function by value
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def batch(config):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab"], (config["batch"], config["seq"] + 1), generator=g)
    positions = torch.arange(config["seq"]).expand(config["batch"], -1)
    return ids[:, :-1], positions, ids[:, 1:]


def build(config) -> GPT:
    torch.manual_seed(0)
    return GPT(config["vocab"], config["dim"], config["heads"], config["layers"], config["seq"])


def measure(step, config) -> dict:
    """Median over the measured steps of: activation bytes, wall time, time in messages."""
    held, wall, waited = [], [], []
    for i in range(config["warmup"] + config["steps"]):
        wire.waited["s"] = 0.0
        if td.is_initialized():
            td.barrier()
        start, before = time.perf_counter(), heap_in_use()
        loss = step()
        activation = heap_in_use() - before
        loss.backward()
        if i >= config["warmup"]:
            held.append(activation)
            wall.append(time.perf_counter() - start)
            waited.append(wire.waited["s"])
        del loss
    step_s = statistics.median(wall)
    return {"activation_mb": statistics.median(held) / 2**20, "step_s": step_s,
            "comm_s": statistics.median(waited), "comm_share": statistics.median(waited) / step_s,
            "tokens_per_s": config["batch"] * config["seq"] / step_s}


def one_process(config, compiled: bool = False) -> dict:
    torch.set_num_threads(1)
    model = build(config)
    if compiled:
        model = torch.compile(model, backend=config["compiler"])
    ids, positions, labels = batch(config)

    def step():
        model.zero_grad(set_to_none=True)
        return F.cross_entropy(model(ids, positions).flatten(0, 1), labels.flatten())

    return measure(step, config)


def split_worker(config) -> dict:
    torch.set_num_threads(1)
    out = {}
    ids, positions, labels = batch(config)
    parts = cp.split(ids, positions, labels, seq_dim=1)
    runs = [(style, False) for style in ("ring", "alltoall")]
    runs += [(style, True) for style in ("ring", "alltoall") if config["compile"]]
    for style, compiled in runs:
        model = cp.parallelize(build(config), style=style)
        opt = td.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                      named_parameters=model.named_parameters())
        run = torch.compile(model, backend=config["compiler"]) if compiled else model

        def step(run=run, opt=opt):
            opt.zero_grad(set_to_none=True)
            return F.cross_entropy(run(*parts[:2]).flatten(0, 1), parts[2].flatten())

        out[f"{style}, compiled" if compiled else style] = measure(step, config)
    out["torch context_parallel"] = torch_context_parallel(config)
    return out


def torch_context_parallel(config) -> dict:
    """torch's own, over the same world (backend "tandem"), if it runs on CPU here."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        mesh = init_device_mesh("cpu", (td.size(),))
        model = build(config)
        ids, positions, labels = batch(config)

        def step():
            model.zero_grad(set_to_none=True)
            buffers = [ids.clone(), positions.clone(), labels.clone()]
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1]):
                return F.cross_entropy(model(buffers[0], buffers[1]).flatten(0, 1),
                                       buffers[2].flatten())

        return measure(step, {**config, "steps": 1, "warmup": 0})
    except Exception as error:  # reported, not raised: the point is whether it runs
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true",
                        help="also torch.compile the one process and both forms (compiled rows "
                             "against the compiled one process; the warm-up steps compile)")
    parser.add_argument("--compiler", default="inductor", help="torch.compile's backend")
    parser.add_argument("--out", default="results/context_parallel.json")
    args = parser.parse_args()
    config = {"seq": args.seq, "batch": args.batch, "dim": args.dim, "heads": args.heads,
              "layers": args.layers, "vocab": 256, "steps": args.steps, "warmup": args.warmup,
              "compile": args.compile, "compiler": args.compiler}
    single = one_process(config)
    single_compiled = one_process(config, compiled=True) if args.compile else None
    everyone = td.spawn(split_worker, nprocs=2, args=(config,), backend="gloo")
    print(f"sp = 2 (Gloo, 1 thread per rank) vs one process (1 thread); causal GPT, T = "
          f"{args.seq}, batch {args.batch}, dim {args.dim}, {args.heads} heads, {args.layers} "
          f"layers; median of {args.steps} steps")
    print(f"{'run':<24}{'act. MB/rank':>13}{'vs one':>8}{'step ms':>9}{'comm share':>11}"
          f"{'tokens/s':>10}{'vs one':>8}")
    print(f"{'one process':<24}{single['activation_mb']:>13.1f}{1:>8.2f}"
          f"{single['step_s'] * 1e3:>9.1f}{'-':>11}{single['tokens_per_s']:>10.0f}{1:>8.2f}")
    rows = {"one process": single}
    if single_compiled is not None:
        rows["one process, compiled"] = single_compiled
        print(f"{'one process, compiled':<24}{single_compiled['activation_mb']:>13.1f}"
              f"{single_compiled['activation_mb'] / single['activation_mb']:>8.2f}"
              f"{single_compiled['step_s'] * 1e3:>9.1f}{'-':>11}"
              f"{single_compiled['tokens_per_s']:>10.0f}"
              f"{single_compiled['tokens_per_s'] / single['tokens_per_s']:>8.2f}")
    for run in everyone[0]:
        per_rank = [r[run] for r in everyone]
        if "error" in per_rank[0]:
            rows[run] = per_rank[0]
            print(f"{run:<24}does not run here: {per_rank[0]['error']}")
            continue
        row = {key: statistics.mean(r[key] for r in per_rank) for key in per_rank[0]}
        row["activation_mb"] = max(r["activation_mb"] for r in per_rank)  # the fuller rank
        one = single_compiled if run.endswith(", compiled") else single  # compiled vs compiled
        row["memory_vs_one"] = row["activation_mb"] / one["activation_mb"]
        row["speed_vs_one"] = row["tokens_per_s"] / one["tokens_per_s"]
        rows[run] = row
        print(f"{run:<24}{row['activation_mb']:>13.1f}{row['memory_vs_one']:>8.2f}"
              f"{row['step_s'] * 1e3:>9.1f}{row['comm_share']:>11.3f}{row['tokens_per_s']:>10.0f}"
              f"{row['speed_vs_one']:>8.2f}")
    write_json({"config": config, "torch": torch.__version__, "runs": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
