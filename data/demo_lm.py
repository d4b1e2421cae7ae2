"""Pretrain a small causal LM on the stdlib corpus: the offline demo target (Llama architecture; the
``tiny-hybrid`` size is a Qwen3.5 hybrid, Gated DeltaNet layers with full attention every 4th).

``train_lm(out_dir, settings)`` trains a byte-level BPE tokenizer (unless one is given), packs the
train split into fixed-length blocks, trains with AdamW + warmup/cosine under accelerate (fp32 on
CPU, bf16 autocast on GPU), evaluates on the held-out split against a unigram baseline and saves
model, tokenizer and ``demo_target.json`` (summary + settings) into ``out_dir``.

About ``chat_percent`` % of the train files are rendered as a one-turn ChatML conversation
("Write the Python module `x.y`." → the file), so the target has seen its own chat template and
chat-format prompts make sense to it. Held-out evaluation uses plain files only.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerBase

from draftsmith.data.base.progress import progress
from draftsmith.data.corpus import corpus_fingerprint, relative_name, split_files, split_texts
from draftsmith.data.demo_mtp import JointMtp, add_mtp_tensors, heldout_mtp_loss, mellum_fields
from draftsmith.data.tokenizer import IM_END, train_tokenizer

SUMMARY_FILE = "demo_target.json"
EMBED_INIT_STD = 0.5  # see _init_for_depth
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LMSettings:
    """Everything that determines a demo LM; the cache key hashes all of it."""

    vocab_size: int = 4096  # ignored when a tokenizer is passed in (its length is used)
    hidden_size: int = 192
    num_layers: int = 8
    num_heads: int = 3
    num_kv_heads: int = 1
    intermediate_size: int = 512
    seq_len: int = 512  # training block length; also the saved max_position_embeddings
    # Small batches: at a CPU-sized token budget, more updates beat less noisy ones.
    batch_size: int = 2  # blocks per optimizer step (per process)
    max_steps: int = 1200
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_ratio: float = 0.05
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_tokens: int = 65536  # held-out tokens scored at the end (capped by the split's size)
    chat_percent: int = 10  # share of train files rendered as a ChatML conversation
    max_corpus_chars: int | None = None  # keep only the first files of each split (quick runs)
    seed: int = 0
    # "llama", or "qwen3_5": Qwen3.5's text model (Qwen3_5ForCausalLM), Gated DeltaNet ("linear attention")
    # layers with gated full attention every ``full_attention_interval``-th layer; the linear_* fields
    # size its DeltaNet layers (ignored by llama, and left out of a llama's cache key: see cache_key).
    architecture: str = "llama"
    full_attention_interval: int = 4
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    # "mellum" (demo:tiny-mtp): a dense Mellum trained with one MTP layer, loss = LM CE + mtp_loss_weight x the
    # MTP layer's CE on the token two ahead (DeepSeek-V3's lambda; data.demo_mtp); ignored by the others.
    mtp_loss_weight: float = 0.3

    def __post_init__(self) -> None:
        positive = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                    "seq_len", "batch_size", "max_steps", "eval_tokens", *HYBRID_FIELDS)
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"LMSettings.architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"LMSettings.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"LMSettings.hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LMSettings.num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}")
        if not 0 <= self.chat_percent <= 100:
            raise ValueError(f"LMSettings.chat_percent must be in [0, 100], got {self.chat_percent}")
        if not 0 <= self.warmup_ratio < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"LMSettings.warmup_ratio={self.warmup_ratio} must be in [0, 1) and "
                             f"min_lr_ratio={self.min_lr_ratio} in [0, 1]")
        if self.architecture == "qwen3_5" and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"LMSettings.linear_num_value_heads={self.linear_num_value_heads} is not divisible by "
                             f"linear_num_key_heads={self.linear_num_key_heads}")

    def cache_key(self) -> dict:
        """The fields that determine this LM: a llama's leave out the hybrid-only ones, so the demo LMs
        built before the hybrid size existed keep their cache entries."""
        fields = dataclasses.asdict(self)
        if self.architecture == "llama":
            for name in ("architecture", *HYBRID_FIELDS):
                del fields[name]
        if self.architecture == "mellum":
            for name in HYBRID_FIELDS:
                del fields[name]
        else:
            for name in MTP_FIELDS:
                del fields[name]
        return fields


ARCHITECTURES = ("llama", "qwen3_5", "mellum")
HYBRID_FIELDS = ("full_attention_interval", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim")
MTP_FIELDS = ("mtp_loss_weight",)


# tiny: 4.7M params, ~9 min on 2 idle CPU cores (2 threads), ~12 on shared ones (1 thread). small: ~90M
# params, minutes on one GPU (about 5 epochs of the corpus; more only overfits). assistant: a
# cheap drafter for HF assisted generation that shares the target's tokenizer. tiny-hybrid: tiny's
# recipe on a Qwen3.5 hybrid of the same width and depth (4.8M params; 6 Gated DeltaNet layers with
# 4 value heads of 32x32 state, full attention in layers 3 and 7): a training step costs ~1.1x tiny's on
# CPU with transformers' PyTorch DeltaNet kernels, so ~10 min (docs/hybrid-demo.md).
SIZES: dict[str, LMSettings] = {
    "tiny": LMSettings(),
    "small": LMSettings(vocab_size=8192, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                        intermediate_size=2048, seq_len=1024, batch_size=32, max_steps=400, lr=1e-3),
    "assistant": LMSettings(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=384),
    "tiny-hybrid": LMSettings(architecture="qwen3_5"),
    # 400 steps, not tiny's 1200: built on 2 CPU cores shared with other jobs, 1200 took about 55 minutes there
    "tiny-mtp": LMSettings(architecture="mellum", max_steps=400),
}


def settings_for(size: str, **overrides) -> LMSettings:
    """The preset for ``size`` with ``overrides`` applied (unknown fields raise)."""
    if size not in SIZES:
        raise ValueError(f"unknown demo size {size!r}; choose from {sorted(SIZES)}")
    return dataclasses.replace(SIZES[size], **overrides)


def _limit(texts: list[str], max_chars: int | None) -> list[str]:
    """The leading texts whose total length stays within ``max_chars`` (at least one)."""
    if max_chars is None:
        return texts
    kept, total = [], 0
    for text in texts:
        if kept and total + len(text) > max_chars:
            break
        kept.append(text)
        total += len(text)
    return kept


def _is_chat(name: str, chat_percent: int) -> bool:
    digest = hashlib.sha256(b"chat:" + name.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < chat_percent


def _module_name(name: str) -> str:
    parts = name.removesuffix(".py").split("/")
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def train_documents(tokenizer: PreTrainedTokenizerBase, settings: LMSettings) -> list[str]:
    """Train-split files as documents; ``chat_percent`` % of them as a one-turn conversation."""
    names = [relative_name(p) for p in split_files("train")]
    texts = _limit(split_texts("train"), settings.max_corpus_chars)
    docs = []
    for name, text in zip(names, texts):
        if _is_chat(name, settings.chat_percent):
            messages = [{"role": "user", "content": f"Write the Python module `{_module_name(name)}`."},
                        {"role": "assistant", "content": text}]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        docs.append(text)
    return docs


def pack(tokenizer: PreTrainedTokenizerBase, docs: list[str], seq_len: int) -> torch.Tensor:
    """Token blocks ``(N, seq_len)`` of the documents joined with EOS (the tail is dropped)."""
    ids = [tok for doc in tokenizer(docs)["input_ids"] for tok in (*doc, tokenizer.eos_token_id)]
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"corpus gives {len(ids)} tokens, fewer than one block of seq_len={seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def _lr_lambda(warmup: int, total: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


@torch.no_grad()
def heldout_losses(model, blocks: torch.Tensor, train_blocks: torch.Tensor, vocab_size: int,
                   batch_size: int, device: torch.device) -> tuple[float, float]:
    """(model loss, unigram-baseline loss) in nats/token over the predicted held-out positions.

    The unigram model is the add-one-smoothed token frequency of the train blocks.
    """
    counts = torch.bincount(train_blocks.flatten(), minlength=vocab_size).double() + 1
    log_p = counts.log() - counts.sum().log()
    targets = blocks[:, 1:]
    unigram = -log_p[targets].mean().item()
    model.eval()
    total, n = 0.0, 0
    for batch in blocks.split(batch_size):
        batch = batch.to(device)
        logits = model(input_ids=batch).logits[:, :-1].float()  # (B, T-1, V)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()  # note: a host-device sync point, once per eval batch
        n += batch[:, 1:].numel()
    return total / n, unigram


def build_model(settings: LMSettings, tokenizer: PreTrainedTokenizerBase):
    """A randomly initialised causal LM of ``settings.architecture`` sized by ``settings`` for ``tokenizer``."""
    hybrid = {}
    if settings.architecture == "qwen3_5":
        hybrid = dict(head_dim=settings.hidden_size // settings.num_heads,
                      layer_types=["full_attention" if (i + 1) % settings.full_attention_interval == 0
                                   else "linear_attention" for i in range(settings.num_layers)],
                      **{name: getattr(settings, name) for name in HYBRID_FIELDS if name.startswith("linear_")})
    if settings.architecture == "mellum":
        hybrid = mellum_fields(settings)
    model_type = {"qwen3_5": "qwen3_5_text", "mellum": "mellum"}.get(settings.architecture, "llama")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        max_position_embeddings=settings.seq_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **hybrid,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if settings.architecture == "mellum":  # built before the init below: MtpModel's post_init re-inits the shared embedding
        model = JointMtp(model, settings.mtp_loss_weight)
    _init_for_depth(model.lm if isinstance(model, JointMtp) else model, config)
    if isinstance(model, JointMtp):
        _init_for_depth(model.mtp, config, embeddings=False)
    return model


@torch.no_grad()
def _init_for_depth(model, config, embeddings: bool = True) -> None:
    """Re-initialise on top of HF's N(0, 0.02) everywhere, so a deep narrow LM learns fast early.

    Residual-output projections get std / sqrt(2L) (GPT-2), so the random blocks do not drown the
    stream; input embeddings get EMBED_INIT_STD, so token identity dominates it from step 0.
    Measured on tiny, 300 steps: held-out 6.01 nats -> 5.78 (scaled outputs) -> 5.49 (both). A hybrid's
    Gated DeltaNet layers write to the stream through ``linear_attn.out_proj``, scaled the same way; an MTP
    layer (``MtpModel``, ``embeddings=False``: it shares the trunk's) through its block's, as the trunk's.
    """
    std = config.initializer_range / math.sqrt(2 * config.num_hidden_layers)
    layers = [m.mtp_block for m in model.layers] if not embeddings else model.model.layers
    for layer in layers:
        mixer = layer.self_attn.o_proj if hasattr(layer, "self_attn") else layer.linear_attn.out_proj
        mixer.weight.normal_(0.0, std)
        layer.mlp.down_proj.weight.normal_(0.0, std)
    if embeddings:
        model.model.embed_tokens.weight.normal_(0.0, EMBED_INIT_STD)


def train_lm(out_dir: str | Path, settings: LMSettings, *, tokenizer: PreTrainedTokenizerBase | None = None,
             show_progress: bool = True, metadata: dict | None = None) -> dict:
    """Train a demo LM into ``out_dir`` and return its summary (also saved as ``demo_target.json``).

    ``tokenizer`` defaults to a new one trained on the train split; ``metadata`` is merged into the
    summary (the cache puts its fingerprint there).
    """
    out_dir = Path(out_dir)
    start = time.perf_counter()
    accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
    set_seed(settings.seed)
    if tokenizer is None:
        tokenizer = train_tokenizer(_limit(split_texts("train"), settings.max_corpus_chars), settings.vocab_size)
    settings = dataclasses.replace(settings, vocab_size=len(tokenizer))  # the summary records what was used
    train_blocks = pack(tokenizer, train_documents(tokenizer, settings), settings.seq_len)
    heldout_docs = _limit(split_texts("heldout"), settings.max_corpus_chars)
    heldout_blocks = pack(tokenizer, heldout_docs, settings.seq_len)[: max(1, settings.eval_tokens // settings.seq_len)]

    model = build_model(settings, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer, scheduler = _optimizer(model, settings)
    generator = torch.Generator().manual_seed(settings.seed)
    loader = DataLoader(TensorDataset(train_blocks), batch_size=settings.batch_size, shuffle=True,
                        drop_last=True, generator=generator)
    if len(loader) == 0:
        raise ValueError(f"{len(train_blocks)} train blocks are fewer than batch_size={settings.batch_size}")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, tokens_seen, train_seconds = _pretrain(model, loader, optimizer, scheduler, accelerator, settings,
                                                   show_progress)

    accelerator.wait_for_everyone()
    summary: dict = {}
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(model)
        joint, extra = (model if isinstance(model, JointMtp) else None), {}
        if joint is not None:  # demo:tiny-mtp: the trunk is saved as the LM, its MTP layer beside it
            model = joint.lm
            extra["heldout_mtp_loss"] = round(heldout_mtp_loss(joint, heldout_blocks, settings.batch_size,
                                                               accelerator.device), 4)
        heldout_loss, unigram_loss = heldout_losses(model, heldout_blocks, train_blocks, len(tokenizer),
                                                    settings.batch_size, accelerator.device)
        window = max(1, len(losses) // 20)
        summary = {
            **(metadata or {}),
            "params": n_params,
            "tokens_seen": tokens_seen,
            "train_tokens_per_epoch": train_blocks.numel(),
            "epochs": round(tokens_seen / train_blocks.numel(), 3),
            "train_seconds": round(train_seconds, 1),
            "total_seconds": round(time.perf_counter() - start, 1),
            "tokens_per_second": round(tokens_seen / train_seconds),
            "train_loss_curve": [round(sum(losses[i:i + window]) / len(losses[i:i + window]), 4)
                                 for i in range(0, len(losses), window)],
            "heldout_tokens": heldout_blocks[:, 1:].numel(),
            "heldout_loss": round(heldout_loss, 4),
            "unigram_heldout_loss": round(unigram_loss, 4),
            **extra,
            "device": str(accelerator.device),
            "mixed_precision": accelerator.mixed_precision,
            "corpus_fingerprint": corpus_fingerprint(),
            "settings": dataclasses.asdict(settings),
        }
        save_lm(out_dir, model, tokenizer, summary, mtp=joint.mtp if joint is not None else None)
        logger.info("demo LM trained\n%s", format_summary(summary))
    accelerator.wait_for_everyone()
    return summary


def _optimizer(model, settings: LMSettings):
    """AdamW (no weight decay on norms) and its warmup-then-cosine schedule."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # no weight decay on norms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr, betas=(0.9, 0.95))
    warmup = max(1, round(settings.warmup_ratio * settings.max_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(warmup, settings.max_steps, settings.min_lr_ratio))
    return optimizer, scheduler


def _pretrain(model, loader, optimizer, scheduler, accelerator: Accelerator, settings: LMSettings,
              show_progress: bool) -> tuple[list[float], int, float]:
    """``settings.max_steps`` steps over epochs of the packed blocks: (each step's loss, tokens seen, seconds)."""
    losses: list[float] = []
    tokens_seen = 0
    train_start = time.perf_counter()
    # a bar on a terminal; a log file gets a line a minute
    bar = progress(settings.max_steps, "pretrain demo target", enabled=show_progress and accelerator.is_main_process)
    model.train()
    while len(losses) < settings.max_steps:  # epochs over the packed blocks
        for (batch,) in loader:
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), settings.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # note: a host-device sync point, once per step
            tokens_seen += batch.numel() * accelerator.num_processes
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_seen / (time.perf_counter() - train_start):.0f}")
            if len(losses) == settings.max_steps:
                break
    bar.close()
    return losses, tokens_seen, time.perf_counter() - train_start


def save_lm(out_dir: Path, model, tokenizer: PreTrainedTokenizerBase, summary: dict, mtp=None) -> None:
    """Model (safetensors; with ``mtp``, its MTP layer in the same file: data.demo_mtp), tokenizer and summary
    into ``out_dir``; the summary is written last."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # Chat replies end with <|im_end|>, plain text with EOS: generation stops at either.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)])
    model.save_pretrained(out_dir)
    if mtp is not None:
        add_mtp_tensors(out_dir, mtp)
    tokenizer.save_pretrained(out_dir)
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def format_summary(summary: dict) -> str:
    """A few human-readable lines about a trained demo LM."""
    return (
        f"params {summary['params'] / 1e6:.2f}M | tokens seen {summary['tokens_seen'] / 1e6:.2f}M "
        f"({summary['epochs']:.2f} epochs) | train {summary['train_seconds']:.0f}s, "
        f"total {summary['total_seconds']:.0f}s | {summary['tokens_per_second']} tok/s\n"
        f"held-out loss {summary['heldout_loss']:.3f} nats/token vs unigram baseline "
        f"{summary['unigram_heldout_loss']:.3f} ({summary['heldout_tokens']} held-out tokens)"
    )
