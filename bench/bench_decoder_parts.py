"""Where the decoder's training step goes: each part of it timed on the xla device against
eager PyTorch on the CPU (2 threads), each in its own processes, alternating.

    PJRT_DEVICE=CPU python bench/bench_decoder_parts.py [--parts attention,mlp,...]
        [--rounds 5] [--procs 2] [--batch 8] [--seq 256] [--hlo-dir DIR]

Parts (the decoder of bench/models_torch.py at batch 8 x 256, one layer's worth each):
  attention   the attention block (q/k/v/o projections, rotary, grouped-query causal
              attention with repeat_interleave), forward + backward;
  mlp         the SiLU-gated MLP, forward + backward;
  rmsnorm     one RMSNorm, forward + backward;
  head        the output projection + cross entropy, forward + backward;
  embedding   the embedding lookup and its backward;
  adam        Adam's step over the whole decoder's parameters (gradients given);
  step        the whole training step (forward, backward, Adam);
  program     the whole step's compiled program alone on xla (no tracing, no barrier:
              what the step costs beyond it is host work), the eager step on the CPU.
On xla each part is one program (traced, `xm.mark_step()`, the result read), warm; on the
CPU the same code runs eagerly. Each contender runs in its own processes (`--procs` each,
alternating xla / eager), so neither's threads spin beside the other's; the table gives
median ms per part over all runs, xla / eager, and the minima.
`--hlo-dir` writes each part's optimized HLO (the compiled executable's text, with the
CPU policy's options) and the whole step's, to look for what eager does not pay.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PARTS = ("attention", "mlp", "rmsnorm", "head", "embedding", "adam", "step", "program")


def _part(name, cfg, batch, seq, dev):
    """(run() -> tensor to read) of part `name` on device `dev`, same weights on each device."""
    import torch
    import torch.nn.functional as F
    import models_torch as mt
    torch.manual_seed(0)
    h = cfg.hidden_size
    x = torch.randn(batch, seq, h)
    if name == "program" and dev.type == "xla":
        import jax
        wl = mt.decoder_workload(batch, seq, cfg)
        graph, params = common.traced_step_graph(wl)
        exe = _compile(graph)
        return lambda: jax.block_until_ready(exe(*params))
    if name in ("step", "program"):
        wl = mt.decoder_workload(batch, seq, cfg)
        # the worker reads the loss after a barrier of its own
        return common.xla_training_step(wl, barrier=False) if dev.type == "xla" else common.eager_training_step(wl)
    if name == "adam":
        model = mt.DecoderOnly(cfg).to(dev)
        params = list(model.parameters())
        for p in params:
            p.grad = torch.randn(p.shape).to(dev)
        opt = torch.optim.Adam(params, lr=1e-4)

        def run():
            opt.step()
            return params[0]
        return run
    if name == "embedding":
        emb = torch.nn.Embedding(cfg.vocab_size, h).to(dev)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq)).to(dev)
        gy = torch.randn(batch, seq, h).to(dev)

        def run():
            emb.weight.grad = None
            emb(ids).backward(gy)
            return emb.weight.grad
        return run
    if name == "head":
        norm_out = x.to(dev).requires_grad_()
        out = torch.nn.Linear(h, cfg.vocab_size, bias=False).to(dev)
        labels = torch.randint(0, cfg.vocab_size, (batch * seq,)).to(dev)

        def run():
            out.weight.grad = norm_out.grad = None
            loss = F.cross_entropy(out(norm_out).view(-1, cfg.vocab_size), labels)
            loss.backward()
            return out.weight.grad
        return run
    xd = x.to(dev).requires_grad_()
    gy = torch.randn(batch, seq, h).to(dev)
    if name == "attention":
        mod = mt.Attention(cfg).to(dev)
        cos, sin = (t[:seq].to(dev) for t in mt.rotary_tables(cfg.max_seq, h // cfg.num_attention_heads))
        mask = torch.full((seq, seq), float("-inf")).triu(1).to(dev)
        fwd = lambda: mod(xd, cos, sin, mask)  # noqa: E731
    elif name == "mlp":
        mod = mt.MLP(cfg).to(dev)
        fwd = lambda: mod(xd)  # noqa: E731
    elif name == "rmsnorm":
        mod = mt.RMSNorm(h, cfg.rms_eps).to(dev)
        fwd = lambda: mod(xd)  # noqa: E731
    else:
        raise ValueError(f"unknown part {name!r}; parts: {', '.join(PARTS)}")

    def run():
        xd.grad = None
        for p in mod.parameters():
            p.grad = None
        fwd().backward(gy)
        return xd.grad
    return run


def _dump_hlo(run, path):
    """The optimized HLO of the program `run` traces, compiled as the executor would."""
    import torch_xla.core.xla_model as xm
    from torch_xla._engine import executor, ir
    from torch_xla._engine.tensor import pending
    run()
    xm.mark_step()
    out = run()  # noqa: F841  (keeps the result alive as a root)
    roots, seen = [], set()
    for s in pending.take_live():
        if type(s.node) is not ir.DeviceData and (id(s.node), s.idx) not in seen:
            seen.add((id(s.node), s.idx))
            roots.append((s.node, s.idx))
    with open(path, "w") as f:
        f.write(_compile(executor.Graph(roots)).as_text())


def _compile(graph):
    """`graph` compiled as the executor compiles it (the platform policy's options)."""
    import jax
    from torch_xla._engine.executor.compile import platform_policy
    from torch_xla._engine.executor.lower import build_fn
    pol = platform_policy()
    blas = pol.library_products()
    fn = build_fn(graph, pol.patch_convolutions, checks=True, widen_int4_dots=pol.widen_int4_dots,
                  library_products=blas)
    return jax.jit(fn, keep_unused=True).lower(*graph.param_values()).compile(
        compiler_options=pol.compiler_options(graph.op_avals(), blas))


def _worker(args) -> None:
    """One contender (`xla` or `eager`), every part: warm, then `--rounds` timed runs."""
    import torch
    import models_torch as mt
    wa = common.parse_worker_args(args)
    torch.set_num_threads(2)
    cfg = mt.DecoderConfig(max_seq=wa["seq"])
    on_xla = args.worker == "xla"
    if on_xla:
        import torch_xla
        import torch_xla.core.xla_model as xm
        dev = torch_xla.device()
    else:
        dev = torch.device("cpu")
    times = {}
    for name in wa["parts"]:
        run = _part(name, cfg, wa["batch"], wa["seq"], dev)

        def once():
            out = run()
            if on_xla and name != "program":
                xm.mark_step()
                out.cpu()
        for _ in range(3):   # compile, then warm
            once()
        if on_xla and wa.get("hlo_dir") and name != "program":
            os.makedirs(wa["hlo_dir"], exist_ok=True)
            _dump_hlo(run, os.path.join(wa["hlo_dir"], f"{name}.hlo.txt"))
            once()
        times[name] = []
        for _ in range(wa["rounds"]):
            t0 = time.perf_counter()
            once()
            times[name].append((time.perf_counter() - t0) * 1e3)
    common.emit({"times": times})


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--rounds", type=int, default=5, help="timed runs of each part per process")
    p.add_argument("--procs", type=int, default=2, help="processes per contender, alternating")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hlo-dir", default=None, help="write each part's optimized HLO here")
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    parts = args.parts.split(",")
    unknown = [n for n in parts if n not in PARTS]
    if unknown:
        p.error(f"unknown parts {unknown}; parts: {', '.join(PARTS)}")
    wa = {"parts": parts, "rounds": args.rounds, "batch": args.batch, "seq": args.seq}
    load0 = common.load_average()
    print(f"`{common.command_line()}`\n")
    times = {"xla": {n: [] for n in parts}, "eager": {n: [] for n in parts}}
    for r in range(args.procs):
        for who in (("xla", "eager") if r % 2 == 0 else ("eager", "xla")):
            res = common.run_worker(__file__, who, args, dict(wa, hlo_dir=args.hlo_dir if r == 0 else None))
            if "error" in res:
                sys.exit(f"{who} worker failed: {res['error']}")
            for n, v in res["times"].items():
                times[who][n].extend(v)
            print(f"  round {r + 1}/{args.procs} {who}: " + ", ".join(
                f"{n} {statistics.median(v):.1f} ms" for n, v in res["times"].items()), file=sys.stderr, flush=True)
    print(f"load average {load0} before, {common.load_average()} after; {args.procs} processes per "
          f"contender x {args.rounds} runs per part\n")
    print("| part | xla ms (median) | eager ms (median) | xla / eager | xla min | eager min |")
    print("|---|---|---|---|---|---|")
    for n in parts:
        x, e = statistics.median(times["xla"][n]), statistics.median(times["eager"][n])
        print(f"| {n} | {x:.2f} | {e:.2f} | {x / e:.2f} | {min(times['xla'][n]):.2f} | {min(times['eager'][n]):.2f} |")


if __name__ == "__main__":
    main()
