"""Generate with a draft head from the command line.

    python -m draftsmith.infer.generate_command --head H [--target T] --prompt "def fib(n):" [--chat]
        [--max-new-tokens 128] [--temperature 0] [--top-p 1] [--top-k 0] [--acceptance exact|traversal|typical]
        [--tree default|tree|chainN|dynD-K-N|medusaN] [--adaptive] [--lookup-first]
        [--compile] [--compare [--rounds R]]
    python -m draftsmith.infer.generate_command --target T --drafter lm:DIR | lm:DIR+ngram | lm:DIR+head:HEAD | ngram | layer-skip[:K]
        | head:DIR[+lookup-first] [--tree chainN] [--matches K] [--adaptive] ...

Streams the text, then prints tau (tokens per target forward) and tokens/s. ``--compare`` also
runs the target's own ``generate`` in the same process and prints the speedup and whether the
outputs match (they must, at temperature 0). ``--target`` defaults to the target the head was
trained for (its config's ``target_name_or_path``); ``demo:tiny`` names the demo target.
``--tree`` is the draft's shape in the one language ``bench --trees`` reads too (``infer.tree_shape``: default,
tree, chainN, dynD-K-N, medusaN). ``--drafter lm:DIR`` drafts a chain (``--tree chainN``, default 4) with a small LM
sharing the target's tokenizer (``lm:demo:assistant`` is the demo's); ``--drafter ngram`` drafts by prompt lookup
(``--tree chainN`` tokens, default 8, from ``--matches`` matches, default 1); ``--drafter layer-skip:K`` drafts a
chain (``--tree chainN``, default 4)
with the target's own first K layers (self-speculation; ``infer.drafters.free.layer_skip``); without K, the K that
``scripts/calibrate_layer_skip.py`` measured fastest for this target, device and dtype, else half the
layers. ``--drafter lm:DIR+ngram`` is the draft LM whose own drafts are guessed by prompt lookup
(``infer.drafters.free.hierarchical``: the same chain, fewer draft-LM forwards when the guesses hold);
``--drafter lm:DIR+head:HEAD`` the same with a head trained on the draft LM (``target=DIR``) guessing.
``--adaptive`` lets the draft length follow the acceptance (+2 after a full accept, -1 otherwise: HF's heuristic);
``--choose`` chooses each step's length for tokens per second from the measured step costs, 0 allowed
(``infer.drafters.free.chooser``), or with ``--tree tree`` or ``dynD-K-N`` an EAGLE dynamic tree's depth;
``--tree chainD`` fixes it. ``--lookup-first`` drafts by prompt lookup
whenever it finds a continuation of at least 2 tokens and with the head otherwise (``infer.drafters.free.lookup_first``).
``--drafter head:DIR[+lookup-first]`` is ``--head DIR [--lookup-first]``; every spec is parsed by
``infer.drafter_spec`` (the benchmark's methods too). A ``speculation_plan.json`` next to ``--head`` (``scripts/speculation_plan.py``) is followed, as
``SpeculativeGenerator.from_pretrained`` follows it.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import TYPE_CHECKING

from draftsmith.data.base.checks import cli_count, cli_real
from draftsmith.data.entry_point import prog, run
from draftsmith.infer.drafter_spec import DrafterSpec, parse_drafter
from draftsmith.infer.tree_shape import parse_tree_shape

if TYPE_CHECKING:  # torch, transformers and the drafters load after the arguments are checked (seconds)
    import torch

    from draftsmith.infer.generator import SpeculativeGenerator

# The flags that shaped a draft before the one shape language (infer.tree_shape), and what says the same now
OLD_SHAPE_FLAGS = {
    "--depth": "the draft's shape is one --tree value: --tree chainD (a chain of D) or dynD-K-N (an EAGLE tree)",
    "--branch": "an EAGLE tree is --tree dynD-K-N (K children per node); prompt lookup's matches are --matches K",
    "--total-tokens": "an EAGLE tree is --tree dynD-K-N (N nodes verified, root included)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog("python -m draftsmith.infer.generate_command"), description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model: HF id, directory or demo:<size> (default: the head's own target)")
    p.add_argument("--head", help="draft head: directory or HF id")
    p.add_argument("--drafter", help="instead of a head: lm:DIR (a draft LM sharing the tokenizer), lm:DIR+ngram "
                   "(its own drafts guessed by prompt lookup), lm:DIR+head:HEAD (guessed by a head trained on the "
                   "draft LM), ngram, layer-skip[:K] (self-speculation: the target's first K layers draft; default the "
                   "calibrated K, else half of them), or head:DIR[+lookup-first] (as --head DIR [--lookup-first])")
    p.add_argument("--choose", action="store_true",
                   help="each step's chain length (0 to the head's longest), or with --tree tree or dynD-K-N the "
                        "dynamic tree's depth, chosen for tokens/s from the measured step costs "
                        "(infer.drafters.free.chooser)")
    p.add_argument("--adaptive", action="store_true",
                   help="draft length follows the acceptance (chains: +2 after a full accept, -1 otherwise)")
    p.add_argument("--lookup-first", action="store_true",
                   help="with --head: prompt lookup drafts when it finds a continuation of 2 or more tokens, the head "
                        "otherwise (the suffix + model hybrid)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=cli_count(), default=128)
    p.add_argument("--temperature", type=cli_real(0), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=cli_real(0, 1, above=True), default=1.0)
    p.add_argument("--top-k", type=cli_count(0), default=0, help="0 = disabled")
    p.add_argument("--acceptance", choices=("exact", "traversal", "typical"), default="exact",
                   help="the rule at temperature > 0: exact (token by token), traversal (sequence by sequence, leaf "
                        "to root; docs/traversal.md), both lossless; typical (Medusa's, lossy)")
    p.add_argument("--tree", default="default",
                   help="the draft's shape: default (the head kind's for the device; EAGLE on CPU: a chain adapting its "
                        "length, 4 to 16, greedy; sampled, its length chosen for tokens/s, 0 to 16), tree (Medusa's static or an EAGLE dynamic tree), chainN (a chain of N), "
                        "dynD-K-N (EAGLE: depth D, K children per node, N nodes verified) or medusaN")
    p.add_argument("--matches", type=cli_count(), help="--drafter ngram: prompt-lookup matches drafted (default 1)")
    for old in OLD_SHAPE_FLAGS:  # refused below with the --tree that says the same
        p.add_argument(old, help=argparse.SUPPRESS)
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16", "float64"), default="auto")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the verify and draft steps (torch.compile; default: on CUDA, off on CPU, where the "
                        "first call compiles for about a minute, then decoding is about 1.3x faster on the demo)")
    p.add_argument("--compare", action="store_true", help="also run vanilla decoding and compare")
    p.add_argument("--rounds", type=cli_count(), default=3,
                   help="--compare: timed decodes of each, speculative and vanilla alternating (default 3); "
                        "tokens/s are all tokens over all seconds")
    p.add_argument("--seed", type=cli_count(0), default=0)
    p.add_argument("--threads", type=cli_count(), help="CPU threads (default: 1 or all cores, whichever a short probe "
                   "measures faster; OMP_NUM_THREADS is respected)")
    args = p.parse_args(argv)
    for old, new in OLD_SHAPE_FLAGS.items():
        if getattr(args, old[2:].replace("-", "_")) is not None:
            p.error(f"{old} is gone: {new}")
    try:
        args.shape = parse_tree_shape(args.tree)
    except ValueError as e:
        p.error(f"--tree: {e}")
    if (args.head is None) == (args.drafter is None):
        p.error("pass exactly one of --head and --drafter")
    args.spec = _drafter_spec(p, args)
    if args.lookup_first and args.head is None:
        p.error("--lookup-first puts prompt lookup before a head: pass --head (--drafter ngram is lookup alone)")
    if args.drafter is not None and args.target is None:
        p.error("--drafter needs --target")
    unused = [f"{name} {value:g}" for name, value, off in (("--top-p", args.top_p, 1.0), ("--top-k", args.top_k, 0))
              if value != off]
    if args.temperature == 0 and unused:
        print(f"warning: {' and '.join(unused)} shape sampling only; --temperature 0 decodes greedily (set "
              "--temperature > 0 to sample)", file=sys.stderr)
    return args


def _drafter_spec(p: argparse.ArgumentParser, args: argparse.Namespace) -> DrafterSpec:
    """``--drafter`` or ``--head``/``--lookup-first`` as one parsed spec (``infer.drafter_spec``); a head spec given
    to ``--drafter`` fills ``--head`` and ``--lookup-first``."""
    try:
        spec = parse_drafter(args.drafter if args.drafter is not None else f"head:{args.head}")
    except ValueError as e:
        p.error(f"--drafter: {e}" if args.drafter is not None else str(e))
    if spec.kind == "head" and args.drafter is not None:
        args.head, args.drafter = spec.path, None
        args.lookup_first = args.lookup_first or spec.lookup_first
    return spec


def encode(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    if chat:
        if not tokenizer.chat_template:
            raise ValueError("--chat: this tokenizer has no chat template")
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        return enc["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


@dataclasses.dataclass
class Timed:
    """Decodes of one method over the rounds of ``--compare``: every output and the summed tokens and seconds."""

    outputs: list = dataclasses.field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def add(self, output: torch.Tensor, tokens: int, seconds: float) -> None:
        self.outputs.append(output)
        self.tokens += tokens
        self.seconds += seconds

    @property
    def output(self) -> torch.Tensor:
        return self.outputs[0]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def output_equal_to(self, other: "Timed") -> bool:
        import torch

        return all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(self.outputs, other.outputs))

    def line(self) -> str:
        rounds = f" over {len(self.outputs)} rounds" if len(self.outputs) > 1 else ""
        return f"{self.tokens} tokens in {self.seconds:.2f} s{rounds}: {self.tokens_per_s:.1f} tok/s"


def compare_rounds(gen: SpeculativeGenerator, ids: torch.Tensor, max_new_tokens: int, rounds: int, seed: int,
                   sampling: dict, hf_kwargs: dict) -> tuple[Timed, Timed]:
    """``rounds`` decodes with ``gen`` and with the target's own ``generate``, alternating (a busy machine
    slows both alike), each from the same seed; tokens/s are all tokens over all seconds."""
    import torch

    from draftsmith.data.base.device import sync

    spec, vanilla = Timed(), Timed()
    for _ in range(rounds):
        torch.manual_seed(seed)
        out = gen.generate(ids, max_new_tokens=max_new_tokens, **sampling)
        spec.add(out, gen.last_stats.new_tokens, gen.last_stats.wall_time)
        torch.manual_seed(seed)
        with torch.inference_mode():
            start = time.perf_counter()
            ref = gen.target.generate(ids, max_new_tokens=max_new_tokens, **hf_kwargs)
            sync(ref.device)  # sync: time the finished decode
        vanilla.add(ref, ref.shape[1] - ids.shape[1], time.perf_counter() - start)
    return spec, vanilla


def load_generator(args: argparse.Namespace) -> tuple[SpeculativeGenerator, str]:
    """The generator the arguments name (``args.spec``: a head, or another drafter for ``--target``), and a few
    words saying what drafts."""
    import torch

    from draftsmith.data.base.device import default_device
    from draftsmith.heads import AutoHead
    from draftsmith.infer.drafter_spec import build_drafter
    from draftsmith.infer.drafters import Chain, DynamicTree, chosen_chain, chosen_tree
    from draftsmith.infer.generator import SpeculativeGenerator
    from draftsmith.infer.speculation_plan import find_plan
    from draftsmith.infer.tree_shape import build_tree

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    device = str(default_device(args.device))
    spec = args.spec
    if spec.kind != "head":
        if args.shape.form not in ("default", "chain"):
            raise ValueError(f"--tree {args.tree}: --drafter {args.drafter} drafts chains; pass --tree chainN")
        length = args.shape.sizes[0] if args.shape.form == "chain" else None
        drafter = lambda target: build_drafter(spec, target, length, adaptive=args.adaptive,  # noqa: E731
                                               branches=args.matches or 1)
        return SpeculativeGenerator.from_pretrained(args.target, drafter, device=device, dtype=dtype,
                                                    threads=args.threads, compile=args.compile,
                                                    acceptance=args.acceptance), spec.describe()
    head = AutoHead.from_pretrained(args.head)  # its kind decides the tree before the generator exists
    label = f"{head.head_kind} head"
    target = args.target or head.config.target_name_or_path
    if not target:
        raise ValueError(f"{args.head} records no target (target_name_or_path); pass --target")
    tree = build_tree(args.shape, head, device)  # None: the kind's default, fitted to the head by the generator
    if args.adaptive and tree is not None and not isinstance(tree, Chain):
        raise ValueError("--adaptive adapts a chain: pass --tree chainN (or default)")
    if args.choose:  # the head's chain (or dynamic tree), its length (depth) chosen per step, built with the target
        if not (tree is None or isinstance(tree, DynamicTree)) or args.adaptive or args.lookup_first:
            raise ValueError("--choose chooses a chain's length or a dynamic tree's depth itself: pass --tree default, "
                             "tree or dynD-K-N (an EAGLE head's dynamic tree), and no --adaptive or --lookup-first")
        head = lambda target, loaded=head, shape=tree: (  # noqa: E731
            chosen_chain(loaded, target) if shape is None else chosen_tree(loaded, target, shape))
        tree = None
    if args.adaptive or args.lookup_first:  # the drafter is built around the loaded head once the target is
        wrapped, loaded = DrafterSpec("head", path=args.head, lookup_first=args.lookup_first), {args.head: head}
        head = lambda target, tree=tree: build_drafter(wrapped, target, adaptive=args.adaptive,  # noqa: E731
                                                       tree=tree, loaded=loaded)
        tree = None
    # the plan saved next to the head, as from_pretrained(target, HEAD_DIR) reads it: the CLI and the API agree
    gen = SpeculativeGenerator.from_pretrained(target, head, device=device, dtype=dtype, tree=tree, threads=args.threads,
                                               compile=args.compile, plan=find_plan(args.head),
                                               acceptance=args.acceptance)
    return gen, label


def warm_up(gen: SpeculativeGenerator, ids: torch.Tensor, max_new_tokens: int, sampling: dict) -> None:
    """First-call allocations, not decoding speed; a compiled step warms up at the real size (the static cache's
    size is part of the compiled shape), saying so before and how long it took after."""
    if gen.compile:  # minutes on a busy CPU
        print(f"compiling the verify and draft steps (torch.compile, {gen.device.type}; about a minute on an idle "
              "CPU, longer on a busy one, faster once inductor's cache holds them)...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    gen.generate(ids, max_new_tokens=max_new_tokens if gen.compile else 4, **sampling)
    if gen.compile:
        print(f"compiled in {time.perf_counter() - start:.1f} s (the warm-up decode included)", file=sys.stderr,
              flush=True)


def compare(gen: SpeculativeGenerator, args: argparse.Namespace, ids: torch.Tensor, out: torch.Tensor,
            sampling: dict) -> int:
    """``--compare``: the target's own ``generate`` against ``gen`` over ``--rounds``; 1 when greedy outputs
    differ."""
    import torch

    hf_sampling = {"do_sample": True, **sampling} if args.temperature > 0 else {"do_sample": False}
    pad = gen.tokenizer.pad_token_id if gen.tokenizer.pad_token_id is not None else gen.tokenizer.eos_token_id
    # An explicit all-ones mask: otherwise HF masks prompt tokens equal to the pad id.
    hf_kwargs = {"attention_mask": torch.ones_like(ids), "pad_token_id": pad, **hf_sampling}
    with torch.inference_mode():
        gen.target.generate(ids, max_new_tokens=4, **hf_kwargs)  # warm-up
    spec, vanilla = compare_rounds(gen, ids, args.max_new_tokens, args.rounds, args.seed, sampling, hf_kwargs)
    same = torch.equal(out.cpu(), vanilla.output.cpu()) and spec.output_equal_to(vanilla)
    print(f"[speculative] {spec.line()}", file=sys.stderr)
    print(f"[vanilla]     {vanilla.line()}", file=sys.stderr)
    note = ""
    if args.temperature > 0:
        note = " (sampling: equal only by chance)"
    elif not same and gen.dtype in (torch.bfloat16, torch.float16):
        note = " (half precision: tree and one-token forwards round differently; compare in float32)"
    rounds = f", {args.rounds} rounds interleaved" if args.rounds > 1 else ""
    print(f"speedup {spec.tokens_per_s / vanilla.tokens_per_s:.2f}x (tokens/s{rounds}), "
          f"outputs identical: {'yes' if same else 'NO'}{note}", file=sys.stderr)
    return 0 if same or args.temperature > 0 else 1


def budgets(counts: dict[int, int]) -> str:
    """Drafted tokens per step as ``k:steps`` pairs (``GenerationStats.draft_budgets``)."""
    return " ".join(f"{k}:{n}" for k, n in sorted(counts.items())) or "none"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before the imports below: a mistake is reported in a second, not after 15-26 s
    import torch
    from transformers import TextStreamer

    from draftsmith.infer.drafters import AdaptiveLength, ByTemperature, CostAwareLength
    from draftsmith.infer.drafters.free.lookup_first import LookupFirst

    gen, label = load_generator(args)
    if gen.tokenizer is None:
        raise ValueError(f"{args.target} has no tokenizer; the CLI needs one to encode --prompt")
    ids = encode(gen.tokenizer, args.prompt, args.chat).to(gen.device)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    torch.manual_seed(args.seed)
    warm_up(gen, ids, args.max_new_tokens, sampling)
    torch.manual_seed(args.seed)
    streamer = TextStreamer(gen.tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = gen.generate(ids, max_new_tokens=args.max_new_tokens, streamer=streamer, **sampling)
    s = gen.last_stats
    drafter = gen.drafter.drafter if isinstance(gen.drafter, LookupFirst) else gen.drafter
    drafter = drafter.active if isinstance(drafter, ByTemperature) else drafter  # the policy this decode drafted by
    adaptive = (", adaptive length" if isinstance(drafter, AdaptiveLength) else "") + \
        (f", drafted tokens per step {budgets(s.draft_budgets)}" if isinstance(drafter, CostAwareLength) else "") + \
        (", prompt lookup first" if args.lookup_first else "")
    compiled = f", {s.compile_time:.2f} s of it compiling" if s.compile_time else ""
    print(f"\n[speculative] {s.new_tokens} tokens in {s.wall_time:.2f} s{compiled}: {s.tokens_per_s:.1f} tok/s, "
          f"tau {s.tau:.2f}, mean_acceptance_length {s.mean_acceptance_length:.2f} ({s.target_forwards} target forwards, "
          f"{label}{adaptive})", file=sys.stderr)
    return compare(gen, args, ids, out, sampling) if args.compare else 0


def cli(argv: list[str] | None = None) -> int:
    """``main`` with user mistakes as one line and exit code 2."""
    return run(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
