"""The decoding methods compared on a real target, and timing them on the same prompts."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from draftsmith.data.base.device import sync
from draftsmith.data.targets import resolve_target
from draftsmith.heads import AutoHead
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.infer.bench.timing import ForwardCounter, peak_memory_mib, reset_peak_memory
from draftsmith.infer.drafter_spec import build_drafter, parse_drafter
from draftsmith.infer.drafters import TreeOption, fit_chain, head_drafter_class
from draftsmith.target.recurrent import is_hybrid
from draftsmith.infer.tree_shape import build_tree, parse_tree_shape


@dataclass
class Method:
    """One decoding method and its timed runs (one dict per prompt)."""

    name: str
    kind: str  # vanilla | assisted | prompt_lookup | head
    run: object  # callable(input_ids) -> output ids (1, P + new)
    runs: list[dict] = field(default_factory=list)
    generator: SpeculativeGenerator | None = None  # head methods: counts come from its stats
    compiled: bool = False  # runs a compiled graph: module hooks would not see its forwards


def tree_from_spec(spec: str, head, device: torch.device) -> TreeOption | None:
    """The tree named by a ``--trees`` entry other than ``default`` (the generator's own default, on
    CPU an EAGLE head's adaptive chain) for this head (``infer.tree_shape``), or None when it does not fit its
    kind."""
    shape = parse_tree_shape(spec)  # a shape no head drafts is a mistake: raised
    if shape.form == "default":
        raise ValueError("--trees: 'default' is the generator's own draft, no tree to build")
    try:
        return build_tree(shape, head, device)
    except ValueError:  # this head's kind cannot draft it: skipped
        return None


def default_draft(head, device: torch.device) -> TreeOption | str:
    """What a generator given no tree drafts with ``head`` on ``device`` ("adaptive": the kind's
    adaptive chain), for telling ``default`` apart from the other ``--trees``."""
    drafter = head_drafter_class(head)
    if drafter.adapts_by_default(device):
        return "adaptive"
    return fit_chain(head, drafter.default_tree(device))


class _Builder:
    """What ``build_methods`` shares between its parts: the target, the benchmark's settings, the methods so far
    and the ones left out with their reasons."""

    def __init__(self, args, target, tokenizer, skipped: dict[str, str]) -> None:
        self.args, self.target, self.tokenizer, self.skipped = args, target, tokenizer, skipped
        self.hybrid = is_hybrid(target)
        self.refused = f"transformers refuses assisted generation on stateful models ({type(target).__name__})"
        self.chains_only = (f"{type(target).__name__} is a hybrid: its recurrent layers read a verify's tokens as one "
                            "sequence, so drafts are chains")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.common = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
        if args.ignore_eos:
            self.common["eos_token_id"] = None
        # HF reads an explicit eos_token_id=None as "no EOS"; SpeculativeGenerator reads None as "the
        # generation config's", as HF does by default: an empty list means no EOS for it.
        self.eos = [] if args.ignore_eos else None
        self.loaded: dict = {}  # models loaded once, by their spec path (the assistant, heads)
        self.methods: list[Method] = []

    def hf(self, name: str, kind: str, compiled: bool = False, **extra) -> None:
        target, common = self.target, self.common
        run = lambda ids: target.generate(ids, attention_mask=torch.ones_like(ids), **common, **extra)  # noqa: E731
        self.methods.append(Method(name, kind, run, compiled=compiled))

    def ours(self, name: str, kind: str, drafter, tree: TreeOption | None = None) -> None:
        gen = SpeculativeGenerator(self.target, drafter, tokenizer=self.tokenizer, tree=tree, compile=self.args.compile)
        run = lambda ids: gen.generate(ids, max_new_tokens=self.args.max_new_tokens, eos_token_id=self.eos)  # noqa: E731
        self.methods.append(Method(name, kind, run, generator=gen))

    def spec(self, name: str, kind: str, spec: str, **options) -> None:
        """Our decoding with the drafter ``spec`` names (``infer.drafter_spec``, the CLI's parser)."""
        self.ours(name, kind, build_drafter(parse_drafter(spec), self.target, loaded=self.loaded, **options))

    def assisted(self) -> None:
        """HF's assisted generation and our draft-LM drafters on ``--assistant``."""
        args = self.args
        assistant = AutoModelForCausalLM.from_pretrained(resolve_target(args.assistant, role="assistant"),
                                                         dtype=self.target.dtype).to(self.target.device).eval()
        self.loaded[args.assistant] = assistant
        if self.hybrid:
            self.skipped["hf-assisted"] = self.refused
        else:
            self.hf("hf-assisted", "assisted", assistant_model=assistant)
        # HF's assisted generation (transformers 5.x defaults): up to 20 drafts, a draft stops below
        # probability 0.4 (HF then tunes that threshold); ours: a chain of 4, and +2/-1 adaptive with the 0.4 stop.
        self.spec("draft-lm:chain4", "draft_lm", f"lm:{args.assistant}", length=4)
        self.spec("draft-lm:adaptive", "draft_lm", f"lm:{args.assistant}", length=20, adaptive=True, confidence=0.4)
        # Hierarchical: the same chain of 4, the assistant's own drafts guessed by prompt lookup ...
        self.spec("draft-lm+ngram:chain4", "draft_lm", f"lm:{args.assistant}+ngram", length=4)
        if args.assistant_head:  # ... or by a head trained on the assistant
            self.spec("draft-lm+head:chain4", "draft_lm", f"lm:{args.assistant}+head:{args.assistant_head}", length=4)

    def prompt_lookup(self) -> None:
        """HF's prompt lookup (n-grams of 2 down to 1, prompt_lookup_num_tokens drafts, first match) and ours."""
        length = self.args.prompt_lookup_tokens
        if self.hybrid:
            self.skipped["hf-prompt-lookup"] = self.refused
        else:
            self.hf("hf-prompt-lookup", "prompt_lookup", prompt_lookup_num_tokens=length)
        self.spec("ngram:chain", "ngram", "ngram", length=length, max_ngram=2)
        if self.hybrid:
            self.skipped["ngram:tree3"] = self.chains_only
        else:
            self.spec("ngram:tree3", "ngram", "ngram", length=length, max_ngram=2, branches=3)
        self.spec("ngram:adaptive", "ngram", "ngram", length=length, max_ngram=2, adaptive=True)

    def head(self, head_dir: str) -> None:
        """``head_dir``'s head with every ``--trees`` draft it can make (each once), then behind prompt lookup and
        with an adaptive chain when asked."""
        args, target = self.args, self.target
        head = self.loaded[head_dir] = AutoHead.from_pretrained(head_dir).eval()
        prefix = head_label(head, head_dir, args.heads)
        seen = []  # the drafts already run for this head: "default" is often "tree" or a chain on its own
        for variant in args.trees:
            tree = None if variant == "default" else tree_from_spec(variant, head, target.device)
            if tree is None and variant != "default":  # the kind cannot draft it
                continue
            if self.hybrid and tree is not None and not isinstance(tree, Chain):
                self.skipped[f"{prefix}:{variant}"] = self.chains_only
                continue
            draws = default_draft(head, target.device) if tree is None else tree
            if draws not in seen:
                seen.append(draws)
                self.ours(f"{prefix}:{variant}", "head", head, tree)
        if getattr(args, "lookup_first", False):  # prompt lookup when it finds >= 2 tokens, the head's default otherwise
            self.spec(f"{prefix}:lookup-first", "head", f"head:{head_dir}+lookup-first")
        if args.adaptive and "adaptive" not in seen:  # a chain whose length follows acceptance (Medusa: <= its heads)
            self.spec(f"{prefix}:adaptive", "head", f"head:{head_dir}", adaptive=True)


def build_methods(args, target, tokenizer, skipped: dict[str, str] | None = None) -> list[Method]:
    """The methods ``args`` asks for, vanilla first: HF baselines, our classic drafters, every head. Every drafter
    but a head's own trees is named by a drafter spec, as the CLI's ``--drafter`` (``infer.drafter_spec``).

    On a hybrid target some cannot run: HF's assisted generation and prompt lookup (transformers refuses
    stateful models) and every tree (its recurrent layers read a verify's tokens as one sequence: chains
    only). They are left out, each with a one-line reason in ``skipped`` (name -> reason) for the report."""
    build = _Builder(args, target, tokenizer, {} if skipped is None else skipped)
    build.hf("vanilla", "vanilla")
    if not args.no_hf_static:
        build.hf("hf-static", "vanilla", compiled=True, cache_implementation="static")
    if args.assistant:
        build.assisted()
    if not args.no_prompt_lookup:
        build.prompt_lookup()
    for k in getattr(args, "layer_skip", None) or ():  # self-speculation: the target's first k layers draft
        build.spec(f"layer-skip:{k}", "layer_skip", f"layer-skip:{k}", length=4)
    for head_dir in args.heads:
        build.head(head_dir)
    return build.methods


ACCEPTANCE_COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
                     "acceptance_histogram")


def acceptance_counts(stats) -> dict:
    """A generator call's acceptance counts in vLLM's names (``GenerationStats``), to pool over prompts."""
    return {k: getattr(stats, k) for k in ACCEPTANCE_COUNTS}


def time_methods(methods: list[Method], prompts, args, target, counter: ForwardCounter,
                 deadline: float | None = None) -> int:
    """Time every method on every prompt, methods interleaved per prompt; fills ``method.runs``.
    Past ``deadline`` (``time.monotonic()``) no new prompt starts, so every method keeps the same
    prompts; returns how many were timed (at least one)."""
    device = target.device
    total = len(methods) * len(prompts) * (args.warmup + args.repeats)
    bar = tqdm(total=total, desc="benchmark", unit="gen")
    for p_idx, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device=device)
        for method in methods:  # interleaved per prompt: slow drifts hit every method alike
            counter.enabled(method.generator is None and not method.compiled)
            times = []
            for rep in range(args.warmup + args.repeats):
                counter.reset()
                reset_peak_memory(device)
                sync(device)
                start = time.perf_counter()
                with torch.inference_mode():
                    out = method.run(ids)
                sync(device)
                elapsed = time.perf_counter() - start
                bar.update()
                if rep >= args.warmup:
                    times.append(elapsed)
            new = out[0, ids.shape[1]:].tolist()
            if method.generator is not None:  # the generator counts its own forwards
                stats = method.generator.last_stats
                forwards, verify_mean = stats.target_forwards, stats.verified_tokens / max(1, stats.steps)
            elif method.compiled:  # HF's static-cache generate: one forward per token
                forwards, verify_mean = len(new), 1.0
            else:
                verify = counter.lengths[1:]  # the first forward is the prefill
                forwards, verify_mean = len(counter.lengths), statistics.fmean(verify) if verify else 1.0
            method.runs.append({
                "prompt": p_idx,
                "new_tokens": len(new),
                "seconds": statistics.median(times),
                "forwards": forwards,
                "verify_lengths_mean": verify_mean,
                "tau": (len(new) - 1) / max(1, forwards - 1),
                "peak_mem_mb": peak_memory_mib(device),
                "tokens": new,
                **({"acceptance": acceptance_counts(method.generator.last_stats)} if method.generator else {}),
            })
        if deadline is not None and time.monotonic() > deadline and p_idx + 1 < len(prompts):
            bar.close()
            print(f"benchmark: time is up after {p_idx + 1} of {len(prompts)} prompts (--max-minutes)", flush=True)
            return p_idx + 1
    bar.close()
    return len(prompts)


def head_label(head: nn.Module, head_dir: str, head_dirs: list[str]) -> str:
    """A head's name in the tables: its variant (DSpark, Domino, ...) or kind, then, beside other heads, its
    folder's name, with the parent's in front where two folders share a name (``runs/a/best``, ``runs/b/best``)."""
    kind = getattr(head.config, "variant", None) or head.head_kind
    if len(head_dirs) == 1:
        return kind
    names = [Path(d).name for d in head_dirs]
    path = Path(head_dir)
    return f"{kind}:{path.parent.name}/{path.name}" if names.count(path.name) > 1 else f"{kind}:{path.name}"
