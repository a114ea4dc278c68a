"""Byte-level BPE tokenizer for the stdlib corpus, trained with Hugging Face `tokenizers`.

Owns tokenizer.json in the output folder it is given. Trained on the training files only (never the
held-out ones), deterministically: `tokenizers`' BPE trainer breaks ties by pair order, and the input
order is the sorted file list.

Form, chosen so that llama.cpp and sharpi load it from the GGUF metadata the converter writes:
- pre-tokenizer: ByteLevel with the GPT-2 regex (llama.cpp's "gpt-2" pre-tokenizer), no prefix space;
- one special token, `<|endoftext|>` (id 0): it separates files in the training stream and is both
  BOS and EOS. The post-processor prepends it to every encoded text, so a prompt reads like the start
  of a file, exactly as the model saw files during training; the converter turns that template into
  tokenizer.ggml.add_bos_token = true.
"""

from __future__ import annotations

from pathlib import Path

from corpus import SourceFile

EOT = "<|endoftext|>"
EOT_ID = 0


def train_tokenizer(train_files: list[SourceFile], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((f.text for f in train_files), trainer=trainer, length=len(train_files))
    if tokenizer.token_to_id(EOT) != EOT_ID:
        raise RuntimeError(f"{EOT} got id {tokenizer.token_to_id(EOT)}, expected {EOT_ID}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A $B:1", special_tokens=[(EOT, EOT_ID)]
    )
    return tokenizer


def load_tokenizer(folder: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def hf_tokenizer(tokenizer):
    """The same tokenizer as a transformers PreTrainedTokenizerFast, for save_pretrained."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOT, eos_token=EOT, unk_token=None, pad_token=None
    )


def encode_files(tokenizer, files: list[SourceFile]):
    """One token stream: <|endoftext|> before every file, then the file's tokens (uint16)."""
    import numpy as np

    encodings = tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    pieces = []
    for encoding in encodings:
        pieces.append(np.array([EOT_ID], dtype=np.uint16))
        pieces.append(np.asarray(encoding.ids, dtype=np.uint16))
    return np.concatenate(pieces)
