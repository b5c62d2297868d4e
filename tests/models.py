"""Small model definitions used by the model-level tests (tests/test_models.py).

Each model is small enough that 20 training steps run in a few seconds on 2 CPU cores.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------
# (a) the MNIST CNN of the upstream test (test/test_train_mp_mnist.py)

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


def mnist_data(steps, batch=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(batch, 1, 28, 28, generator=g) for _ in range(steps)]
    ys = [torch.randint(0, 10, (batch,), generator=g) for _ in range(steps)]
    return list(zip(xs, ys))


# ---------------------------------------------------------------------------------------
# (b) a decoder-only transformer

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq, head_dim, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    t = torch.arange(seq, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x, cos, sin):
    # x: (B, H, S, D); cos/sin: (S, D)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, use_sdpa=True, rope=True):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.use_sdpa = use_sdpa
        self.rope = rope
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        if self.use_sdpa:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
            mask = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ v
        o = o.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)
        return self.wo(o)


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _norm(dim, torch_rmsnorm):
    return nn.RMSNorm(dim, eps=1e-6) if torch_rmsnorm else RMSNorm(dim)


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, use_sdpa, rope, torch_rmsnorm):
        super().__init__()
        self.attn_norm = _norm(dim, torch_rmsnorm)
        self.attn = Attention(dim, n_heads, n_kv_heads, use_sdpa, rope)
        self.mlp_norm = _norm(dim, torch_rmsnorm)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Token embedding, RMSNorm, RoPE (or learned positions), GQA attention, SiLU-gated MLP."""

    def __init__(self, vocab=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, seq=32,
                 use_sdpa=True, rope=True, torch_rmsnorm=False):
        super().__init__()
        self.rope = rope
        self.tok = nn.Embedding(vocab, dim)
        if not rope:
            self.pos = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, use_sdpa, rope, torch_rmsnorm)
                                    for _ in range(n_layers))
        self.norm = _norm(dim, torch_rmsnorm)
        self.head = nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary_tables(seq, dim // n_heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx):
        B, S = idx.shape
        x = self.tok(idx)
        if not self.rope:
            x = x + self.pos(torch.arange(S, device=idx.device))
        cos, sin = self.cos[:S], self.sin[:S]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lm_data(steps, batch=4, seq=32, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    return out


# ---------------------------------------------------------------------------------------
# (c) a ResNet-style CNN

class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        idt = x if self.downsample is None else self.downsample(x)
        return F.relu(out + idt)


class ResNet(nn.Module):
    def __init__(self, num_classes=10, width=16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(width, width, stride=1)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        x = self.stem(x)
        x = self.layer2(self.layer1(x))
        x = F.adaptive_avg_pool2d(x, 1)
        return self.fc(torch.flatten(x, 1))


def image_data(steps, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(batch, 3, 32, 32, generator=g) for _ in range(steps)]
    ys = [torch.randint(0, 10, (batch,), generator=g) for _ in range(steps)]
    return list(zip(xs, ys))


# ---------------------------------------------------------------------------------------
# (d) a small MLP classifier (the SPMD tests train it on the CPU and on meshes)

def mlp(*hidden: int) -> nn.Sequential:
    """16 inputs -> `hidden` widths (ReLU) -> 4 classes, with weights from seed 0."""
    torch.manual_seed(0)
    widths = (16,) + hidden
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 4))


class ResidualBlock(nn.Module):
    """relu(fc(x)) + x over 16 features: a layer FSDPv2 wraps and module hooks attach to."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x)) + x


def mlp_batches(steps, batch=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def train_classifier(model, batches, prepare=None, after_step=None, lr=0.1):
    """SGD (momentum 0.9) on cross entropy; `prepare(x, y)` moves/annotates a batch,
    `after_step()` ends a step (e.g. `xm.mark_step`). Returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in batches:
        if prepare is not None:
            x, y = prepare(x, y)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()
        losses.append(loss.detach())
    return [float(v) for v in losses]
