"""Realistic tensors for bench_codecs.py: a small transformer trained here, and an LLM layer.

Both are built with torch on the CPU, deterministically (fixed seeds), and
cached as fp32 arrays in an ``.npz`` under the system's temp directory (not in
the repository: ``benchmarks/`` has no ignored cache folder), keyed by the
configuration and torch's version, so a re-run skips the training.

(1) ``trained``: a GPT-style decoder (learned positions, pre-LayerNorm blocks
    with biases, GELU MLP of 4x, untied LM head) trained in fp32 with AdamW on
    sequences from a fixed random Markov chain (every token has a few likely
    successors, so the loss falls well below ln(vocab)). Stored: the fp32
    weights, AdamW's fp32 ``exp_avg`` and ``exp_avg_sq``; and the same weights
    cast to bf16 after training (round to nearest even), as a bf16 checkpoint
    of that model would hold them.
(2) ``llm``: one Llama-shaped decoder layer (RMSNorm, q/k/v/o without bias,
    SwiGLU MLP; no RoPE, no embedding: the layer's tensors are what matter)
    initialised like a real init (normal std 0.02, norms 1), with fp32 master
    weights, then a few AdamW steps (Llama's betas 0.9/0.95) on random inputs
    regressed onto random targets, so the moments are not zeros. Stored, as a
    mixed-precision checkpoint holds them: the weights cast to bf16, and the
    fp32 ``exp_avg`` and ``exp_avg_sq``.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Tensor:
    """One tensor as castore stores it: a name, castore's dtype name, its bytes."""

    name: str
    dtype: str  # "float32" or "bfloat16"
    data: np.ndarray  # the tensor's bytes (uint8, or uint16 for bf16)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 4
    width: int = 256
    heads: int = 4
    vocab: int = 4096
    seq: int = 64
    batch: int = 8  # 300 steps: about a minute on one core
    steps: int = 300
    lr: float = 1e-3
    weight_decay: float = 0.1
    successors: int = 4  # likely next tokens per token in the Markov chain
    seed: int = 0


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int = 1536
    intermediate: int = 4096  # Llama's 8/3 h rounded up to 256
    heads: int = 12
    batch: int = 2
    seq: int = 256
    steps: int = 5
    lr: float = 3e-4
    weight_decay: float = 0.1
    seed: int = 0


QUICK_GPT = GPTConfig(steps=40)
QUICK_LLAMA = LlamaConfig(hidden=512, intermediate=1536, heads=4, steps=3)


# -- the small GPT ---------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        for name, param in self.named_parameters():
            if name.endswith(".weight") and param.dim() == 2:
                nn.init.normal_(param, std=0.02)
            elif name.endswith(".bias"):
                nn.init.zeros_(param)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


def _markov_batches(cfg: GPTConfig) -> Any:
    """Endless batches of token sequences from one fixed random Markov chain."""
    rng = np.random.default_rng(cfg.seed)
    successors = rng.integers(0, cfg.vocab, size=(cfg.vocab, cfg.successors))
    weights = rng.dirichlet(np.ones(cfg.successors))
    while True:
        seqs = np.empty((cfg.batch, cfg.seq + 1), dtype=np.int64)
        seqs[:, 0] = rng.integers(0, cfg.vocab, size=cfg.batch)
        picks = rng.choice(cfg.successors, size=(cfg.batch, cfg.seq), p=weights)
        for t in range(cfg.seq):
            seqs[:, t + 1] = successors[seqs[:, t], picks[:, t]]
        yield torch.from_numpy(seqs)


def train_gpt(cfg: GPTConfig) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The trained GPT's fp32 weights and AdamW moments, and what its training did."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    batches = _markov_batches(cfg)
    losses = []
    start = time.perf_counter()
    for _ in range(cfg.steps):
        seqs = next(batches)
        logits = model(seqs[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), seqs[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    arrays = _arrays(model, optimizer)
    info = {
        "train_s": seconds,
        "loss_first": losses[0],
        "loss_last10": float(np.mean(losses[-10:])),
        "loss_uniform": math.log(cfg.vocab),
        "params": sum(p.numel() for p in model.parameters()),
    }
    return arrays, info


# -- the Llama-shaped layer ------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, m = cfg.hidden, cfg.intermediate
        self.heads = cfg.heads
        self.input_layernorm = RMSNorm(h)
        self.q_proj, self.k_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h)
        self.gate_proj, self.up_proj = nn.Linear(h, m, bias=False), nn.Linear(h, m, bias=False)
        self.down_proj = nn.Linear(m, h, bias=False)
        for name, param in self.named_parameters():
            if not name.endswith("layernorm.weight"):
                nn.init.normal_(param, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        y = self.input_layernorm(x)
        q, k, v = (
            p(y).view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, c))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))  # type: ignore[no-any-return]


def step_llama(cfg: LlamaConfig) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The layer's fp32 master weights and AdamW moments after ``cfg.steps`` steps."""
    torch.manual_seed(cfg.seed)
    layer = LlamaLayer(cfg)
    optimizer = torch.optim.AdamW(
        layer.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    start = time.perf_counter()
    for _ in range(cfg.steps):
        x = torch.randn(cfg.batch, cfg.seq, cfg.hidden)
        target = torch.randn(cfg.batch, cfg.seq, cfg.hidden)
        loss = F.mse_loss(layer(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    info = {
        "train_s": time.perf_counter() - start,
        "params": sum(p.numel() for p in layer.parameters()),
    }
    return _arrays(layer, optimizer), info


# -- both ------------------------------------------------------------------------------


def _arrays(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    arrays = {}
    for name, param in model.named_parameters():
        arrays["weight:" + name] = param.detach().numpy().copy()
        state = optimizer.state[param]
        for moment in ("exp_avg", "exp_avg_sq"):
            arrays[f"{moment}:{name}"] = state[moment].numpy().copy()
    return arrays


def _cached(kind: str, cfg: Any, build: Any, refresh: bool) -> tuple[dict[str, np.ndarray], dict]:
    """``build(cfg)``'s arrays and info, from the cache when an earlier run left them."""
    key = json.dumps({"kind": kind, "cfg": asdict(cfg), "torch": torch.__version__})
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"castore-bench-codecs-{kind}-{digest}.npz"
    if path.exists() and not refresh:
        with np.load(path) as found:
            arrays = {name: found[name] for name in found.files if name != "__info__"}
            info = json.loads(str(found["__info__"]))
        info["cached"] = path.name
        return arrays, info
    arrays, info = build(cfg)
    partial = path.with_suffix(".partial.npz")
    np.savez(partial, __info__=np.array(json.dumps(info)), **arrays)
    partial.replace(path)
    info["cached"] = None
    return arrays, info


def _bf16_bytes(array: np.ndarray) -> np.ndarray:
    return torch.from_numpy(array).to(torch.bfloat16).view(torch.uint16).numpy()


def _group(arrays: dict[str, np.ndarray], prefix: str, bf16: bool = False) -> list[Tensor]:
    out = []
    for key, array in arrays.items():
        kind, _, name = key.partition(":")
        if kind != prefix:
            continue
        if bf16:
            out.append(Tensor(name, "bfloat16", _bf16_bytes(array)))
        else:
            out.append(Tensor(name, "float32", np.ascontiguousarray(array, dtype=np.float32)))
    return out


def trained_state(cfg: GPTConfig, refresh: bool = False) -> tuple[dict[str, list[Tensor]], dict]:
    """The trained GPT's groups of tensors (bf16 weights; fp32 weights and moments)."""
    arrays, info = _cached("gpt", cfg, train_gpt, refresh)
    info["config"] = asdict(cfg)
    groups = {
        "bf16 weights": _group(arrays, "weight", bf16=True),
        "fp32 weights": _group(arrays, "weight"),
        "fp32 exp_avg": _group(arrays, "exp_avg"),
        "fp32 exp_avg_sq": _group(arrays, "exp_avg_sq"),
    }
    return groups, info


def llm_state(cfg: LlamaConfig, refresh: bool = False) -> tuple[dict[str, list[Tensor]], dict]:
    """The Llama-shaped layer's groups (bf16 weights; fp32 moments)."""
    arrays, info = _cached("llama", cfg, step_llama, refresh)
    info["config"] = asdict(cfg)
    groups = {
        "bf16 weights": _group(arrays, "weight", bf16=True),
        "fp32 exp_avg": _group(arrays, "exp_avg"),
        "fp32 exp_avg_sq": _group(arrays, "exp_avg_sq"),
    }
    return groups, info
