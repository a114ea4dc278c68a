"""The tokenizer of sharpi.make_model's synthetic models: a byte-level BPE trained on real text.

What it owns: training (once per size, cached under ~/.cache/sharpi/tokenizers or
$SHARPI_CACHE_DIR, written atomically) a byte-level BPE ("gpt2" model; pre-tokenizer "gpt-2",
llama.cpp's name for the regex the `tokenizers` ByteLevel pre-tokenizer implements) on Python
standard-library sources, at most 8192 learned tokens; then the GGUF tokenizer metadata of a
vocabulary of exactly n_vocab entries: the learned tokens, the special tokens <|endoftext|> (bos,
padding), <|im_start|>, <|im_end|> (eos), optionally the fill-in-the-middle tokens <|fim_prefix|>,
<|fim_suffix|>, <|fim_middle|>, then "[PAD<id>]" tokens of type UNUSED (as
convert_hf_to_gguf.py pads), with a ChatML chat template. It reads the standard library and its
cache only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Fill-in-the-middle control tokens (make-model --fim), spelled as Qwen2.5-Coder and Qwen3 spell them.
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
MAX_TRAINED_VOCAB = 8192
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5  # gguf.TokenType


def _corpus() -> list[str]:
    """~3 MB of real text available offline: the Python standard library's own sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for f in sorted(stdlib.glob("*.py")):
        texts.append(f.read_text(encoding="utf-8", errors="replace"))
        total += len(texts[-1])
        if total > 3_000_000:
            break
    if total < 100_000:
        raise RuntimeError(f"cannot find Python standard-library sources under {stdlib} to train a tokenizer")
    return texts


def _cache_dir() -> Path:
    base = os.environ.get("SHARPI_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sharpi")
    return Path(base) / "tokenizers"


def trained_tokenizer(n_trained: int):
    """A byte-level BPE `tokenizers.Tokenizer` with n_trained tokens (256 bytes + merges), no specials.
    Cached on disk keyed by size and corpus hash, written atomically (safe under parallel tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = _corpus()
    digest = hashlib.sha1("".join(texts).encode("utf-8", errors="replace")).hexdigest()[:12]
    path = _cache_dir() / f"bpe-{n_trained}-{digest}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_trained, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, path)
    except OSError:
        pass  # read-only home: no cache, training is only a second or two
    return tok


def tokenizer_metadata(n_vocab: int, fim: bool = False) -> dict:
    """tokens, token types, merges and special ids for a vocabulary of exactly n_vocab entries;
    fim: FIM_TOKENS follow the special tokens, their ids under "fim_ids" (prefix, suffix, middle)."""
    specials = SPECIAL_TOKENS + (FIM_TOKENS if fim else [])
    n_trained = min(n_vocab - len(specials), MAX_TRAINED_VOCAB)
    tok = trained_tokenizer(n_trained)
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id))), "trained vocabulary ids are not dense"
    tokens = [t for t, _ in by_id]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [TOKEN_NORMAL] * len(tokens)
    first_special = len(tokens)
    tokens += specials
    types += [TOKEN_CONTROL] * len(specials)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [TOKEN_UNUSED] * (n_vocab - len(types))
    return {
        "tokens": tokens,
        "token_type": types,
        "merges": merges,
        "n_trained": len(by_id),
        "bos_token_id": first_special,
        "padding_token_id": first_special,
        "eos_token_id": first_special + 2,
        "chat_template": CHAT_TEMPLATE,
        "fim_ids": tuple(range(first_special + len(SPECIAL_TOKENS), first_special + len(specials))) or None,
    }
