"""Runs llama.cpp's convert_hf_to_gguf.py unchanged, with one lookup taught about our tokenizer.

Usage (export.py builds this command and runs it in its own interpreter):
    python convert_wrapper.py CONVERTER_DIR MODEL_DIR --outfile OUT.gguf --outtype q8_0 [...]

It owns nothing and writes only what the converter writes. It must run in a separate process with
the downloaded gguf-py first on sys.path (that gguf-py belongs to the converter and may differ from
the installed gguf package), and it never edits the converter's files.

The one change: the converter names a BPE pre-tokenizer by hashing how the tokenizer splits a fixed
test string and refuses hashes it has no entry for; a tokenizer trained here has new merges and so a
new hash. Its pre-tokenizer, though, is exactly GPT-2's (tokenizers' ByteLevel with use_regex=True,
no prefix space), which llama.cpp implements under the name "gpt-2". The patched lookup answers
"gpt-2" only after checking that configuration in tokenizer.json, and only when the converter's own
table has no answer; anything else still fails the way the converter fails.
"""

import json
import logging
import sys
from pathlib import Path


def is_gpt2_byte_level(model_dir: Path) -> bool:
    config = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    pre = config.get("pre_tokenizer") or {}
    return (
        config.get("model", {}).get("type") == "BPE"
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True) is True
        and pre.get("add_prefix_space", False) is False
        and (config.get("normalizer") is None)
    )


def main() -> None:
    converter_dir = Path(sys.argv[1]).resolve()
    model_dir = Path(sys.argv[2]).resolve()
    sys.path.insert(0, str(converter_dir / "gguf-py"))
    sys.path.insert(0, str(converter_dir))

    import convert_hf_to_gguf
    from conversion.base import TextModel

    original_lookup = TextModel.get_vocab_base_pre
    gpt2_pre = is_gpt2_byte_level(model_dir)

    def lookup(self, tokenizer) -> str:
        try:
            return original_lookup(self, tokenizer)
        except NotImplementedError:
            if not gpt2_pre:
                raise
            logging.getLogger("train_moe.convert").info(
                "tokenizer hash unknown to the converter; its pre-tokenizer is GPT-2's ByteLevel regex: 'gpt-2'"
            )
            return "gpt-2"

    TextModel.get_vocab_base_pre = lookup
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), *sys.argv[3:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
