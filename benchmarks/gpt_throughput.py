"""Tokens per second and model FLOPs utilisation of a GPT-2-small-sized model on one GPU: tandem's
wrappers against torch's own, in the same run.

    python benchmarks/gpt_throughput.py                      # one GPU, bf16, compile off and on
    python benchmarks/gpt_throughput.py --compile off --steps 20 --reps 3
    python benchmarks/gpt_throughput.py --dry-run            # a tiny config on the CPU (the tests)

The model is built from a config, nothing is downloaded: the GPT-style decoder of
`tandem.bench.models` at GPT-2 small's sizes (12 layers, 768 wide, 12 heads, 1024 tokens, the
vocabulary 50257 padded to 50304; its head is not tied to the token embedding, so it holds 163 M
parameters where GPT-2's 124 M share one matrix). Every method trains its own copy from the
same seed with AdamW (fused on CUDA), forward and loss under bf16 autocast, on random tokens:

* torch_ddp: `torch.nn.parallel.DistributedDataParallel`
* td_ddp: `td.DistributedDataParallel`
* td_opt: `td.DistributedOptimizer` around the AdamW
* td_fsdp: `td.fully_shard` on each block, then the root
* torch_fsdp: `torch.distributed.fsdp.fully_shard` (FSDP2) on each block, then the root

`--compile off,on` runs them all twice, eager and under `torch.compile` (the wrapped model is
compiled). A world of one in this process (`td.init`, NCCL on a GPU, Gloo on the CPU). The
methods take turns, repetition after repetition, so that a drifting clock hits all alike; a
repetition times `--steps` steps after `torch.cuda.synchronize()`, and each method's median
repetition is reported.

Model FLOPs per token: 6 N (N: the parameters of every matmul, the head included, the two
embeddings left out) + 12 L d T for attention (L layers, width d, sequence T), forward and
backward, as in PaLM's appendix B. MFU = FLOPs per token x tokens/s / the card's dense bf16
peak (`--peak-tflops`, else known for H100/H200 SXM 989, H100 PCIe 756, A100 312, L4 121;
unknown cards get no MFU). The JSON (`--out`) holds every number.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import tandem as td
from tandem.bench.models import gpt
from tandem.bench.results import write_json

GPT2_SMALL = {"vocab": 50304, "dim": 768, "heads": 12, "layers": 12, "seq": 1024}
TINY = {"vocab": 256, "dim": 64, "heads": 4, "layers": 2, "seq": 32}
METHODS = ("torch_ddp", "td_ddp", "td_opt", "td_fsdp", "torch_fsdp")
# dense bf16 peak in TFLOP/s, by a piece of the card's name (first match wins)
PEAKS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L4", 121.0))


def peak_tflops(name: str) -> float | None:
    for piece, tflops in PEAKS:
        if piece in name:
            return tflops
    return None


def flops_per_token(model: torch.nn.Module, config: dict) -> float:
    """6 N + 12 L d T (forward and backward), N without the embeddings' lookups."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
                  for p in m.parameters()}
    n = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    return 6 * n + 12 * config["layers"] * config["dim"] * config["seq"]


def _optimizer(params, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")


def build(method: str, config: dict, device: torch.device, compiled: str):
    """(module to call, optimizer) for one method, from seed 0."""
    torch.manual_seed(0)
    model = gpt(**config).to(device)
    if method == "torch_ddp":
        ids = [device.index or 0] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        optimizer = _optimizer(model.parameters(), device)
    elif method == "td_ddp":
        model = td.DistributedDataParallel(model)
        optimizer = _optimizer(model.parameters(), device)
    elif method == "td_opt":
        optimizer = td.DistributedOptimizer(_optimizer(model.parameters(), device),
                                            named_parameters=model.named_parameters())
    elif method in ("td_fsdp", "torch_fsdp"):
        if method == "td_fsdp":
            shard = td.fully_shard
        else:
            from torch.distributed.fsdp import fully_shard as shard
        for block in model.blocks:
            shard(block)
        shard(model)
        optimizer = _optimizer(model.parameters(), device)
    else:
        raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
    if compiled != "off":
        model = torch.compile(model, backend="eager" if compiled == "eager" else "inductor")
    return model, optimizer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args, config: dict, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config["vocab"], (args.batch, config["seq"]), generator=g).to(device)
    targets = torch.randint(0, config["vocab"], (args.batch * config["seq"],), generator=g).to(device)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                else contextlib.nullcontext())
    results: dict[str, dict] = {}
    for compiled in args.compile.split(","):
        runs = {}
        for method in args.methods.split(","):
            model, optimizer = build(method, config, device, compiled)

            def step(model=model, optimizer=optimizer):
                optimizer.zero_grad(set_to_none=True)
                with autocast:
                    loss = F.cross_entropy(model(ids), targets)
                loss.backward()
                optimizer.step()
                return loss

            for _ in range(args.warmup):  # compiles here
                step()
            _sync(device)
            runs[method] = (step, [])
        for _ in range(args.reps):
            for step, seconds in runs.values():
                _sync(device)
                start = time.perf_counter()
                for _ in range(args.steps):
                    loss = step()
                _sync(device)
                seconds.append((time.perf_counter() - start) / args.steps)
        for method, (_, seconds) in runs.items():
            results[f"{method}/{compiled}"] = {"method": method, "compile": compiled,
                                               "step_s": statistics.median(seconds),
                                               "reps_s": seconds, "loss": float(loss.detach())}
        del runs, step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny config on the CPU, eager and compile(backend='eager'): "
                             "runs every line in seconds")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--compile", default="off,on", help="comma-separated: off, on, eager")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the card's dense bf16 peak (default: known cards by name)")
    parser.add_argument("--out", default="results/gpt_throughput.json")
    args = parser.parse_args(argv)
    config = dict(GPT2_SMALL)
    if args.dry_run:
        config = dict(TINY)
        args.device, args.batch, args.steps, args.reps, args.warmup = "cpu", 2, 1, 1, 1
        if args.compile == "off,on":
            args.compile = "off,eager"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: no CUDA GPU is visible (torch {torch.__version__}); "
                     "--dry-run runs the code on the CPU")
    torch.set_float32_matmul_precision("high")
    td.init(backend="nccl" if args.device == "cuda" else "gloo")
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
            else torch.device("cpu")
        card = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        results = measure(args, config, device)
    finally:
        td.shutdown()
    peak = args.peak_tflops or (peak_tflops(card) if device.type == "cuda" else None)
    flops = flops_per_token(gpt(**config), config)
    tokens = args.batch * config["seq"]
    for row in results.values():
        row["tokens_per_s"] = tokens / row["step_s"]
        row["mfu"] = None if peak is None else flops * row["tokens_per_s"] / (peak * 1e12)
    print(f"GPT {config} on {card}, {args.dtype}, batch {args.batch} x {config['seq']} tokens, "
          f"median of {args.reps} x {args.steps} steps; {flops / 1e9:.2f} GFLOPs per token; "
          f"peak {peak or '?'} TFLOP/s")
    print(f"{'method':<12}{'compile':<9}{'ms/step':>9}{'tokens/s':>11}{'MFU %':>7}{'vs torch':>10}")
    for row in results.values():
        anchor = results.get(f"{'torch_fsdp' if 'fsdp' in row['method'] else 'torch_ddp'}/"
                             f"{row['compile']}")
        ratio = f"{row['tokens_per_s'] / anchor['tokens_per_s']:.3f}" if anchor else "-"
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}"
        row["vs_torch"] = None if anchor is None else row["tokens_per_s"] / anchor["tokens_per_s"]
        print(f"{row['method']:<12}{row['compile']:<9}{1e3 * row['step_s']:>9.1f}"
              f"{row['tokens_per_s']:>11.0f}{mfu:>7}{ratio:>10}")
    out = write_json({"benchmark": "gpt_throughput", "card": card, "device": device.type,
                      "peak_tflops": peak, "flops_per_token": flops, "model": config,
                      "config": vars(args), "torch": torch.__version__, "cpus": os.cpu_count(),
                      "rows": results}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
