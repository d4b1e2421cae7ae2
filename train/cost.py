"""What a training config will cost before it is launched (``scripts/cost.py``).

Per-GPU memory (the frozen target or its shard, the head with its gradients and AdamW state, the
activations of one micro-batch), disk for offline features, tokens per optimizer step and a step
time from a measured throughput. Every number is printed with its arithmetic so a reader can check
it by hand. Parameter counts are exact: the target (from its config.json, or ``KNOWN_TARGETS`` for a
few Hub ids) and the head are built on the meta device, which allocates nothing. Activations follow a
per-token count of the tensors alive at the peak (``activation_bytes_per_token``), checked against
measured peaks in docs/scaling.md. A hybrid target's per-sequence decoding states (``target.state_memory``)
are printed beside the plan. Nothing is downloaded.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from draftsmith.data.base.checks import at_most
from draftsmith.data.base.names import DEMO_PREFIX, is_demo
from draftsmith.data.feature_store import bytes_per_token, state_widths
from draftsmith.data.targets import resolve_target
from draftsmith.heads import build_head
from draftsmith.target.state_memory import StateMemory, state_memory
from draftsmith.target.model import decoder_layers
from draftsmith.train.config import TrainConfig

GIB = 2**30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAMW_BYTES = 4 + 4 + 8  # per trained parameter: fp32 weight, fp32 gradient, AdamW's two fp32 moments
DDP_BUCKET_BYTES = 4  # DDP's gradient buckets: a second fp32 copy of the gradients (more than one process)
GATHERED_LAYERS = 2  # FSDP: the layer running and the next one being all-gathered

# config.json shapes of Hub targets, so planning needs no download (sources: docs/scaling.md)
KNOWN_TARGETS: dict[str, dict] = {
    "meta-llama/Llama-3.3-70B-Instruct": dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_theta=500000.0, rms_norm_eps=1e-5, dtype="bfloat16"),
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_theta=500000.0, rms_norm_eps=1e-5, dtype="bfloat16"),
    "Qwen/Qwen3-8B": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6, dtype="bfloat16"),
}
KNOWN_TARGETS["meta-llama/Llama-3.1-8B"] = KNOWN_TARGETS["meta-llama/Llama-3.1-8B-Instruct"]


def target_config(target: str) -> PretrainedConfig:
    """The target's config: a local directory's config.json (a cached ``demo:`` target included), or
    the built-in shape of a known Hub id; anything else is refused (planning downloads nothing)."""
    if target in KNOWN_TARGETS:
        shape = dict(KNOWN_TARGETS[target])
        return AutoConfig.for_model(shape.pop("model_type"), **shape)
    if is_demo(target):  # only a demo LM already in the cache: planning neither builds nor fetches one
        from draftsmith.data.demo import demo_target_dir

        size = target.removeprefix(DEMO_PREFIX)
        if size == "smollm2":
            raise ValueError(f"target {target}: pass the model's directory (cost.py downloads nothing)")
        directory = demo_target_dir(size)
        if not (directory / "config.json").is_file():
            raise ValueError(f"target {target}: not in the cache yet; build it first (python "
                             f"scripts/make_demo_target.py --size {size}) or pass the model's directory")
        return AutoConfig.from_pretrained(directory)
    if Path(target).expanduser().is_dir():
        return AutoConfig.from_pretrained(resolve_target(target))
    raise ValueError(f"target {target!r}: not a local directory and not one of the known Hub shapes "
                     f"({', '.join(KNOWN_TARGETS)}); pass the directory holding its config.json (cost.py "
                     "downloads nothing)")


@dataclass
class Shapes:
    """Parameter counts and sizes read from the target's config and the head built on it."""

    target_params: int
    layer_params: int  # all decoder layers
    one_layer: int
    num_layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_dim: int  # num_key_value_heads × head_dim
    head_params: int  # trained
    head_hidden: int
    head_intermediate: int
    draft_vocab: int
    aux_layers: int


def shapes(cfg: TrainConfig, config: PretrainedConfig) -> Shapes:
    """Exact parameter counts of ``config``'s model and of ``cfg``'s head, built on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        head = build_head(cfg.head.kind, config, **cfg.head.build_options())
    layers = decoder_layers(model)
    layer_params = sum(p.numel() for p in layers.parameters())
    head_cfg = head.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Shapes(
        target_params=sum(p.numel() for p in model.parameters()), layer_params=layer_params,
        one_layer=layer_params // len(layers), num_layers=len(layers), hidden=config.hidden_size,
        intermediate=config.intermediate_size, vocab=config.vocab_size,
        kv_dim=getattr(config, "num_key_value_heads", heads) * head_dim,
        head_params=sum(p.numel() for p in head.parameters() if p.requires_grad),
        head_hidden=head_cfg.hidden_size, head_intermediate=getattr(head_cfg, "intermediate_size", 0),
        draft_vocab=getattr(head_cfg, "draft_vocab_size", None) or config.vocab_size,
        aux_layers=len(getattr(head, "feature_layer_ids", ()) or ()))


def activation_bytes_per_token(cfg: TrainConfig, s: Shapes) -> tuple[float, str]:
    """Bytes per token of one micro-batch at the activation peak, and the formula.

    EAGLE-3: the features kept for the whole step (aux states and embeddings in fp32, the soft labels
    over the draft vocabulary Vd in fp32), plus the larger of the target pass (its full logits and the
    fp32 soft-label softmax) and the head's training-time test, where each of S steps keeps for backward
    about 14 hidden-size and 4 MLP-width vectors of its draft layer, two Vd-wide fp32 vectors (the
    log-softmax of its logits and the soft labels it is compared with) and its share of the growing TTT
    key/value cache; at the start of the backward the gradients of the last step's tensors are as large
    again as what that step kept, hence S + 1 steps. Other head kinds are not modelled yet.
    """
    if cfg.head.kind != "eagle3":
        raise ValueError(f"plan: activation estimates exist for head.kind=eagle3 only (got head.kind="
                         f"{cfg.head.kind}); see docs/scaling.md")
    act = 4 if cfg.train.mixed_precision == "no" else 2  # the head's matmul outputs under autocast
    tgt = _dtype_bytes(cfg)
    steps = cfg.head.ttt_steps
    features = (s.aux_layers + 1) * s.hidden * 4 + s.draft_vocab * 4
    target_pass = s.vocab * tgt + 2 * s.draft_vocab * 4
    per_step = (14 * s.head_hidden + 4 * s.head_intermediate) * act + 2 * s.draft_vocab * 4
    kv = 2 * s.kv_dim * act * steps * (steps + 1) // 2  # step k keeps keys and values of k+1 steps
    head_pass = (steps + 1) * per_step + kv  # + 1: the gradients of the step being differentiated
    total = features + max(target_pass, head_pass)
    formula = (f"features {features:,} [({s.aux_layers}+1)·H·4 + Vd·4] + max(target pass {target_pass:,} "
               f"[V·{tgt} + 2·Vd·4], head {head_pass:,} [(S+1)={steps + 1} × ((14·H + 4·I)·{act} + 2·Vd·4) + "
               f"KV 2·kv·{act}·S(S+1)/2]) = {total:,} B/token")
    return total, formula


def _dtype_bytes(cfg: TrainConfig) -> int:
    """Bytes per value of the frozen target (loaded in the run's precision, fp32 for no)."""
    return 4 if cfg.train.mixed_precision == "no" else 2


@dataclass
class CostEstimate:
    """Per-GPU bytes by part, with the arithmetic behind each, and what a launch would process."""

    parts: dict[str, float]  # name -> bytes per GPU
    arithmetic: dict[str, str]  # name -> how it was computed
    world: int
    gpu_bytes: float
    tokens_per_step: int
    step_seconds: float | None
    disk_bytes: int | None
    disk_arithmetic: str
    host_bytes: float  # CPU memory per node while the target loads
    host_arithmetic: str
    advice: list[str] = field(default_factory=list)
    states: StateMemory | None = None  # a hybrid target's recurrent/conv states when decoding (None: no such layers)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes


def make_plan(cfg: TrainConfig, config: PretrainedConfig, gpus: int, nodes: int = 1, *, gpu_memory_gib: float = 80.0,
              tokens_per_s: float | None = None, rows: int | None = None, feature_dtype: str = "bfloat16") -> CostEstimate:
    """The plan of ``cfg`` on ``nodes`` × ``gpus`` GPUs (one training process per GPU)."""
    if gpus < 1 or nodes < 1:
        raise ValueError(f"--gpus and --nodes must be >= 1 (got {gpus}, {nodes})")
    # the check training makes when it loads the target: a plan for a run that would be refused is none
    at_most("data.max_length", cfg.data.max_length, getattr(config, "max_position_embeddings", None),
            of="the target's max_position_embeddings")
    s = shapes(cfg, config)
    world = gpus * nodes
    tgt = _dtype_bytes(cfg)
    sharded = cfg.train.target_sharding == "fsdp" and world > 1
    parts, how = {}, {}
    rest = s.target_params - s.layer_params
    if sharded:
        gathered = min(GATHERED_LAYERS, s.num_layers) * s.one_layer
        parts["target"] = (s.layer_params / world + rest + gathered) * tgt
        how["target"] = (f"decoder layers {s.layer_params:,} params × {tgt} B / {world} shards + embeddings, "
                         f"final norm, lm_head {rest:,} × {tgt} B (whole) + {min(GATHERED_LAYERS, s.num_layers)} "
                         f"gathered layers × {s.one_layer:,} × {tgt} B")
    else:
        parts["target"] = s.target_params * tgt
        how["target"] = f"{s.target_params:,} params × {tgt} B (whole in every process)"
    stored = str(getattr(config, "dtype", None) or "").removeprefix("torch.")
    if stored and _DTYPE_BYTES.get(stored) == tgt:  # safetensors memory-mapped, no conversion: shared pages
        host = s.target_params * tgt
        host_how = (f"{s.target_params:,} params × {tgt} B once: every process loads the whole target, memory-"
                    f"mapped from the {stored} checkpoint, so the processes of a node share its pages")
    else:
        host = gpus * s.target_params * tgt
        host_how = (f"{gpus} processes × {s.target_params:,} params × {tgt} B: every process converts the "
                    f"{stored or 'unknown-dtype'} checkpoint to its own copy before sharding it")
    per_param = ADAMW_BYTES + (DDP_BUCKET_BYTES if world > 1 else 0)
    parts["head"] = s.head_params * per_param
    how["head"] = (f"{s.head_params:,} trained params × {per_param} B (fp32 weight 4 + grad 4 + AdamW 8"
                   f"{' + DDP buckets 4' if world > 1 else ''})")
    per_token, formula = activation_bytes_per_token(cfg, s)
    micro, length = cfg.train.micro_batch_size, cfg.data.max_length
    parts["activations"] = micro * length * per_token
    how["activations"] = f"micro_batch {micro} × max_length {length} tokens × {formula}"
    tokens_per_step = micro * length * cfg.train.grad_accum_steps * world
    step_seconds = tokens_per_step / (tokens_per_s * world) if tokens_per_s else None
    disk, disk_how = None, "unknown: pass --rows N (training rows) to estimate it"
    if rows is not None:
        per_token = bytes_per_token(state_widths(s.hidden, s.aux_layers), feature_dtype)
        disk = rows * length * per_token
        disk_how = (f"{rows:,} rows × {length} tokens (max_length, an upper bound) × {per_token:,} B/token "
                    f"(({s.aux_layers} aux + 1) × H {s.hidden} × {feature_dtype} + ids and mask 9 B, "
                    "data.feature_store.bytes_per_token: what scripts/dump_features.py stores)")
    plan = CostEstimate(parts, how, world, gpu_memory_gib * GIB, tokens_per_step, step_seconds, disk, disk_how, host,
                host_how, states=state_memory(config, tgt))
    if not plan.fits:
        plan.advice = _advice(cfg, plan, s, per_token, world, tgt)
    return plan


def _advice(cfg: TrainConfig, plan: CostEstimate, s: Shapes, per_token: float, world: int, tgt: int) -> list[str]:
    """Which setting to change, the largest saving first."""
    advice = []
    over = plan.total - plan.gpu_bytes
    if cfg.train.target_sharding == "none" and world > 1:
        saved = s.layer_params * tgt * (1 - 1 / world) - GATHERED_LAYERS * s.one_layer * tgt
        advice.append(f"train.target_sharding=fsdp: the target's decoder layers shrink by {saved / GIB:.1f} GiB "
                      f"per GPU over {world} processes")
    length = cfg.data.max_length
    room = plan.gpu_bytes - (plan.total - plan.parts["activations"])
    micro = int(room // (length * per_token)) if room > 0 else 0
    if 1 <= micro < cfg.train.micro_batch_size:
        accum = -(-cfg.train.micro_batch_size * cfg.train.grad_accum_steps // micro)
        advice.append(f"train.micro_batch_size={micro} train.grad_accum_steps={accum}: activations fit "
                      f"({micro} × {length} tokens), about the same tokens per step")
    elif micro < 1 and room > 0:
        fitting = int(room // per_token)
        advice.append(f"data.max_length={fitting} with train.micro_batch_size=1: one micro-batch's activations "
                      f"fit only below {fitting} tokens")
    if cfg.train.mixed_precision == "no":
        advice.append("train.mixed_precision=bf16: the target in bf16 (half its bytes) and smaller activations")
    if not advice or room <= 0:
        advice.append(f"more GPUs (--gpus) with train.target_sharding=fsdp, or a GPU with more than "
                      f"{plan.gpu_bytes / GIB:.0f} GiB: {over / GIB:.1f} GiB over")
    return advice


def format_plan(cfg: TrainConfig, plan: CostEstimate, gpus: int, nodes: int) -> str:
    """The plan as text, one line per part with its arithmetic."""
    lines = [f"plan: {cfg.head.kind} head on {cfg.target}, {nodes} node(s) × {gpus} GPU(s) = {plan.world} "
             f"processes, train.target_sharding={cfg.train.target_sharding}, "
             f"train.mixed_precision={cfg.train.mixed_precision}", "", "per-GPU memory (GiB = 2^30 bytes):"]
    for name, value in plan.parts.items():
        lines.append(f"  {name:<12} {value / GIB:8.2f} GiB = {plan.arithmetic[name]}")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"  {'total':<12} {plan.total / GIB:8.2f} GiB of {plan.gpu_bytes / GIB:.0f} GiB: {verdict}")
    lines += ["", f"tokens per step: {plan.tokens_per_step:,} = micro_batch {cfg.train.micro_batch_size} × max_length "
              f"{cfg.data.max_length} × grad_accum {cfg.train.grad_accum_steps} × {plan.world} processes "
              "(an upper bound: shorter rows carry fewer tokens)"]
    if plan.step_seconds is None:
        lines.append("step time: pass --tokens-per-s N (training tokens/s of one process, e.g. from --measure on "
                     "one GPU)")
    else:
        lines.append(f"step time: {plan.step_seconds:.2f} s = {plan.tokens_per_step:,} tokens / ({plan.world} × "
                     "measured tokens/s per process; FSDP all-gathers not counted)")
    lines.append(f"host memory per node while loading: {plan.host_bytes / GIB:.1f} GiB = {plan.host_arithmetic}")
    disk = "" if plan.disk_bytes is None else f"{plan.disk_bytes / GIB:.1f} GiB = "
    lines.append(f"disk for offline features: {disk}{plan.disk_arithmetic}")
    if plan.states is not None:  # decoding, not training: the head trains on full-sequence forwards
        st = plan.states
        weights = "fp32" if st.dtype_bytes == 4 else "16-bit"  # the target as this run loads it (_dtype_bytes)
        lines += ["", f"decoding on this hybrid target ({weights} weights), per sequence:",
                  f"  recurrent and conv states {st.per_sequence:,} B = {st.formula()}",
                  f"  + the checkpoint speculative decoding keeps per step (one copy of every state) {st.checkpoint:,} B",
                  f"  = {st.per_sequence + st.checkpoint:,} B per sequence, whatever the context length "
                  "(attention KV comes on top)"]
    if plan.advice:
        lines += ["", "to fit, change one of:"] + [f"  - {a}" for a in plan.advice]
    return "\n".join(lines)


# ---------------------------------------------------------------- measured peaks


def _proc_kib(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {key}: measuring CPU peaks needs Linux")
    return int(match.group(1))


def measure_peak(cfg: TrainConfig, steps: int = 3) -> dict:
    """Train ``cfg``'s head for a few steps in this process (``train.throughput.measure_throughput``)
    and measure the memory peak above what the process held before loading the target.

    CUDA: ``torch.cuda.max_memory_allocated`` minus the memory allocated before (tensors only).
    CPU: the resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) minus the
    resident set before: every page the process touched, tensors and allocator slack and the data
    set's pages included, so it is an upper bound of the tensors' peak.
    """
    from draftsmith.train.throughput import measure_throughput

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _proc_kib("VmRSS") * 1024
    start = time.perf_counter()
    result = measure_throughput(cfg, steps=steps, warmup=1)
    peak = torch.cuda.max_memory_allocated() if cuda else _proc_kib("VmHWM") * 1024
    return {"peak_bytes": peak - before, "what": "cuda max_memory_allocated" if cuda else "CPU VmHWM - VmRSS",
            "train_tokens_per_s": result["train_tokens_per_s"], "seconds": time.perf_counter() - start}
