"""Byte-level BPE tokenizer for the demo target, with a ChatML-like chat template.

Byte-level BPE never maps anything to an unknown token and keeps every space, tab and newline,
so Python indentation round-trips exactly: ``decode(encode(x)) == x``. No special token is added
automatically (like GPT-2/Qwen): BOS is defined but never inserted by ``encode``.

The chat template wraps each assistant reply *and its* ``<|im_end|>`` in
``{% generation %}...{% endgeneration %}``, so
``apply_chat_template(..., return_dict=True, return_assistant_tokens_mask=True)`` marks exactly
the tokens a draft head should learn to predict, including the turn's end.
"""
from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Order fixes the ids: pad=0, bos=1, eos=2, im_start=3, im_end=4 (the test fixtures' convention).
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens (specials included) on ``texts``."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + specials), got {vocab_size}")
    # add_prefix_space=False: a leading space would be invented on decode and break round-trips.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        # The default clean-up rewrites " ." and " 's", which corrupts code.
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
