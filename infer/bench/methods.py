"""The decoding methods compared on a real target, and timing them on the same prompts."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from draftsmith.data.base.device import sync
from draftsmith.data.targets import resolve_target
from draftsmith.heads import AutoHead
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator, StaticTree
from draftsmith.infer.bench.tree_spec import TREE_SPEC
from draftsmith.infer.bench.timing import ForwardCounter, peak_memory_mib, reset_peak_memory
from draftsmith.infer.drafters import AdaptiveLength, TreeOption, adaptive_chain, drafter_class, fit_chain, make_drafter
from draftsmith.infer.drafters.hierarchical import HierarchicalDrafter
from draftsmith.infer.drafters.layer_skip import LayerSkipDrafter
from draftsmith.infer.drafters.lm_drafter import LMDrafter
from draftsmith.infer.drafters.lookup_first import LookupFirst
from draftsmith.infer.drafters.ngram import NgramDrafter
from draftsmith.infer.recurrent import is_hybrid
from draftsmith.infer.tree import MEDUSA_DEFAULT_CHOICES


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
    CPU an EAGLE head's adaptive chain) for this head, or None when it does not fit its kind."""
    match = TREE_SPEC.match(spec)
    if match is None or spec == "default":
        raise ValueError(f"--trees: unknown tree {spec!r}; use tree, default, chainN, dynD-K-N or medusaN")
    drafter = drafter_class(head.head_kind)
    if spec == "tree":
        return drafter.branching_tree(device)
    chain, depth, top_k, total, medusa = match.group(2, 3, 4, 5, 6)
    if chain:
        tree = Chain(int(chain))
    elif depth:
        tree = DynamicTree(int(depth), int(top_k), int(total))
    else:
        tree = StaticTree(MEDUSA_DEFAULT_CHOICES[: int(medusa)])
    return tree if drafter.fits(head, tree) else None


def default_draft(head, device: torch.device) -> TreeOption | str:
    """What a generator given no tree drafts with ``head`` on ``device`` ("adaptive": the kind's
    adaptive chain), for telling ``default`` apart from the other ``--trees``."""
    drafter = drafter_class(head.head_kind)
    if drafter.adapts_by_default(device):
        return "adaptive"
    return fit_chain(head, drafter.default_tree(device))


def build_methods(args, target, tokenizer, skipped: dict[str, str] | None = None) -> list[Method]:
    """The methods ``args`` asks for, vanilla first: HF baselines, our classic drafters, every head.

    On a hybrid target some cannot run: HF's assisted generation and prompt lookup (transformers refuses
    stateful models) and every tree (its recurrent layers read a verify's tokens as one sequence: chains
    only). They are left out, each with a one-line reason in ``skipped`` (name -> reason) for the report."""
    skipped = {} if skipped is None else skipped
    hybrid = is_hybrid(target)
    refused = f"transformers refuses assisted generation on stateful models ({type(target).__name__})"
    chains_only = (f"{type(target).__name__} is a hybrid: its recurrent layers read a verify's tokens as one "
                   "sequence, so drafts are chains")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    if args.ignore_eos:
        common["eos_token_id"] = None
    # HF reads an explicit eos_token_id=None as "no EOS"; SpeculativeGenerator reads None as "the
    # generation config's", as HF does by default: an empty list means no EOS for it.
    eos = [] if args.ignore_eos else None

    def hf(**extra):
        return lambda ids: target.generate(ids, attention_mask=torch.ones_like(ids), **common, **extra)

    def ours(name: str, kind: str, drafter) -> Method:
        gen = SpeculativeGenerator(target, drafter, tokenizer=tokenizer, compile=args.compile)
        run = lambda ids: gen.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)  # noqa: E731
        return Method(name, kind, run, generator=gen)

    methods = [Method("vanilla", "vanilla", hf())]
    if not args.no_hf_static:
        methods.append(Method("hf-static", "vanilla", hf(cache_implementation="static"), compiled=True))
    if args.assistant:
        assistant = AutoModelForCausalLM.from_pretrained(resolve_target(args.assistant, role="assistant"),
                                                         dtype=target.dtype).to(target.device).eval()
        if hybrid:
            skipped["hf-assisted"] = refused
        else:
            methods.append(Method("hf-assisted", "assisted", hf(assistant_model=assistant)))
        # HF's assisted generation (transformers 5.x defaults): up to 20 drafts, a draft stops below
        # probability 0.4 (HF then tunes that threshold); ours: a chain of 4, and +2/-1 adaptive with the 0.4 stop.
        methods.append(ours("draft-lm:chain4", "draft_lm", LMDrafter(assistant, target, Chain(4))))
        methods.append(ours("draft-lm:adaptive", "draft_lm", AdaptiveLength(
            LMDrafter(assistant, target, Chain(20), confidence=0.4), initial=4, maximum=20)))
        # Hierarchical: the same chain of 4, the assistant's own drafts guessed by prompt lookup.
        methods.append(ours("draft-lm+ngram:chain4", "draft_lm", HierarchicalDrafter(
            assistant, target, NgramDrafter(max_ngram=3, length=4), Chain(4))))
        if args.assistant_head:  # ... or by a head trained on the assistant
            inner = AutoHead.from_pretrained(args.assistant_head).to(device=target.device, dtype=target.dtype).eval()
            methods.append(ours("draft-lm+head:chain4", "draft_lm", HierarchicalDrafter(
                assistant, target, make_drafter(inner, assistant, Chain(4)), Chain(4))))
    if not args.no_prompt_lookup:
        if hybrid:
            skipped["hf-prompt-lookup"] = refused
        else:
            methods.append(Method("hf-prompt-lookup", "prompt_lookup", hf(prompt_lookup_num_tokens=args.prompt_lookup_tokens)))
        # HF's prompt lookup: n-grams of 2 down to 1, prompt_lookup_num_tokens drafts, first match.
        length = args.prompt_lookup_tokens
        methods.append(ours("ngram:chain", "ngram", NgramDrafter(max_ngram=2, length=length)))
        if hybrid:
            skipped["ngram:tree3"] = chains_only
        else:
            methods.append(ours("ngram:tree3", "ngram", NgramDrafter(max_ngram=2, length=length, branches=3)))
        methods.append(ours("ngram:adaptive", "ngram", AdaptiveLength(NgramDrafter(max_ngram=2, length=length), initial=4, maximum=length)))
    for k in getattr(args, "layer_skip", None) or ():  # self-speculation: the target's first k layers draft
        methods.append(ours(f"layer-skip:{k}", "layer_skip", LayerSkipDrafter(target, k, Chain(4))))
    for head_dir in args.heads:
        head = AutoHead.from_pretrained(head_dir).eval()
        label = Path(head_dir).name
        seen = []  # the drafts already run for this head: "default" is often "tree" or a chain on its own
        for variant in args.trees:
            tree = None if variant == "default" else tree_from_spec(variant, head, target.device)
            if tree is None and variant != "default":  # the kind cannot draft it
                continue
            name = f"{head.head_kind}:{label}:{variant}" if len(args.heads) > 1 else f"{head.head_kind}:{variant}"
            if hybrid and tree is not None and not isinstance(tree, Chain):
                skipped[name] = chains_only
                continue
            draws = default_draft(head, target.device) if tree is None else tree
            if draws in seen:
                continue
            seen.append(draws)
            gen = SpeculativeGenerator(target, head, tokenizer=tokenizer, tree=tree, compile=args.compile)
            run = (lambda g: lambda ids: g.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos))(gen)
            methods.append(Method(name, "head", run, generator=gen))
        if getattr(args, "lookup_first", False):  # prompt lookup when it finds >= 2 tokens, the head's default otherwise
            drafter = LookupFirst(make_drafter(head, target), NgramDrafter(max_ngram=3, length=8))
            name = f"{head.head_kind}:{label}:lookup-first" if len(args.heads) > 1 else f"{head.head_kind}:lookup-first"
            methods.append(ours(name, "head", drafter))
        if args.adaptive and "adaptive" not in seen:  # a chain whose length follows acceptance (Medusa: <= its heads)
            drafter = adaptive_chain(head, target)
            name = f"{head.head_kind}:{label}:adaptive" if len(args.heads) > 1 else f"{head.head_kind}:adaptive"
            methods.append(ours(name, "head", drafter))
    return methods


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
            })
        if deadline is not None and time.monotonic() > deadline and p_idx + 1 < len(prompts):
            bar.close()
            print(f"benchmark: time is up after {p_idx + 1} of {len(prompts)} prompts (--max-minutes)", flush=True)
            return p_idx + 1
    bar.close()
    return len(prompts)
