"""The speculative generation loop: draft -> verify (one target forward) -> accept -> compact.

One step:
1. the drafter proposes a tree rooted at the last emitted token (the "root", not yet in the
   target's KV cache);
2. the target runs once over all tree nodes with a 4D additive tree mask and depth positions;
3. an acceptance rule keeps the longest valid path and picks the bonus token after it;
4. the target cache keeps exactly prefix + accepted nodes; the drafter observes the accepted
   tokens with their true target features; the bonus token becomes the next root.
A hybrid target's recurrent states go back to the accepted tokens through the generator's ``Rollback``
(``infer.rollback``), called before the draft and the verify and after the accept; the call in progress is a
``Decoding`` (``infer.decoding``: its settings, instruments and state apart).

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
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
from torch import Tensor, nn

from draftsmith.data.base.checks import flag, probability
from draftsmith.data.base.device import default_device, sync
from draftsmith.data.targets import load_target, load_target_config, load_target_tokenizer, resolve_target
from draftsmith.heads import AutoHead
from draftsmith.heads.common import text_config
from draftsmith.infer.accept import categorical
from draftsmith.infer.batch_accept import ACCEPTANCE_RULES, accept_rows
from draftsmith.infer.cache import StaticKVCache, buffer_size
from draftsmith.infer.call_checks import batch_mask, check_call, eos_ids, pad_id
from draftsmith.infer.compiling import check_compile, compiled, step_begin
from draftsmith.infer.cost_profile import prepare_costs
from draftsmith.target.decode_check import check_family
from draftsmith.infer.decoding import (DecodeInstruments, DecodeSettings, DecodeState, Decoding, GenerationStats, PhaseClock,
                                       RowState)
from draftsmith.target.delta_rule import per_token_modules, per_token_rule, prefill_rule
from draftsmith.infer.drafters import (Chain, Draft, Drafter, Sampling, TreeOption, adaptive_chain, default_chain,
                                      head_drafter_class, make_drafter, root_only)
from draftsmith.infer.masked_forward import attention_masks, masked_forward, prefill_mask, verify_key_positions, verify_mask
from draftsmith.target.recurrent import check_chain_drafter, check_supported, is_hybrid
from draftsmith.infer.rollback import make_rollback
from draftsmith.infer.speculation_plan import SpeculationPlan, find_plan
from draftsmith.target.lean import lean_stack
from draftsmith.target.model import TargetOutput, decoder_layers
from draftsmith.target.threads import choose_threads
from draftsmith.infer.tree import pad_tree

SUPPORTED_ATTENTION = ("sdpa", "eager")  # flash attention takes no arbitrary tree mask


def default_compile(device: torch.device | str) -> bool:
    """Whether the verify step is compiled when the caller does not say, chosen by measurement
    (docs/benchmarks.md): on CUDA yes (CUDA graphs remove the launch cost that dominates small
    forwards); on CPU no (a compiled CPU step saves little where a forward is compute-bound, and
    costs a long first compile)."""
    return torch.device(device).type == "cuda"


def _drafter_for(head: nn.Module | Drafter, target: nn.Module, tree: TreeOption | None, hybrid: bool,
                 device: torch.device, dtype: torch.dtype) -> Drafter:
    """The drafter of a head (checked against ``target`` and moved to its device and dtype) or a custom one. A
    hybrid target's recurrent layers read a verify's tokens as one sequence: its drafts are chains."""
    if not isinstance(head, nn.Module):
        if tree is not None:
            raise ValueError("tree options belong to the drafter; a custom drafter ignores `tree`")
        if not isinstance(head, Drafter):
            raise TypeError(f"{type(head).__name__} is neither a draftsmith head nor an infer.drafters.Drafter "
                            "(subclass it: new_rows, observe_rows, propose_rows; max_nodes as needed)")
        check_chain_drafter(target, head)  # a hybrid verifies chains (target.recurrent)
        return head
    head.check_target(target)
    head.to(device=device, dtype=dtype)
    if hybrid and tree is not None and not isinstance(tree, Chain):
        raise ValueError(f"{type(target).__name__} is a hybrid (recurrent layers read a verify's tokens as one "
                         f"sequence): drafts must be chains (tree=Chain(n), or no tree), not a {type(tree).__name__}")
    if hybrid and tree is None:  # chains only: the kind's default chain where it adapts (an EAGLE head's on CPU:
        if head_drafter_class(head).adapts_by_default(device):  # adaptive greedy, its length chosen sampled or batched)
            return default_chain(head, target)
        return adaptive_chain(head, target)  # elsewhere its adaptive chain
    return make_drafter(head, target, tree)


def _drop_front(out: TargetOutput, p: int) -> TargetOutput:
    """``out`` without every row's first ``p`` positions (pending tokens whose outputs an earlier step read)."""
    if not p:
        return out
    return TargetOutput(out.logits[:, p:], out.final_hidden[:, p:],
                        None if out.aux_hidden is None else out.aux_hidden[:, p:], out.past_key_values)


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
        acceptance: the rule at temperature > 0: "exact" (lossless, token by token: ``infer.accept``),
            "traversal" (lossless, sequence by sequence, leaf to root: ``infer.traversal``, docs/traversal.md;
            it keeps more than "exact" on sampled drafts: chains at temperature > 0, ``StaticTree(sampled=True)``)
            or "typical" (Medusa's typical acceptance: LOSSY, with ``typical_threshold`` and ``typical_alpha``).
            Greedy decoding (temperature 0) has one rule whatever this says.
        profile: time each phase of the loop into ``last_stats.phase_times`` (adds a device sync
            per phase; for finding where a step's time goes, not for measuring speed).
        compile: compile the verify step with ``torch.compile`` (True: inductor, with CUDA graphs
            on CUDA; a string names another ``torch.compile`` backend, e.g. "aot_eager"); None =
            the device's default (``default_compile``: CUDA True, CPU False). The decode state is
            always the preallocated static cache.
        plan: when to speculate (``infer.speculation_plan.SpeculationPlan``, or the path of its JSON): per batch
            size, the most draft levels per step (0: decode without drafting); None = draft as the
            drafter does at every batch size (``from_pretrained`` loads the plan saved next to a head).
        rollback: how a hybrid target's recurrent states go back to the accepted tokens after a partial accept
            (``infer.rollback``, docs/hybrid.md): "recorded" (the verify keeps every position's states, each row
            the accepted one's), "merged" (restore the states from before the step and run the accepted tokens
            again in front of the next step's draft, in its verify) or "replay" (restore, then one more forward
            over them); None = the first that applies (``make_rollback``). Ignored for attention-only targets.
        per_token: a hybrid's short verify and replay forwards run its Gated DeltaNet layers with transformers'
            per-token rule where ``target.delta_rule`` finds it applies (``per_token_modules``); False = their
            chunked rule (what ``lab/bench_rollback.py --rules chunked`` times). Only that rule choice: the
            routing exactness needs (Mamba mixers per token, Mamba-2 scans without the dt clamp) stays either way.
        lean: eager decodes run the target as ``target.lean``'s stack where one applies (an attention family's
            or a hybrid's: its modules' ops bit for bit, without their per-call machinery); False = its own modules.
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
        compile: bool | str | None = None,
        plan: SpeculationPlan | str | os.PathLike | None = None,
        rollback: str | None = None,
        per_token: bool = True,
        lean: bool = True,
    ) -> None:
        check_family(target)  # first: a stateful model it cannot decode is named with its layer kind (or its check)
        attn = getattr(target.config, "_attn_implementation", None)
        if attn not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"target attention '{attn}' cannot take a tree mask; load it with "
                f"attn_implementation in {SUPPORTED_ATTENTION}"
            )
        if acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {acceptance!r}")
        hybrid = is_hybrid(target)
        self.target = target
        self.tokenizer = tokenizer
        self.device = target.get_input_embeddings().weight.device
        self.dtype = target.get_input_embeddings().weight.dtype
        self.head: nn.Module | None = head if isinstance(head, nn.Module) else None
        self.drafter = _drafter_for(head, target, tree, hybrid, self.device, self.dtype)
        self.acceptance = acceptance
        self.typical = (probability("typical_threshold", typical_threshold, allow_none=False),
                        probability("typical_alpha", typical_alpha, allow_none=False))
        self.profile = flag("profile", profile)
        compile = check_compile(compile)
        self.compile = default_compile(self.device) if compile is None else compile
        self._verify_fn = self._make_verify_fn(self.compile, self.device, self.target)
        self.drafter.compile_with(self.compile)  # the same switch for the draft step
        self._compiled_shapes: set[tuple[int, int]] = set()
        self._static_cache: StaticKVCache | None = None  # reused across calls while large enough
        self.lean, self._lean = flag("lean", lean), None  # _lean: the LeanStack of an eager decode, built at each prefill
        # what a hybrid's verify and replay forwards route (target.delta_rule): the Gated DeltaNet rule (per_token),
        # and whatever keeps them equal to the target's own decode (always)
        per_token = flag("per_token", per_token)
        self.per_token_modules = per_token_modules(target, gated_delta_rule=per_token) if hybrid else ()
        self._arange_cache: Tensor | None = None  # arange(budget): the verify step's slot offsets
        if not (plan is None or isinstance(plan, (SpeculationPlan, str, os.PathLike))):
            raise ValueError(f"plan must be a SpeculationPlan, the path of one or None, got {type(plan).__name__}")
        self.plan = plan if plan is None or isinstance(plan, SpeculationPlan) else SpeculationPlan.load(plan)
        self.rollback = make_rollback(rollback, target, hybrid, self.compile, self.drafter, self._forward_context,
                                      self.per_token_modules)
        self.last_stats = GenerationStats()

    def _forward_context(self) -> AbstractContextManager:
        """Every verify's and replay's forward context: ``per_token_rule`` (the prefill's: ``prefill_rule``)."""
        return per_token_rule(self.per_token_modules)

    @staticmethod
    def _make_verify_fn(compile: bool | str, device: torch.device, target: nn.Module):
        return compiled(masked_forward, compile, device, target)

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
        of ``target.threads.choose_threads`` (``threads`` or ``OMP_NUM_THREADS`` set it, else a short
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
                kwargs["plan"] = find_plan(head_path)  # scripts/speculation_plan.py's, when there is one
            head = (head_path if isinstance(head_path, nn.Module) else AutoHead.from_pretrained(head_path)).eval()
        try:
            tokenizer = load_target_tokenizer(target_path)
        except (OSError, ValueError):  # a bare checkpoint without tokenizer files still generates from ids
            tokenizer = None
        return cls(target, head, tokenizer=tokenizer, **kwargs)

    # ------------------------------------------------------------------------------ checks

    # ------------------------------------------------------------------------------- steps

    def _features(self, out: TargetOutput) -> Tensor:
        return out.aux_hidden if self.drafter.aux_layer_ids else out.final_hidden  # (1, T, F)

    def _next_token(self, logits: Tensor, sampling: Sampling) -> Tensor:
        """First new token from the prefill's last logits (V,), as HF's loop picks it."""
        if sampling.greedy:
            return logits.float().argmax()
        return categorical(sampling.probs(logits))

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
        self.rollback.check_drafts(drafts, self.target)  # a hybrid's: chains only
        padded = [pad_tree(d.tokens, d.tree.depths, d.tree.mask, n) for d in drafts]
        tokens = torch.stack([t for t, _, _ in padded])  # (B, N)
        depths = torch.stack([d for _, d, _ in padded])
        blocks = torch.stack([m for _, _, m in padded])  # (B, N, N)
        slots = lengths[:, None] + self._arange(n)[None]
        positions = (lengths - pads)[:, None] + depths
        mask = attention_masks(text_config(self.target), verify_mask(lengths, pads, blocks, width, self.dtype), positions,
                               verify_key_positions(lengths, pads, positions, width))
        stats.verified_tokens += tokens.numel()
        shape = (*tokens.shape, cache.max_len)
        first = shape not in self._compiled_shapes and bool(self.compile)
        if first:
            sync(self.device)  # only around compilation, to time it
            start = time.perf_counter()
        if self.compile:
            step_begin(self.device)
        with self._forward_context(), self.rollback.recording():
            if from_entry:
                hidden = next(d.entry for d in drafts if d.entry is not None)
                entries = hidden.new_zeros(*tokens.shape, hidden.shape[-1])  # (B, N, H)
                for b, d in enumerate(drafts):
                    if d.entry is not None:
                        entries[b, : d.entry.shape[0]] = d.entry
                out = masked_forward(self.drafter.entry_model, tokens, slots, mask, positions, cache,
                                     self.drafter.aux_layer_ids, inputs_embeds=entries)
            else:
                out = self._verify_fn(self.target, tokens, slots, mask, positions, cache, self.drafter.aux_layer_ids, lean=self._lean)
        if first:
            sync(self.device)  # only around compilation, to time it
            stats.compile_time += time.perf_counter() - start
            self._compiled_shapes.add(shape)
        return out

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
        masks = attention_masks(text_config(self.target), prefill_mask(mask, self.dtype), positions, positions, padding)
        self._lean = lean_stack(self.target) if self.lean and not self.compile else None
        with prefill_rule(self.per_token_modules):  # Mamba-2 scans of a prompt shorter than a chunk: one chunk
            out = masked_forward(self.target, ids, torch.arange(ids.shape[1], device=self.device), masks,
                                 positions, cache, self.drafter.aux_layer_ids, lean=self._lean)
        cache.length = ids.shape[1]
        return out

    def _reserve_static_cache(self, needed: int, batch: int = 1) -> StaticKVCache:
        """The static buffer, allocated again only when a call needs more slots than it has or
        another batch size (sized by ``buffer_size``, so a compiled step sees few cache shapes)."""
        cache = self._static_cache
        stale = cache is not None and cache.buffer is not None and cache.buffer.shape[2] != batch
        if cache is None or cache.max_len < needed or stale:
            cache = StaticKVCache(len(decoder_layers(self.target)), buffer_size(needed))
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
        if self._arange_cache is None or self._arange_cache.shape[0] != n:
            self._arange_cache = torch.arange(n, device=self.device)
        return self._arange_cache

    def _settle(self, dec: Decoding, new: Tensor, length: Tensor,
                seen: Callable[[int, int], tuple[Tensor, Tensor]]) -> tuple[list[Tensor], list[int]]:
        """The bookkeeping after a forward, the prefill's (its first token) and every step's alike: each live
        row keeps its ``new`` (B, W) tokens up to its accepted ``length`` (B,), cut after the first EOS and
        to its budget (one host read), emits them, stops or takes its last accepted token as the next root;
        the drafter observes ``seen(b, a)`` = (features (1, a, F), next tokens (1, a)) of each row going on
        that accepted a nodes.
        Returns each row's emitted tokens and accepted length (empty and 0 for a row that had already stopped)."""
        settings, state = dec.settings, dec.state
        valid = torch.arange(new.shape[1], device=self.device)[None] < length[:, None]
        hit = (torch.isin(new, settings.eos) if settings.eos.numel() else torch.zeros_like(valid)) & valid
        upto = torch.where(hit.any(dim=1), hit.int().argmax(dim=1) + 1, length)  # tokens up to the first EOS
        info = torch.stack([length, upto, hit.any(dim=1).long()]).tolist()  # sync: the step's one host read
        emitted, accepted, observe = [new[b, :0] for b in range(len(state.rows))], [0] * len(state.rows), []
        for b in dec.live():
            row = state.rows[b]
            accepted[b] = info[0][b]
            emitted[b] = new[b, : min(info[1][b], settings.max_new_tokens - row.num_new)]
            row.emitted.append(emitted[b])
            row.num_new += emitted[b].shape[0]
            if dec.instruments.streamer is not None:
                dec.instruments.streamer.put(emitted[b].cpu())
            state.done[b] = bool(info[2][b]) or row.num_new >= settings.max_new_tokens
            if not state.done[b]:
                row.root = new[b, accepted[b] - 1]
                if settings.levels != 0:
                    observe.append((b, *seen(b, accepted[b])))
        dec.instruments.clock.mark("emit")
        if observe:
            self.drafter.observe_rows([state.rows[b].draft for b, _, _ in observe], [f for _, f, _ in observe],
                                      [t for _, _, t in observe])
        return emitted, accepted

    # ------------------------------------------------------------------------------- loop

    @torch.inference_mode()
    def start(self, input_ids: Tensor, attention_mask: Tensor | None = None, max_new_tokens: int = 128,
              temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, eos_token_id: int | list[int] | None = None,
              streamer: Any = None, pad_token_id: int | None = None) -> Decoding:
        """The prefill: the checks, the prompts' forward, each row's first token through ``_settle`` and the
        drafter's first look at the prompt. Returns the decode state that ``step`` advances and ``finish``
        turns into ``generate``'s output (arguments as ``generate``'s)."""
        sampling = Sampling(float(temperature), top_k, float(top_p))
        check_call(self.target, input_ids, max_new_tokens, sampling)
        self.drafter.begin(sampling, input_ids.shape[0])  # before new_rows: a policy following the mode or batch picks
        prepare_costs(self, input_ids.shape[0], sampling)  # a drafter choosing lengths by cost: its step costs
        mask = batch_mask(input_ids, attention_mask, streamer, self.device)
        clock = PhaseClock(self.device, self.profile)
        instruments = DecodeInstruments(GenerationStats(target_forwards=1), clock, time.perf_counter(), streamer)
        clock.start()
        eos = eos_ids(self.target, eos_token_id, self.device)
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
        settings = DecodeSettings(sampling, eos, max_new_tokens, levels, input_ids, pad_id(self.target, pad_token_id, eos))
        state = DecodeState(out.past_key_values, [RowState(states[b], first[b]) for b in range(bsz)], [False] * bsz,
                            torch.full((bsz,), plen, dtype=torch.long, device=self.device), [plen] * bsz, pads, host_pads)
        dec = Decoding(settings, instruments, state)
        features = self._features(out)
        seen = []
        for b, pad in enumerate(host_pads):
            seen.append((features[b: b + 1, pad:], torch.cat([ids[b, pad + 1:], first[b: b + 1]])[None]))
        clock.mark("prefill")
        self._settle(dec, first[:, None], torch.ones_like(first), lambda b, a: seen[b])
        clock.mark("observe")
        return dec

    @torch.inference_mode()
    def step(self, dec: Decoding) -> list[Tensor]:
        """One speculative step for every live row: draft, one [B, N] verify, accept, emit and observe, compact
        the accepted paths; ``self.rollback`` is called before the draft and the verify and after the accept (a
        hybrid's recurrent states back to the accepted tokens). Returns each row's tokens emitted by this step
        (on the device; empty for a row that had stopped before it)."""
        state, clock, stats, live = dec.state, dec.instruments.clock, dec.stats, dec.live()
        before = self.rollback.before_draft(dec)
        drafts = self._draft(dec, live)
        clock.mark("draft")
        shared = self.drafter.entry_model is not None and all(drafts[b].entry is not None for b in live)
        verify = self.rollback.before_verify(dec, drafts, before)
        out = self._verify_rows(state.cache, verify.drafts, verify.starts, state.pads, stats, from_entry=shared)
        width = out.logits.shape[1]  # positions every row verified (its pending tokens, its draft, padding)
        out = _drop_front(out, verify.skip)  # the pending positions' outputs were read by the previous step
        features = self._features(out)
        stats.target_forwards, stats.steps = stats.target_forwards + 1, stats.steps + 1
        clock.mark("verify")
        nodes, new, length = accept_rows(out.logits, drafts, live, dec.settings.sampling, self.acceptance, self.typical)
        clock.mark("accept")
        roots = features[:, :1].clone()  # a row that kept its root alone: one copy for the batch, no gather
        emitted, accepted = self._settle(dec, new, length, lambda b, a: (
            roots[b: b + 1] if a == 1 else features[b: b + 1, nodes[b, :a]], new[b: b + 1, :a]))
        stats.step_tokens += sum(tokens.shape[0] for tokens in emitted)
        for b in live:  # vLLM's acceptance counts: the drafts each row's verify accepted, the bonus left out
            stats.count_draft(drafts[b].tokens.shape[0] - 1, accepted[b] - 1)
        clock.mark("observe")
        if max(accepted) > 1:  # a row that kept its root alone has it at its slot already: nothing to move
            state.cache.compact_rows(state.lengths, nodes[:, : max(accepted)])
        clock.mark("compact")
        self.rollback.after_accept(dec, verify, new, accepted, width)
        state.host_lengths = [n + a for n, a in zip(state.host_lengths, accepted)]
        state.lengths = torch.tensor(state.host_lengths, device=self.device)
        state.cache.length = max(state.host_lengths)
        return emitted

    def _draft(self, dec: Decoding, live: list[int]) -> list[Draft]:
        """Every row's draft (a finished row's: its root alone, a masked no-op never read), none deeper than
        its remaining budget - 1 (deeper drafts could never be emitted) or the plan's levels."""
        state, settings = dec.state, dec.settings
        drafts = [root_only(row.root) for row in state.rows]
        if settings.levels == 0:
            return drafts
        depths = [settings.max_new_tokens - state.rows[b].num_new - 1 for b in live]
        depths = depths if settings.levels is None else [min(d, settings.levels) for d in depths]
        if not self.compile:  # a drafter sharing the target's KV drafts into it (layer skip)
            self.drafter.before_draft(state.cache, state.host_lengths, state.host_pads)
        proposed = self.drafter.propose_rows([state.rows[b].draft for b in live], [state.rows[b].root for b in live],
                                             settings.sampling, depths)
        for b, draft in zip(live, proposed):
            drafts[b] = draft
            dec.stats.count_budget(draft.tokens.shape[0] - 1)
        return drafts

    def finish(self, dec: Decoding) -> Tensor:
        """``generate``'s output from a finished decode: (B, prompt_len + longest row's new tokens) on the
        prompt's device, a row padded with the pad id after its end; the call's stats into ``last_stats``."""
        settings, instruments, rows = dec.settings, dec.instruments, dec.state.rows
        if instruments.streamer is not None:
            instruments.streamer.end()
        new = torch.full((len(rows), max(row.num_new for row in rows)), settings.pad_id, dtype=settings.input_ids.dtype,
                         device=self.device)
        for b, row in enumerate(rows):
            new[b, : row.num_new] = torch.cat(row.emitted)
        dec.stats.new_tokens = sum(row.num_new for row in rows)
        dec.stats.wall_time = time.perf_counter() - instruments.started
        dec.stats.phase_times = instruments.clock.times
        self.last_stats = dec.stats
        return torch.cat([settings.input_ids, new.to(settings.input_ids.device)], dim=1)

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
        while not dec.finished:
            self.step(dec)
        return self.finish(dec)
