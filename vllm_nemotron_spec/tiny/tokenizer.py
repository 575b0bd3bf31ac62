"""The tiny family's byte-level BPE tokenizer, trained locally on the synthetic corpus.

Its layout mirrors Nemotron's (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, then more special tokens, the
chat tokens as single tokens, reserved tokens up to exactly ``vocab_size``; see
:func:`train_tokenizer`), so vLLM's parsers and the drafts' ``mask_token_id`` work on it as on the
real model. Files written: ``tokenizer.json`` and ``tokenizer_config.json``
(``PreTrainedTokenizerFast``), loadable by ``transformers.AutoTokenizer`` and by vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

UNK, BOS, EOS, PAD, MASK = "<unk>", "<s>", "</s>", "<pad>", "<mask>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, MASK)
UNK_ID, BOS_ID, EOS_ID, PAD_ID, MASK_ID = range(5)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
CHAT_TOKENS = (IM_START, IM_END, THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END)
"""Added after the BPE merges; ``<|im_start|>`` / ``<|im_end|>`` are special (dropped when
decoding with ``skip_special_tokens``), the reasoning and tool-call markers are not (they stay in
the text the parsers read), as in Nemotron 3 and Qwen3."""

CHAT_TEMPLATE = (
    # Nemotron 3's ChatML layout, shortened (the tiny models are not chat-tuned; the template lets
    # vLLM's chat endpoint, its tool parser and its reasoning parser run as for Nemotron 3.5):
    # tools listed in the system turn with the XML call format the qwen3_coder parser reads;
    # assistant turns as <think>reasoning</think>content and <tool_call> blocks; tool results in
    # a user turn; the generation prompt opens <think> (or closes it at once when
    # enable_thinking is false).
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set ns.system = messages[0]['content'] %}{%- endif %}"
    "{%- if ns.system or tools %}"
    "{{- '<|im_start|>system\n' + ns.system }}"
    "{%- if tools %}"
    "{{- '\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool['function'] if 'function' in tool else tool) | tojson }}"
    "{%- endfor %}"
    "{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format:"
    "\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1"
    "\n</parameter>\n</function>\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\n<think>' + (message.get('reasoning_content') or "
    "message.get('reasoning') or '') + '</think>' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set fn = call['function'] if 'function' in call else call %}"
    "{{- '\n<tool_call>\n<function=' + fn['name'] + '>\n' }}"
    "{%- if fn['arguments'] is mapping %}{%- for name, value in fn['arguments'].items() %}"
    "{{- '<parameter=' + name + '>\n' + (value if value is string else value | tojson) "
    "+ '\n</parameter>\n' }}"
    "{%- endfor %}{%- else %}{{- fn['arguments'] + '\n' }}{%- endif %}"
    "{{- '</function>\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response>"
    "<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think></think>' }}"
    "{%- else %}{{- '<think>\n' }}{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class TokenizerParams:
    vocab_size: int = 1024
    min_frequency: int = 2
    model_max_length: int = 4096

    def __post_init__(self):
        if self.vocab_size % 16:
            raise ValueError(f"vocab_size must be a multiple of 16, got {self.vocab_size}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size must hold the 256 byte symbols and {len(SPECIAL_TOKENS)} special "
                f"tokens, got {self.vocab_size}"
            )


def train_tokenizer(documents: Sequence[str], params: TokenizerParams = TokenizerParams()):
    """Train the byte-level BPE tokenizer on ``documents``; returns a ``tokenizers.Tokenizer``
    with exactly ``params.vocab_size`` tokens and the special tokens at these ids:

    ====  ==========  =====================================================================
    id    token       use
    ====  ==========  =====================================================================
    0     ``<unk>``   unknown (never produced by the byte-level model)
    1     ``<s>``     BOS, added in front of every encoded text by the post-processor
    2     ``</s>``    EOS, ends every training document
    3     ``<pad>``   padding
    4     ``<mask>``  the drafts' ``mask_token_id`` (DFlash / DSpark query-block filler)
    ====  ==========  =====================================================================

    The rest is the 256 byte symbols plus BPE merges learned from the corpus, then the chat
    tokens (:data:`CHAT_TOKENS`: ``<|im_start|>``, ``<|im_end|>``, ``<think>``, ``</think>``,
    ``<tool_call>``, ``</tool_call>``, single tokens as in Nemotron 3's tokenizer, so vLLM's
    ``nemotron_v3`` reasoning parser and ``qwen3_coder`` tool parser find them by id); if the
    corpus yields fewer merges than needed, ``<reserved_k>`` special tokens fill the vocabulary up
    to exactly ``vocab_size`` (like Nemotron's reserved ``<SPECIAL_k>`` tokens). The chat tokens
    never occur in the corpus, so the models' training data is the same with or without them.
    Digits are split one per token (as in Nemotron / Llama 3)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=params.vocab_size - len(CHAT_TOKENS),  # room for the chat tokens
        min_frequency=params.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(documents), trainer=trainer, length=len(documents))
    tok.add_tokens(
        [AddedToken(t, special=t in (IM_START, IM_END), normalized=False) for t in CHAT_TOKENS]
    )
    # Fill up to exactly vocab_size with reserved special tokens (ids continue after the merges).
    missing = params.vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing < 0:
        raise RuntimeError(
            f"BPE training produced {params.vocab_size - missing} tokens, more than vocab_size "
            f"{params.vocab_size}"
        )
    if missing:
        tok.add_special_tokens([f"<reserved_{k}>" for k in range(missing)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    _check_layout(tok, params.vocab_size)
    return tok


def _check_layout(tok, vocab_size: int) -> None:
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise RuntimeError(f"tokenizer has {size} tokens, expected exactly {vocab_size}")
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        found = tok.token_to_id(token)
        if found != expected_id:
            raise RuntimeError(f"special token {token!r} has id {found}, expected {expected_id}")


def tokenizer_config(params: TokenizerParams = TokenizerParams()) -> dict:
    """``tokenizer_config.json`` for ``PreTrainedTokenizerFast`` (AutoTokenizer and vLLM)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "mask_token": MASK,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": params.model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok, outdir: str | Path, params: TokenizerParams = TokenizerParams()) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    # Tokenizer.to_str() is deterministic for a given tokenizer; write bytes ourselves so the
    # file does not depend on anything but the trained model.
    (outdir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(outdir / "tokenizer_config.json", tokenizer_config(params))
    _write_json(
        outdir / "special_tokens_map.json",
        {
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": UNK,
            "mask_token": MASK,
        },
    )


def copy_tokenizer(src_dir: str | Path, dst_dir: str | Path) -> None:
    """Copy the tokenizer files of one model directory into another."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = src_dir / name
        if not src.is_file():
            raise FileNotFoundError(f"tokenizer file {name} missing in {src_dir}")
        (dst_dir / name).write_bytes(src.read_bytes())


def load_tokenizer(model_dir: str | Path):
    """The ``tokenizers.Tokenizer`` saved in ``model_dir`` (no transformers needed)."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
    return Tokenizer.from_file(str(path))


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
