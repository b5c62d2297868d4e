"""Greedy decoding throughput of a small decoder on the xla device: float32 `nn.Linear`
against `XlaQuantizedLinear` with int8 and int4 weights.

    PJRT_DEVICE=CPU python bench/bench_quantized_decode.py [--layers 4] [--d-model 512]
        [--tokens 16] [--runs 3] [--variants f32,int8,int8_act,int4,int4_block128]

One token per step (batch 1), a fixed-size key/value cache written at a position tensor,
so every step is the same program; the next token is the argmax, kept on the device, and
each step ends at `torch_xla.sync()`. Printed per variant: the median tokens/s over the
runs (after a warm-up run that compiles; the runs of the variants interleave), the bytes of the quantized projections' buffers
(weights, scales, zero points) and of the whole model. int4 weights are stored in an
int8 container (one value per byte), as `XlaQuantizedLinear` keeps them.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

import torch_xla
from torch_xla.experimental.xla_quantized_matmul import XlaQuantizedLinear


class Block(nn.Module):
    def __init__(self, d: int, heads: int, max_len: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, heads, max_len, d // heads))
        self.register_buffer("v_cache", torch.zeros(1, heads, max_len, d // heads))

    def forward(self, x, pos, mask):
        b, _, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, 1, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        att = (q @ self.k_cache.transpose(-1, -2)) / (d // self.heads) ** 0.5
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.out((att @ self.v_cache).transpose(1, 2).reshape(b, 1, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, max_len) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, token, pos):
        x = self.embed(token).view(1, 1, -1)
        mask = torch.arange(self.max_len, device=token.device) <= pos
        for blk in self.blocks:
            x = blk(x, pos, mask)
        return self.head(self.norm(x)).argmax(-1).view(1)


def _quantize(w: torch.Tensor, n_bits: int, block_size: int):
    """Symmetric round-to-nearest: (int8 weight in the op's layout, scale)."""
    n, k = w.shape
    rows = w if block_size == -1 else w.reshape(n * k // block_size, block_size)
    qmax = 2 ** (n_bits - 1) - 1
    scale = rows.abs().amax(dim=1).clamp(min=1e-8) / qmax
    q = torch.clamp(torch.round(rows / scale[:, None]), -qmax - 1, qmax).to(torch.int8)
    if block_size == -1:
        return q, scale
    return (q.reshape(n, k // block_size, block_size).permute(1, 2, 0).contiguous(),
            scale.reshape(n, k // block_size).t().contiguous())


VARIANTS = {  # name: (bits, block size, quantized activations), None for float32
    "f32": None,
    "int8": (8, -1, False),
    "int8_act": (8, -1, True),
    "int4": (4, -1, False),
    "int4_block128": (4, 128, False),
}


def quantize_model(model: Decoder, variant: str) -> Decoder:
    spec = VARIANTS[variant]
    if spec is None:
        return model
    bits, block, act = spec
    for blk in model.blocks:
        for name in ("qkv", "out", "up", "down"):
            lin = getattr(blk, name)
            q = XlaQuantizedLinear(lin.in_features, lin.out_features, is_symmetric=True, block_size=block,
                                   int4_weight=bits == 4, quantize_activation=act)
            q.load_quantized_weight(*_quantize(lin.weight.data, bits, block))
            setattr(blk, name, q)
    return model


def projection_bytes(model: Decoder) -> int:
    total = 0
    for blk in model.blocks:
        for name in ("qkv", "out", "up", "down"):
            mod = getattr(blk, name)
            total += sum(t.numel() * t.element_size() for t in list(mod.parameters()) + list(mod.buffers()))
    return total


def model_bytes(model: Decoder) -> int:
    caches = {id(b.k_cache) for b in model.blocks} | {id(b.v_cache) for b in model.blocks}
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
               if id(t) not in caches)


def decode(model: Decoder, tokens: int, dev) -> float:
    """Tokens/s of one greedy decode of `tokens` steps from position 0."""
    token = torch.zeros(1, dtype=torch.long, device=dev)
    torch_xla.sync()
    start = time.perf_counter()
    for i in range(tokens):
        token = model(token, torch.tensor([i], device=dev))
        torch_xla.sync()
    token.cpu()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    dev = torch_xla.device()
    print(f"decoder: {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, batch 1, "
          f"{args.tokens} tokens per run, median of {args.runs} runs after a warm-up run")
    models, sizes = {}, {}
    for variant in args.variants.split(","):
        torch.manual_seed(0)
        model = quantize_model(Decoder(args.vocab, args.d_model, args.layers, args.heads, args.tokens), variant)
        sizes[variant] = (projection_bytes(model), model_bytes(model))
        models[variant] = model.to(dev).eval()
    rates = {v: [] for v in models}
    with torch.no_grad():
        for model in models.values():
            decode(model, args.tokens, dev)
        # Rounds interleave the variants, so a change in the machine's load hits them alike.
        for _ in range(args.runs):
            for variant, model in models.items():
                rates[variant].append(decode(model, args.tokens, dev))
    print("| variant | tokens/s | projection bytes | model bytes |\n| --- | --- | --- | --- |")
    for variant, (proj, whole) in sizes.items():
        print(f"| {variant} | {statistics.median(rates[variant]):.1f} | {proj:,} | {whole:,} |")

if __name__ == "__main__":
    main()
