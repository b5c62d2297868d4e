"""The benchmark models in PyTorch, written once and used by the xla contender (this
project or the original torch_xla) and by the eager-CPU contender.

Only plain torch / torch.nn is used here, so the module imports under any torch.
bench/models_jax.py holds the same three models written directly in jax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------
# MNIST CNN of the upstream test (test/test_train_mp_mnist.py)

class MNIST(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.bn1 = nn.BatchNorm2d(10)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.bn2 = nn.BatchNorm2d(20)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = self.bn1(x)
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = self.bn2(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def mnist_loss(model, x, y):
    return F.nll_loss(model(x), y)


# ---------------------------------------------------------------------------------------
# Decoder-only transformer (the shape of torch_xla's examples/decoder_only_model.py):
# RMSNorm, rotary embeddings, SiLU-gated MLP, grouped-query causal attention.

@dataclass
class DecoderConfig:
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    vocab_size: int = 3200
    max_seq: int = 512
    rms_eps: float = 1e-6
    rope_base: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotary_tables(seq, head_dim, base=10000.0):
    """(cos, sin), each (seq, head_dim): the llama layout (the two halves repeat)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    t = torch.arange(seq, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = cfg.hidden_size // cfg.num_attention_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
        scores = scores + mask
        probs = F.softmax(scores, dim=-1)
        out = torch.matmul(probs, v)
        out = out.transpose(1, 2).reshape(b, s, self.nh * self.hd)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderOnly(nn.Module):
    def __init__(self, cfg: DecoderConfig = DecoderConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        hd = cfg.hidden_size // cfg.num_attention_heads
        cos, sin = rotary_tables(cfg.max_seq, hd, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        mask = torch.full((cfg.max_seq, cfg.max_seq), float("-inf")).triu(1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, ids):
        s = ids.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        mask = self.causal_mask[:s, :s]
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.output(self.norm(x))


def decoder_loss(model, ids, labels):
    logits = model(ids)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


# ---------------------------------------------------------------------------------------
# ResNet-18-shaped CNN (this project's own definition): ImageNet stem (7x7/2 conv,
# 3x3/2 max pool), four stages of two basic blocks (64, 128, 256, 512 channels),
# global average pool, linear classifier.

class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + idt)


class ResNet18(nn.Module):
    def __init__(self, num_classes=10, width=64):
        super().__init__()
        w = width
        self.conv1 = nn.Conv2d(3, w, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        chans = [w, 2 * w, 4 * w, 8 * w]
        blocks, cin = [], w
        for i, c in enumerate(chans):
            stride = 1 if i == 0 else 2
            blocks.append(BasicBlock(cin, c, stride))
            blocks.append(BasicBlock(c, c, 1))
            cin = c
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(8 * w, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 3, 2, 1)
        x = self.blocks(x)
        x = x.mean(dim=(2, 3))
        return self.fc(x)


def resnet_loss(model, x, y):
    return F.cross_entropy(model(x), y)


# ---------------------------------------------------------------------------------------
# The benchmark configurations: model, data and optimizer of each workload.

@dataclass
class Workload:
    name: str
    batch: int
    make_model: object      # () -> nn.Module
    make_batch: object      # (seed) -> (inputs, targets) CPU tensors
    loss_fn: object         # (model, inputs, targets) -> scalar loss
    make_opt: object        # (params) -> torch.optim.Optimizer
    opt: str                # "sgd" or "adam" (for the jax contender)
    lr: float
    momentum: float = 0.0


def mnist_workload(batch=128):
    def make_batch(seed=0):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, 1, 28, 28, generator=g),
                torch.randint(0, 10, (batch,), generator=g))
    return Workload("mnist", batch, MNIST, make_batch, mnist_loss,
                    lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.5), "sgd", 0.01, 0.5)


def decoder_workload(batch=16, seq=512, cfg: DecoderConfig = None):
    cfg = cfg or DecoderConfig(max_seq=seq)

    def make_batch(seed=0):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return Workload("decoder", batch, lambda: DecoderOnly(cfg), make_batch, decoder_loss,
                    lambda ps: torch.optim.Adam(ps, lr=1e-4), "adam", 1e-4)


def resnet_workload(batch=32, size=64, width=64):
    def make_batch(seed=0):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, 3, size, size, generator=g),
                torch.randint(0, 10, (batch,), generator=g))
    return Workload("resnet18", batch, lambda: ResNet18(10, width), make_batch, resnet_loss,
                    lambda ps: torch.optim.SGD(ps, lr=0.01), "sgd", 0.01, 0.0)


def workload(name, quick=False):
    """The benchmark's workload `name`; quick=True shrinks it for a smoke test."""
    if name == "mnist":
        return mnist_workload(32 if quick else 128)
    if name == "decoder":
        if quick:
            return decoder_workload(2, 64, DecoderConfig(hidden_size=64, intermediate_size=128,
                                                         vocab_size=256, max_seq=64))
        return decoder_workload()
    if name == "resnet18":
        return resnet_workload(4, 32, 16) if quick else resnet_workload()
    raise ValueError(name)


WORKLOADS = ("mnist", "decoder", "resnet18")
