"""Runs llama.cpp's convert_hf_to_gguf.py as a library, in its own process.

Usage (hf_export.convert() builds this command line):
    python convert_driver.py CONVERTER_DIR MODEL_DIR --outfile OUT.gguf --outtype f32

It owns nothing and writes only what the converter writes. It must run in a separate interpreter
with the downloaded gguf-py first on sys.path, because that gguf-py may be newer than the installed
gguf package the rest of the test-suite uses; never import it into the pytest process.

The patches: the converter identifies a BPE pre-tokenizer by hashing how it splits a fixed test
string and refuses tokenizers it has no entry for. The test tokenizers are byte-level BPEs with the
GPT-2 pre-tokenizer regex, i.e. llama.cpp's "gpt-2" pre-tokenizer, so an unknown hash is mapped to
that name here, in memory. And DeepSeek-V3.2's set_vocab asserts tokenizer.add_bos_token, which
transformers 5 no longer reads from a tokenizer.json-backed tokenizer's config (it drops the key);
a tokenizer whose encodings do start with its BOS token (the test tokenizer's post-processor adds
it) reports add_bos_token true here. The converter's files on disk are never modified.
"""

import logging
import sys
from pathlib import Path


def main() -> None:
    converter_dir = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(converter_dir / "gguf-py"))
    sys.path.insert(0, str(converter_dir))

    import convert_hf_to_gguf
    from conversion.base import TextModel

    original_lookup = TextModel.get_vocab_base_pre

    def lookup_with_test_tokenizer(self, tokenizer) -> str:
        try:
            return original_lookup(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("sharpi-convert").info("unknown pre-tokenizer hash: using 'gpt-2'")
            return "gpt-2"

    TextModel.get_vocab_base_pre = lookup_with_test_tokenizer

    import transformers

    original_from_pretrained = transformers.AutoTokenizer.from_pretrained

    def from_pretrained_reporting_bos(*args, **kwargs):
        tokenizer = original_from_pretrained(*args, **kwargs)
        bos = tokenizer.bos_token_id
        if not getattr(tokenizer, "add_bos_token", False) and bos is not None and tokenizer("a").input_ids[:1] == [bos]:
            tokenizer.add_bos_token = True
        return tokenizer

    transformers.AutoTokenizer.from_pretrained = from_pretrained_reporting_bos
    sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
