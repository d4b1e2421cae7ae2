"""The speculative generation loop: draft -> verify (one target forward) -> accept -> compact.

One step:
1. the drafter proposes a tree rooted at the last emitted token (the "root", not yet in the
   target's KV cache);
2. the target runs once over all tree nodes with a 4D additive tree mask and depth positions;
3. an acceptance rule keeps the longest valid path and picks the bonus token after it;
4. the target cache keeps exactly prefix + accepted nodes; the drafter observes the accepted
   tokens with their true target features; the bonus token becomes the next root.

One decode path on every device: the target's KV lives in a ``StaticKVCache`` preallocated for
prompt + max_new_tokens + the tree budget N (the drafter's ``max_nodes``) and kept across calls while
it is large enough; the draft head's cache is a preallocated ``StaticHeadCache``. ``compile`` is the
one switch: compiled (``torch.compile``; on CUDA with CUDA graphs, mode "reduce-overhead"), every
draft is padded to N with dummy nodes no real node sees, so the verify step has one shape and runs
as one graph; eager (the CPU default), each draft is verified at its own size (on a CPU every
verified token costs, and a drafter with nothing to propose verifies the root alone).

A batch of B left-padded prompts runs the same loop (batch size 1 is one row): each row has its own
cache slots, positions, drafter state, EOS and budget; one [B, N] verify per step serves every row,
drafts padded to the step's largest (eager) or the budget (compiled); see ``infer.masked_forward``.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from draftsmith.data.targets import load_target, load_target_config, load_target_tokenizer, resolve_target
from draftsmith.heads import AutoHead
from draftsmith.infer.accept import (
    Accepted,
    chain_sample_accept,
    check_sampling_params,
    greedy_accept_rows,
    tree_sample_accept,
    typical_accept,
)
from draftsmith.infer.masked_forward import attention_masks, masked_forward, prefill_mask, verify_key_positions, verify_mask
from draftsmith.infer.cache import StaticKVCache
from draftsmith.infer.compiling import check_compile, compiled, step_begin
from draftsmith.infer.decode_check import check_family
from draftsmith.infer.delta_rule import per_token_modules, per_token_rule
from draftsmith.infer.drafters import (Chain, Draft, Drafter, Sampling, TreeOption, adaptive_chain, chain_buffers, make_drafter,
                            root_only)
from draftsmith.infer.speculation_plan import SpeculationPlan, find_plan
from draftsmith.infer.drafters.layer_skip import shallow_backbone
from draftsmith.infer.hf_cache import cache_kwargs
from draftsmith.infer.recurrent import RECURRENT_LAYER_TYPES, Checkpoint, check_supported, is_hybrid, layer_types
from draftsmith.infer.target import TargetOutput, backbone_of, decoder_layers
from draftsmith.infer.threads import choose_threads
from draftsmith.infer.tree import pad_tree
from draftsmith.data.base.checks import probability
from draftsmith.data.base.device import default_device, sync

SUPPORTED_ATTENTION = ("sdpa", "eager")  # flash attention takes no arbitrary tree mask
# rollback="merged": the most tokens a row carries pending into the next verify (they widen it); past this,
# or when a batch's rows disagree, they are replayed at once (docs/hybrid.md)
MAX_PENDING = 16


@dataclass
class GenerationStats:
    """What the last ``generate`` call did."""

    new_tokens: int = 0
    target_forwards: int = 0  # including the prefill
    steps: int = 0  # verification forwards
    step_tokens: int = 0  # tokens emitted by verification steps (accepted drafts + bonus)
    verified_tokens: int = 0  # tokens the verification forwards ran over (padded to the budget when static)
    # a hybrid target's rollback: forwards replaying accepted tokens after a partial accept, and their tokens;
    # with rollback="merged", the pending tokens verifies ran again in front of their drafts instead
    replays: int = 0
    replayed_tokens: int = 0
    pending_tokens: int = 0
    wall_time: float = 0.0  # seconds, compilation included (see compile_time)
    # Seconds spent in verify calls that compiled a new graph (first call per tree budget and
    # cache size); included in wall_time. Warm up once to measure decode speed alone.
    compile_time: float = 0.0
    # Seconds per phase ("prefill", "draft", "verify", "accept", "compact", "emit", "observe"; on a hybrid
    # target "rollback" too), filled only by a generator built with profile=True (it synchronises the device at every
    # phase end, so profiled runs are slower on GPU).
    phase_times: dict[str, float] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Mean tokens per verification step (accepted drafts + bonus); 0.0 before any step."""
        return self.step_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0


@dataclass
class DecodeState:
    """Everything one row of a generation carries from step to step."""

    draft: Any  # the drafter's own state (head cache, last head output, ...)
    root: Tensor  # 0-d long: last emitted token, not yet in the target's cache
    emitted: list[Tensor] = field(default_factory=list)  # chunks of new tokens
    num_new: int = 0


@dataclass
class Decoding:
    """One ``generate`` call in progress (``SpeculativeGenerator.start`` -> ``step`` ... -> ``finish``)."""

    cache: StaticKVCache  # the target's KV (and a hybrid's recurrent states) of every row
    rows: list[DecodeState]
    done: list[bool]  # per row: stopped (EOS or budget)
    lengths: Tensor  # (B,) valid cache slots per row (prompt with its left pads, then accepted tokens)
    host_lengths: list[int]  # the same, on the host
    pads: Tensor  # (B,) left-pad columns per row
    host_pads: list[int]  # the same, on the host
    levels: int | None  # the plan's draft levels for this batch size (None: the drafter's own; 0: none)
    sampling: Sampling
    eos: Tensor  # (E,) stop ids
    max_new_tokens: int
    input_ids: Tensor  # the prompts as given (the output starts with them, on their device)
    pad_id: int  # fills a row's output after its end
    streamer: Any
    clock: Any  # _PhaseClock
    started: float  # perf_counter at the start
    stats: GenerationStats
    # A hybrid target with rollback="merged": (B, p) each row's accepted tokens whose KV is in the cache (slots
    # lengths - p ..) but whose recurrent states are not (they were restored to ``before``, taken before them);
    # the next verify runs them again in front of its draft. None: the states are after every accepted token.
    pending: Tensor | None = None
    before: Checkpoint | None = None

    def live(self) -> list[int]:
        return [b for b, done in enumerate(self.done) if not done]


class _PhaseClock:
    """Accumulates wall time per loop phase when enabled; a no-op otherwise (no device syncs)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device, self.enabled = device, enabled
        self.times: dict[str, float] = {}
        self.last = 0.0

    def start(self) -> None:
        if self.enabled:
            self._sync()
            self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to ``phase``."""
        if self.enabled:
            self._sync()
            now = time.perf_counter()
            self.times[phase] = self.times.get(phase, 0.0) + now - self.last
            self.last = now

    def _sync(self) -> None:
        sync(self.device)  # sync: only when profiling


def _text_config(model: nn.Module):
    return model.config.get_text_config()


def default_compile(device: torch.device | str) -> bool:
    """Whether the verify step is compiled when the caller does not say, chosen by measurement
    (docs/benchmarks.md): on CUDA yes (CUDA graphs remove the launch cost that dominates small
    forwards); on CPU no (a compiled CPU step saves little where a forward is compute-bound, and
    costs a long first compile)."""
    return torch.device(device).type == "cuda"


def _after_pending(pending: Tensor, draft: Draft) -> Draft:
    """``draft`` (a chain) behind a row's ``pending`` (p,) tokens: one chain of p + N nodes to verify."""
    tokens = torch.cat([pending, draft.tokens])
    return Draft(tokens, chain_buffers(tokens.shape[0] - 1, tokens.device))


class SpeculativeGenerator:
    """Lossless tree speculative decoding with a draft head (a batch of left-padded rows, B >= 1).

    Args:
        target: a Hugging Face causal LM (sdpa or eager attention).
        head: a draftsmith head (Medusa, EAGLE, EAGLE-3) made for ``target``, moved to the
            target's device and dtype; or any object following ``infer.drafters.Drafter``.
        tokenizer: optional, kept for callers (the CLI); generation works on ids.
        tree: ``StaticTree`` (Medusa), ``DynamicTree`` (EAGLE) or ``Chain``; None = the kind's
            default for the target's device (``infer.drafters.make_drafter``: on CPU, EAGLE heads
            draft a chain adapting its length from 4 up to 16).
        acceptance: "exact" (lossless) or "typical" (Medusa's typical acceptance: LOSSY, only used
            at temperature > 0, with ``typical_threshold`` and ``typical_alpha``).
        profile: time each phase of the loop into ``last_stats.phase_times`` (adds a device sync
            per phase; for finding where a step's time goes, not for measuring speed).
        cache_implementation: "static" or None (HF's argument name, kept for HF-style calls): the
            preallocated static cache is the only decode state; anything else is refused.
        compile: compile the verify step with ``torch.compile`` (True: inductor, with CUDA graphs
            on CUDA; a string names another ``torch.compile`` backend, e.g. "aot_eager"); None =
            the device's default (``default_compile``: CUDA True, CPU False).
        plan: when to speculate (``infer.speculation_plan.SpeculationPlan``, or the path of its JSON): per batch
            size, the most draft levels per step (0: decode without drafting); None = draft as the
            drafter does at every batch size (``from_pretrained`` loads the plan saved next to a head).
        rollback: how a hybrid target's recurrent states go back to the accepted tokens after a partial accept
            (docs/hybrid.md): "merged" (restore the states from before the step and run the accepted tokens
            again in front of the next step's draft, in its verify) or "replay" (restore, then one more forward
            over the accepted tokens); None = "merged" where it applies (an eager verify whose drafter does not
            draft into the target's own cache), else "replay". Ignored for attention-only targets.
    """

    def __init__(
        self,
        target: nn.Module,
        head: nn.Module | Drafter,
        tokenizer: Any = None,
        tree: TreeOption | None = None,
        acceptance: str = "exact",
        typical_threshold: float = 0.09,
        typical_alpha: float = 0.3,
        profile: bool = False,
        cache_implementation: str | None = None,
        compile: bool | str | None = None,
        plan: SpeculationPlan | str | os.PathLike | None = None,
        rollback: str | None = None,
    ) -> None:
        check_family(target)  # first: a stateful model it cannot decode is named with its layer kind (or its check)
        attn = getattr(target.config, "_attn_implementation", None)
        if attn not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"target attention '{attn}' cannot take a tree mask; load it with "
                f"attn_implementation in {SUPPORTED_ATTENTION}"
            )
        if acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance must be 'exact' or 'typical', got {acceptance!r}")
        # A hybrid target's recurrent layers read a verify's tokens as one sequence: drafts are chains, and
        # each step's states are rolled back to a checkpoint (infer.recurrent, ``rollback``).
        self.hybrid = is_hybrid(target)
        self.target = target
        self.tokenizer = tokenizer
        self.device = target.get_input_embeddings().weight.device
        self.dtype = target.get_input_embeddings().weight.dtype
        if isinstance(head, nn.Module):
            head.check_target(target)
            head.to(device=self.device, dtype=self.dtype)
            self.head: nn.Module | None = head
            if self.hybrid and tree is not None and not isinstance(tree, Chain):
                raise ValueError(f"{type(target).__name__} is a hybrid (recurrent layers read a verify's tokens as one "
                                 f"sequence): drafts must be chains (tree=Chain(n), or no tree), not a {type(tree).__name__}")
            if self.hybrid and tree is None:  # chains only: the kind's adaptive chain on every device
                self.drafter: Drafter = adaptive_chain(head, target)
            else:
                self.drafter = make_drafter(head, target, tree)
        else:
            if tree is not None:
                raise ValueError("tree options belong to the drafter; a custom drafter ignores `tree`")
            if not isinstance(head, Drafter):
                raise TypeError(f"{type(head).__name__} is neither a draftsmith head nor an infer.drafters.Drafter "
                                "(subclass it: new_rows, observe_rows, propose_rows; max_nodes as needed)")
            self.head = None
            self.drafter = head
        self.acceptance = acceptance
        self.typical = (probability("typical_threshold", typical_threshold, allow_none=False),
                        probability("typical_alpha", typical_alpha, allow_none=False))
        self.profile = profile
        if cache_implementation not in (None, "static"):
            raise ValueError(f"cache_implementation={cache_implementation!r}: draftsmith decodes on a preallocated "
                             "static cache on every device; leave it unset (compile=True/False is the one switch)")
        self.cache_implementation = "static"
        compile = check_compile(compile)
        self.compile = default_compile(self.device) if compile is None else compile
        self._verify_fn = self._make_verify_fn(self.compile, self.device)
        self.drafter.compile_with(self.compile)  # the same switch for the draft step
        self._compiled_shapes: set[tuple[int, int]] = set()
        self._static_cache: StaticKVCache | None = None  # reused across calls while large enough
        self._stack: nn.Module | None = None  # a hybrid's replay: the layers up to its last recurrent one
        # Gated DeltaNet modules whose short verifies and replays run the per-token rule (infer.delta_rule);
        # empty: the routing is off (scripts/bench_rollback.py --rules chunked empties it to time the chunked rule)
        self.per_token_modules = per_token_modules(target) if self.hybrid else ()
        self._arange_cache: Tensor | None = None  # arange(budget): the verify step's slot offsets
        if not (plan is None or isinstance(plan, (SpeculationPlan, str, os.PathLike))):
            raise ValueError(f"plan must be a SpeculationPlan, the path of one or None, got {type(plan).__name__}")
        self.plan = plan if plan is None or isinstance(plan, SpeculationPlan) else SpeculationPlan.load(plan)
        self.rollback = self._check_rollback(rollback)
        self.last_stats = GenerationStats()

    def _check_rollback(self, rollback: str | None) -> str:
        """The hybrid rollback: "merged" needs an eager verify (the pending tokens widen it past the budget a
        compiled one is padded to) and a drafter that does not draft into the target's cache (layer skip's
        shared KV: its draft would read states missing the pending tokens)."""
        if rollback not in (None, "merged", "replay"):
            raise ValueError(f"rollback must be 'merged', 'replay' or None, got {rollback!r}")
        why = ("compile is on (a compiled verify has one shape)" if self.compile else
               f"{type(self.drafter).__name__} drafts into the target's cache" if self.drafter.entry_model is not None
               else None)
        if rollback == "merged" and why is not None and self.hybrid:
            raise ValueError(f"rollback='merged' cannot run here: {why}; use rollback='replay' or None")
        return rollback or ("merged" if why is None else "replay")

    @staticmethod
    def _make_verify_fn(compile: bool | str, device: torch.device):
        return compiled(masked_forward, compile, device)

    @classmethod
    def from_pretrained(
        cls,
        target_path: str,
        head_path: str | nn.Module | Callable[[nn.Module], Drafter],
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        threads: int | None = None,
        **kwargs: Any,
    ) -> SpeculativeGenerator:
        """Load a target (HF id, directory or ``demo:<size>``) and a head (directory, HF id, or a loaded
        head) or a drafter (a callable building one from the loaded target: ``lambda t: NgramDrafter()``);
        ``kwargs`` go to ``__init__``. ``device`` defaults to CUDA when available, ``dtype`` to the target
        checkpoint's own (the head follows the target). On CPU the thread count follows the one policy
        of ``infer.threads.choose_threads`` (``threads`` or ``OMP_NUM_THREADS`` set it, else a short
        probe); the line saying what was chosen goes to stderr.
        """
        device = default_device(device)
        if device.type == "cpu":
            print(choose_threads(threads), file=sys.stderr, flush=True)
        target_path = resolve_target(target_path)
        check_supported(load_target_config(target_path))  # before the weights (and sdpa's own refusal of RNNs)
        target = load_target(target_path, dtype=dtype or "auto", attn_implementation="sdpa").to(device).eval()
        if callable(head_path) and not isinstance(head_path, nn.Module):
            head = head_path(target)  # a drafter built for the loaded target
        else:
            if isinstance(head_path, (str, os.PathLike)) and "plan" not in kwargs:
                kwargs["plan"] = find_plan(head_path)  # scripts/calibrate_speculation.py's, when there is one
            head = (head_path if isinstance(head_path, nn.Module) else AutoHead.from_pretrained(head_path)).eval()
        try:
            tokenizer = load_target_tokenizer(target_path)
        except (OSError, ValueError):  # a bare checkpoint without tokenizer files still generates from ids
            tokenizer = None
        return cls(target, head, tokenizer=tokenizer, **kwargs)

    # ------------------------------------------------------------------------------ checks

    def _check(self, input_ids: Tensor, max_new_tokens: int, sampling: Sampling) -> None:
        check_sampling_params(sampling.temperature, sampling.top_k, sampling.top_p)
        if not isinstance(input_ids, Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
            raise ValueError("input_ids must be a LongTensor of shape (batch, prompt_len)")
        if input_ids.shape[0] == 0:
            raise ValueError("input_ids has batch size 0: pass at least one prompt")
        if input_ids.shape[1] == 0:
            raise ValueError("the prompt is empty: pass at least one token (e.g. BOS)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        config = _text_config(self.target)
        vocab = config.vocab_size
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:  # sync
            raise ValueError(f"input_ids contain ids outside the target's vocabulary [0, {vocab})")
        total = input_ids.shape[1] + max_new_tokens
        context = getattr(config, "max_position_embeddings", None)
        if context is not None and input_ids.shape[1] >= context:
            raise ValueError(f"the prompt has {input_ids.shape[1]} tokens; the target's context is {context}")
        if context is not None and total > context:
            raise ValueError(
                f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"target's context of {context} tokens"
            )

    def _check_batch(self, input_ids: Tensor, attention_mask: Tensor | None, streamer: Any) -> Tensor:
        """The batch's (B, P) attention mask on the device (ones when None)."""
        if streamer is not None and input_ids.shape[0] > 1:
            raise ValueError(f"streamer needs batch size 1 (as HF's streamers), got {input_ids.shape[0]}")
        if attention_mask is None:
            return torch.ones_like(input_ids, device=self.device)
        if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got {shape}")
        mask = attention_mask.to(self.device).long()
        if bool(((mask != 0) & (mask != 1)).any()):  # sync
            raise ValueError("attention_mask must hold 0 (pad) and 1 (token) only")
        if bool((mask[:, 1:] < mask[:, :-1]).any()) or bool((mask[:, -1] == 0).any()):  # sync
            raise ValueError("attention_mask is not left-padded: pad every row on the left "
                             "(tokenizer.padding_side='left'), its last column holding a real token")
        return mask

    def _pad_id(self, pad_token_id: int | None, eos: Tensor) -> int:
        if pad_token_id is None:
            pad_token_id = getattr(getattr(self.target, "generation_config", None), "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = int(eos[0]) if eos.numel() else 0
        return int(pad_token_id)

    def _eos_ids(self, eos_token_id: int | list[int] | None) -> Tensor:
        if eos_token_id is None:  # as HF generate: the model's generation config decides
            gen_config = getattr(self.target, "generation_config", None)
            eos_token_id = getattr(gen_config, "eos_token_id", None)
        if isinstance(eos_token_id, Tensor):
            eos_token_id = eos_token_id.tolist()
        ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        vocab = _text_config(self.target).vocab_size
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
            raise ValueError(f"eos_token_id must be a token id or a list of them in [0, {vocab}), got {eos_token_id!r}")
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------------------- steps

    def _features(self, out: TargetOutput) -> Tensor:
        return out.aux_hidden if self.drafter.aux_layer_ids else out.final_hidden  # (1, T, F)

    def _next_token(self, logits: Tensor, sampling: Sampling) -> Tensor:
        """First new token from the prefill's last logits (V,), as HF's loop picks it."""
        if sampling.greedy:
            return logits.float().argmax()
        return torch.multinomial(sampling.probs(logits), 1)[0]

    def verify(self, cache: StaticKVCache, draft: Draft | list[Draft],
               stats: GenerationStats | None = None) -> tuple[int, TargetOutput]:
        """One target forward over all of ``draft``'s tree nodes after what ``cache`` holds (one row; a list
        of B drafts: row b's, every row after the same prefix); returns (prefix length, output). Public for
        benchmarks that time t(N): the step ``generate`` runs."""
        stats = stats if stats is not None else GenerationStats()
        drafts = draft if isinstance(draft, list) else [draft]
        prefix = cache.get_seq_length()
        lengths = torch.full((len(drafts),), prefix, dtype=torch.long, device=self.device)
        out = self._verify_rows(cache, drafts, lengths, torch.zeros_like(lengths), stats)
        n = max(d.tokens.shape[0] for d in drafts)
        aux = out.aux_hidden[:, :n] if out.aux_hidden is not None else None
        return prefix, TargetOutput(out.logits[:, :n], out.final_hidden[:, :n], aux, cache)

    def _verify_rows(self, cache: StaticKVCache, drafts: list[Draft], lengths: Tensor, pads: Tensor,
                     stats: GenerationStats, from_entry: bool = False) -> TargetOutput:
        """One [B, N] target forward: row b's draft at its own slots ``lengths[b]``.., positions
        ``lengths[b] - pads[b]``.. and mask (its ``pads[b]`` left-pad columns hidden, its tree after
        its prefix). Compiled: every draft padded to the tree budget over the whole buffer (one
        shape); eager: to the step's largest draft over the used slots. Dummy nodes see only the
        prefix and themselves; no real node sees them and nobody reads their outputs.
        ``from_entry`` (eager): the drafts carry the states entering the drafter's ``entry_model``, whose
        earlier layers' KV they wrote already: the verify runs that model on them (a draft without
        entries, a finished row's, gets zeros: its outputs are never read)."""
        if self.compile:
            n, width = self.required_budget, cache.max_len
            cache.window = None
        else:
            n = max(d.tokens.shape[0] for d in drafts)
            width = cache.length + n  # cache.length: the longest row's (a host int)
            cache.grow(width)  # a drafter without max_nodes may draft past the room reserved
            cache.window = width  # eager: attend over the used slots only
        if self.hybrid:
            for d in drafts:
                if d.tree.retrieve_indices.shape != (1, d.tokens.shape[0]):
                    raise ValueError(f"{type(self.target).__name__} is a hybrid (recurrent layers read a verify's tokens "
                                     "as one sequence): drafts must be chains (tree=Chain(n), or no tree), not trees")
        padded = [pad_tree(d.tokens, d.tree.depths, d.tree.mask, n) for d in drafts]
        tokens = torch.stack([t for t, _, _ in padded])  # (B, N)
        depths = torch.stack([d for _, d, _ in padded])
        blocks = torch.stack([m for _, _, m in padded])  # (B, N, N)
        slots = lengths[:, None] + self._arange(n)[None]
        positions = (lengths - pads)[:, None] + depths
        mask = attention_masks(_text_config(self.target), verify_mask(lengths, pads, blocks, width, self.dtype), positions,
                               verify_key_positions(lengths, pads, positions, width))
        stats.verified_tokens += tokens.numel()
        shape = (*tokens.shape, cache.max_len)
        first = shape not in self._compiled_shapes and bool(self.compile)
        if first:
            self._sync()
            start = time.perf_counter()
        if self.compile:
            step_begin(self.device)
        with per_token_rule(self.per_token_modules):  # short verifies: the per-token Gated DeltaNet rule
            if from_entry:
                hidden = next(d.entry for d in drafts if d.entry is not None)
                entries = hidden.new_zeros(*tokens.shape, hidden.shape[-1])  # (B, N, H)
                for b, d in enumerate(drafts):
                    if d.entry is not None:
                        entries[b, : d.entry.shape[0]] = d.entry
                out = masked_forward(self.drafter.entry_model, tokens, slots, mask, positions, cache,
                                     self.drafter.aux_layer_ids, inputs_embeds=entries)
            else:
                out = self._verify_fn(self.target, tokens, slots, mask, positions, cache, self.drafter.aux_layer_ids)
        if first:
            self._sync()
            stats.compile_time += time.perf_counter() - start
            self._compiled_shapes.add(shape)
        return out

    def _replay(self, cache: StaticKVCache, before: Checkpoint, tokens: Tensor, short: dict[int, int],
                starts: Tensor, pads: Tensor, stats: GenerationStats) -> None:
        """Put row b's recurrent states after its first ``short[b]`` ``tokens`` (B, T), whose KV sits at slots
        ``starts[b]``..: for each distinct length a, the states from ``before`` are restored and the first a
        tokens of every row run through the target again (one [B, a] forward, whose attention rewrites the
        same KV at the same slots); rows keeping a take that forward's states. Rows not in ``short`` keep
        the states they hold now."""
        after = cache.states.checkpoint()  # the verify's states: rows that kept every position
        kept = torch.tensor([short.get(b, 0) for b in range(tokens.shape[0])], device=self.device)
        stack = self._replay_stack()
        for a in sorted(set(short.values())):
            cache.states.restore(before)
            offsets = torch.arange(a, device=self.device)[None]
            slots = starts[:, None] + offsets  # (B, a) the accepted path's slots
            positions = (starts - pads)[:, None] + offsets
            causal = torch.ones(a, a, dtype=torch.bool, device=self.device).tril_().expand(tokens.shape[0], a, a)
            width = cache.length + a
            cache.window = width
            mask = attention_masks(_text_config(self.target), verify_mask(starts, pads, causal, width, self.dtype),
                                   positions, verify_key_positions(starts, pads, positions, width))
            cache.slots = slots
            with per_token_rule(self.per_token_modules):
                stack(input_ids=tokens[:, :a], attention_mask=mask, position_ids=positions, use_cache=True,
                      **cache_kwargs(stack, cache))
            stats.replays += 1
            stats.replayed_tokens += a * tokens.shape[0]
            after.take_rows(cache.states.current(), kept == a)
        cache.states.restore(after)

    def _replay_stack(self) -> nn.Module:
        """What a replay runs: the target's decoder stack up to its last recurrent layer, a view sharing its
        layers (no later layer, final norm or lm_head: the replay wants states, not outputs)."""
        if self._stack is None:
            types = layer_types(self.target)
            last = max(i for i, t in enumerate(types) if t in RECURRENT_LAYER_TYPES)
            self._stack = shallow_backbone(self.target, last + 1) if last + 1 < len(types) else backbone_of(self.target)
        return self._stack

    def _sync(self) -> None:
        sync(self.device)  # sync: only around compilation, to time it

    def prefill(self, ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None = None) -> TargetOutput:
        """The prompts' forward (B, P), left-padded per ``attention_mask`` (None: no padding), into the
        (reused) static buffer, sized for ``max_new_tokens`` more plus the tree budget; the cache is
        ``out.past_key_values``. Positions are ``attention_mask.cumsum - 1``."""
        budget = self.required_budget if self.compile else self.budget or 1
        cache = self._reserve_static_cache(ids.shape[1] + max_new_tokens + budget, ids.shape[0])
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask
        cache.window = ids.shape[1]  # the prefill is eager: it attends over the prompt's slots only
        positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
        padding = mask if attention_mask is not None and bool((mask == 0).any()) else None  # sync
        masks = attention_masks(_text_config(self.target), prefill_mask(mask, self.dtype), positions, positions, padding)
        out = masked_forward(self.target, ids, torch.arange(ids.shape[1], device=self.device), masks,
                             positions, cache, self.drafter.aux_layer_ids)
        cache.length = ids.shape[1]
        return out

    def _reserve_static_cache(self, needed: int, batch: int = 1) -> StaticKVCache:
        """The static buffer, allocated again only when a call needs more slots than it has or
        another batch size (sizes rounded up to a power of two >= 256, so a compiled step sees few
        cache shapes)."""
        cache = self._static_cache
        stale = cache is not None and cache.buffer is not None and cache.buffer.shape[2] != batch
        if cache is None or cache.max_len < needed or stale:
            size = max(256, 1 << (needed - 1).bit_length())
            cache = StaticKVCache(len(decoder_layers(self.target)), size)
            self._static_cache = cache
        cache.length = 0
        cache.reset_states()
        return cache

    @property
    def budget(self) -> int | None:
        """Tree budget N: the most nodes (root included) a draft of this drafter can have (its
        ``max_nodes``; None when it declares none, which only the eager path accepts)."""
        budget = self.drafter.max_nodes
        return None if budget is None else int(budget)

    @property
    def required_budget(self) -> int:
        """``budget``, which a compiled verify pads every draft to: refused when the drafter has none."""
        if self.budget is None:
            raise ValueError(
                f"a compiled verify pads every draft to the drafter's max_nodes (the most nodes a draft can "
                f"have); {type(self.drafter).__name__} has none: give it a max_nodes attribute or compile=False"
            )
        return self.budget

    def _arange(self, n: int) -> Tensor:
        """arange(n) on the device, kept while n repeats (a verify's slot offsets)."""
        cached = self._arange_cache
        if cached is None or cached.shape[0] != n:
            cached = self._arange_cache = torch.arange(n, device=self.device)
        return cached

    def _sample_accept(self, logits: Tensor, draft: Draft, sampling: Sampling) -> Accepted:
        """One row's acceptance at temperature > 0 (greedy rows are accepted together: ``_accept_rows``)."""
        tree = draft.tree
        p = sampling.probs(logits)  # (N, V)
        if self.acceptance == "typical":
            return typical_accept(p, draft.tokens, tree.retrieve_indices, *self.typical)
        if draft.q is not None:
            return chain_sample_accept(p[None], draft.q[None], draft.tokens[None])
        return tree_sample_accept(p[None], draft.tokens[None], tree.children)

    def _accept_rows(self, logits: Tensor, drafts: list[Draft], live: list[int],
                     sampling: Sampling) -> tuple[Tensor, Tensor, Tensor]:
        """Accept every live row's draft: (nodes (B, W) accepted node indices root first, -1 after;
        new (B, W) the accepted drafts then the bonus; length (B,) accepted nodes per row). Greedy: every
        row at once on the device; sampling: each row's draft accepted on its own (the accept loop
        reads the host per level)."""
        bsz, width = logits.shape[:2]
        if sampling.greedy:
            tokens = torch.stack([nn.functional.pad(d.tokens, (0, width - d.tokens.shape[0])) for d in drafts])  # (B, N)
            depth = max(d.tree.retrieve_indices.shape[1] for d in drafts)
            paths = torch.full((bsz, max(d.tree.retrieve_indices.shape[0] for d in drafts), depth), -1,
                               dtype=torch.long, device=self.device)
            for b, d in enumerate(drafts):
                paths[b, : d.tree.retrieve_indices.shape[0], : d.tree.retrieve_indices.shape[1]] = d.tree.retrieve_indices
            accepted = greedy_accept_rows(logits, tokens, paths)
            drafted = tokens.gather(1, accepted.nodes[:, 1:].clamp(min=0))  # (B, D) the accepted drafts
            nodes, length, bonus = accepted.nodes, accepted.length, accepted.bonus
        else:
            nodes = torch.full((bsz, width), -1, dtype=torch.long, device=self.device)
            drafted = torch.zeros((bsz, width - 1), dtype=torch.long, device=self.device)
            length = torch.ones(bsz, dtype=torch.long, device=self.device)  # a finished row: its root alone
            bonus = torch.zeros(bsz, dtype=torch.long, device=self.device)
            for b in live:
                draft = drafts[b]
                accepted = self._sample_accept(logits[b, : draft.tokens.shape[0]], draft, sampling)
                path = accepted.nodes[0]  # (W,) root first, -1 after the accepted nodes
                nodes[b, : path.shape[0]] = path
                drafted[b, : path.shape[0] - 1] = draft.tokens[path[1:].clamp(min=0)]
                length[b], bonus[b] = accepted.length[0], accepted.bonus[0]
        new = torch.cat([drafted, drafted.new_zeros(bsz, 1)], dim=1)
        new.scatter_(1, (length - 1)[:, None], bonus[:, None])  # (B, D+1) the accepted drafts then the bonus
        return nodes, new, length

    def _settle(self, dec: Decoding, new: Tensor, length: Tensor,
                seen: Callable[[int, int], tuple[Tensor, Tensor]]) -> list[int]:
        """The bookkeeping after a forward, the prefill's (its first token) and every step's alike: each live
        row keeps its ``new`` (B, W) tokens up to its accepted ``length`` (B,), cut after the first EOS and
        to its budget (one host read), emits them, stops or takes its last accepted token as the next root;
        the drafter observes ``seen(b, a)`` = (features (1, a, F), next tokens (1, a)) of each row going on
        that accepted a nodes.
        Returns each row's accepted length (0 for a row that had already stopped)."""
        valid = torch.arange(new.shape[1], device=self.device)[None] < length[:, None]
        hit = (torch.isin(new, dec.eos) if dec.eos.numel() else torch.zeros_like(valid)) & valid
        upto = torch.where(hit.any(dim=1), hit.int().argmax(dim=1) + 1, length)  # tokens up to the first EOS
        info = torch.stack([length, upto, hit.any(dim=1).long()]).tolist()  # sync: the step's one host read
        accepted, observe = [0] * len(dec.rows), []
        for b in dec.live():
            row = dec.rows[b]
            accepted[b] = info[0][b]
            kept = min(info[1][b], dec.max_new_tokens - row.num_new)
            row.emitted.append(new[b, :kept])
            row.num_new += kept
            if dec.streamer is not None:
                dec.streamer.put(new[b, :kept].cpu())
            dec.done[b] = bool(info[2][b]) or row.num_new >= dec.max_new_tokens
            if not dec.done[b]:
                row.root = new[b, accepted[b] - 1]
                if dec.levels != 0:
                    observe.append((b, *seen(b, accepted[b])))
        dec.clock.mark("emit")
        if observe:
            self.drafter.observe_rows([dec.rows[b].draft for b, _, _ in observe], [f for _, f, _ in observe],
                                      [t for _, _, t in observe])
        return accepted

    # ------------------------------------------------------------------------------- loop

    @torch.inference_mode()
    def start(self, input_ids: Tensor, attention_mask: Tensor | None = None, max_new_tokens: int = 128,
              temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, eos_token_id: int | list[int] | None = None,
              streamer: Any = None, pad_token_id: int | None = None) -> Decoding:
        """The prefill: the checks, the prompts' forward, each row's first token through ``_settle`` and the
        drafter's first look at the prompt. Returns the decode state that ``step`` advances and ``finish``
        turns into ``generate``'s output (arguments as ``generate``'s)."""
        sampling = Sampling(float(temperature), top_k, float(top_p))
        self._check(input_ids, max_new_tokens, sampling)
        mask = self._check_batch(input_ids, attention_mask, streamer)
        clock = _PhaseClock(self.device, self.profile)
        started = time.perf_counter()
        clock.start()
        eos = self._eos_ids(eos_token_id)
        ids = input_ids.to(self.device)
        bsz, plen = ids.shape
        if streamer is not None:
            streamer.put(ids.cpu())
        out = self.prefill(ids, max_new_tokens, mask)
        pads = (mask == 0).sum(dim=1)  # (B,) left-pad columns per row
        host_pads = pads.tolist() if attention_mask is not None else [0] * bsz  # sync
        # the plan's draft levels for this batch size (None: the drafter's own; 0: no drafting at all)
        levels = self.plan.length_for(bsz) if self.plan is not None else None
        # the drafter's states (its own buffers, shared by the rows of a drafter that drafts them at once)
        states = (self.drafter.new_rows([ids[b: b + 1, pad:] for b, pad in enumerate(host_pads)],  # prompts, unpadded
                                        [plen - pad + max_new_tokens for pad in host_pads]) if levels != 0 else [None] * bsz)
        first = torch.stack([self._next_token(out.logits[b, -1], sampling) for b in range(bsz)])  # (B,)
        dec = Decoding(cache=out.past_key_values, rows=[DecodeState(states[b], first[b]) for b in range(bsz)],
                       done=[False] * bsz, lengths=torch.full((bsz,), plen, dtype=torch.long, device=self.device),
                       host_lengths=[plen] * bsz, pads=pads, host_pads=host_pads, levels=levels, sampling=sampling, eos=eos,
                       max_new_tokens=max_new_tokens, input_ids=input_ids, pad_id=self._pad_id(pad_token_id, eos),
                       streamer=streamer, clock=clock, started=started, stats=GenerationStats(target_forwards=1))
        features = self._features(out)
        seen = []
        for b, pad in enumerate(host_pads):
            seen.append((features[b: b + 1, pad:], torch.cat([ids[b, pad + 1:], first[b: b + 1]])[None]))
        clock.mark("prefill")
        self._settle(dec, first[:, None], torch.ones_like(first), lambda b, a: seen[b])
        clock.mark("observe")
        return dec

    @torch.inference_mode()
    def step(self, dec: Decoding) -> None:
        """One speculative step for every live row: draft, one [B, N] verify, accept, emit and observe,
        compact the accepted paths (and roll a hybrid's recurrent states back to them)."""
        live, cache, clock = dec.live(), dec.cache, dec.clock
        before = None
        if self.hybrid:  # recurrent states before the step (pending tokens: restored to that checkpoint already)
            before = dec.before if dec.pending is not None else cache.states.checkpoint()
        drafts = [root_only(row.root) for row in dec.rows]  # a finished row's: a masked no-op, never read
        if dec.levels != 0:
            # Drafts deeper than remaining - 1 could never be emitted: don't draft or verify them.
            depths = [dec.max_new_tokens - dec.rows[b].num_new - 1 for b in live]
            depths = depths if dec.levels is None else [min(d, dec.levels) for d in depths]
            if not self.compile:  # a drafter sharing the target's KV drafts into it (layer skip)
                self.drafter.before_draft(cache, dec.host_lengths, dec.host_pads)
            proposed = self.drafter.propose_rows([dec.rows[b].draft for b in live], [dec.rows[b].root for b in live],
                                                 dec.sampling, depths)
            for b, draft in zip(live, proposed):
                drafts[b] = draft
        clock.mark("draft")
        shared = self.drafter.entry_model is not None and all(drafts[b].entry is not None for b in live)
        verified, starts, p = drafts, dec.lengths, 0
        if dec.pending is not None:  # rollback="merged": the pending tokens again, in front of each live row's draft
            p = dec.pending.shape[1]
            verified = [_after_pending(dec.pending[b], d) if b in live else d for b, d in enumerate(drafts)]
            is_live = torch.zeros_like(dec.lengths)
            is_live[live] = 1
            starts = dec.lengths - p * is_live  # (B,) a finished row verifies its root alone, at its own length
            dec.stats.pending_tokens += p * len(live)
        out = self._verify_rows(cache, verified, starts, dec.pads, dec.stats, from_entry=shared)
        width = out.logits.shape[1]  # positions every row verified (its pending tokens, its draft, padding)
        if p:  # the pending positions' outputs were read by the previous step: keep the draft's
            out = TargetOutput(out.logits[:, p:], out.final_hidden[:, p:],
                               None if out.aux_hidden is None else out.aux_hidden[:, p:], cache)
        features = self._features(out)
        dec.stats.target_forwards += 1
        dec.stats.steps += 1
        clock.mark("verify")
        nodes, new, length = self._accept_rows(out.logits, drafts, live, dec.sampling)
        clock.mark("accept")
        emitted = [row.num_new for row in dec.rows]
        accepted = self._settle(dec, new, length, lambda b, a: (features[b: b + 1, nodes[b, :a]], new[b: b + 1, :a]))
        dec.stats.step_tokens += sum(row.num_new - n for row, n in zip(dec.rows, emitted))
        clock.mark("observe")
        cache.compact_rows(dec.lengths, nodes[:, : max(accepted)])
        clock.mark("compact")
        if before is not None:
            # each row's tokens since ``before``: its pending ones, its root, its accepted drafts (B, p + max a)
            roots = torch.stack([d.tokens[0] for d in drafts])[:, None]
            pieces = [roots, new[:, : max(accepted) - 1]] if dec.pending is None else \
                [dec.pending, roots, new[:, : max(accepted) - 1]]
            kept = [p + a if a else 0 for a in accepted]  # 0: a row that had stopped before this step
            self._rollback(dec, before, torch.cat(pieces, dim=1), kept, width, starts)
            clock.mark("rollback")  # a hybrid's recurrent states back to the accepted tokens
        dec.host_lengths = [n + a for n, a in zip(dec.host_lengths, accepted)]
        dec.lengths = torch.tensor(dec.host_lengths, device=self.device)
        cache.length = max(dec.host_lengths)

    def _rollback(self, dec: Decoding, before: Checkpoint, tokens: Tensor, kept: list[int], width: int,
                  starts: Tensor) -> None:
        """Leave each live row's recurrent states after exactly the tokens it keeps: ``tokens`` (B, T) are each
        row's tokens since ``before`` (pending ones, root, accepted drafts), of which row b keeps ``kept[b]``;
        the verify ran ``width`` positions per row from slot ``starts[b]``. A row that kept all ``width``
        holds the verify's states (its padding, if any, came after them: it never keeps a padded state).
        The others: with rollback="merged", when every live row keeps the same q < width tokens (always for
        one row; at most ``MAX_PENDING``), the states go back to ``before`` and those q tokens become the
        next verify's pending ones; otherwise (rows disagree, "replay", too many pending) ``_replay`` runs
        them again now."""
        live = set(dec.live())
        short = {b: k for b, k in enumerate(kept) if b in live and 0 < k < width}
        dec.pending = None
        if not short:
            return
        lengths = set(short.values())
        if self.rollback == "merged" and len(short) == len(live) and len(lengths) == 1 and max(lengths) <= MAX_PENDING:
            dec.cache.states.restore(before)
            dec.pending, dec.before = tokens[:, : max(lengths)], before
            return
        self._replay(dec.cache, before, tokens, short, starts, dec.pads, dec.stats)

    def finish(self, dec: Decoding) -> Tensor:
        """``generate``'s output from a finished decode: (B, prompt_len + longest row's new tokens) on the
        prompt's device, a row padded with the pad id after its end; the call's stats into ``last_stats``."""
        if dec.streamer is not None:
            dec.streamer.end()
        rows, bsz = dec.rows, len(dec.rows)
        new = torch.full((bsz, max(row.num_new for row in rows)), dec.pad_id, dtype=dec.input_ids.dtype,
                         device=self.device)
        for b, row in enumerate(rows):
            new[b, : row.num_new] = torch.cat(row.emitted)
        dec.stats.new_tokens = sum(row.num_new for row in rows)
        dec.stats.wall_time = time.perf_counter() - dec.started
        dec.stats.phase_times = dec.clock.times
        self.last_stats = dec.stats
        return torch.cat([dec.input_ids, new.to(dec.input_ids.device)], dim=1)

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_token_id: int | list[int] | None = None,
        streamer: Any = None,
        pad_token_id: int | None = None,
    ) -> Tensor:
        """Generate like ``target.generate`` (greedy when temperature == 0, otherwise sampling with
        HF's temperature -> top-k -> top-p). Returns (B, prompt_len + new) on ``input_ids``' device.

        A batch is LEFT-padded as for HF's batched ``generate`` (``attention_mask`` 0 on pad
        columns; None = no padding): every row is decoded on its own cache slots, positions, EOS and
        budget, each as it would be alone (batch size 1 is the same loop with one row), and the
        output runs to the longest row, a row padded with ``pad_token_id`` after its end (None: the
        target's generation config, else the first EOS, else 0).

        ``top_k=0`` disables top-k (HF's ``generate`` applies top_k=50 unless told otherwise: pass
        the same values to both when comparing). ``eos_token_id=None`` uses the target's
        generation config, as HF does. ``streamer`` (batch size 1, as HF's) gets HF's ``put``/``end``
        calls: the prompt first, then each accepted run.

        The public steps, for callers that drive the loop themselves: ``start`` (the prefill and the
        first token), ``step`` (one draft -> verify -> accept for every live row), ``finish``.
        """
        dec = self.start(input_ids, attention_mask, max_new_tokens, temperature, top_p, top_k, eos_token_id,
                         streamer, pad_token_id)
        while not all(dec.done):
            self.step(dec)
        return self.finish(dec)
