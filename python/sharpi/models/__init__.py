"""Models shipped inside the sharpi package.

stdlib-moe-q8_0.gguf: a small qwen3moe model (6 layers, 16 experts, top-2, 16 M parameters) trained
by the project on the Python standard library's sources; see MODEL_CARD.md beside this file for the
corpus, license, training command and measured quality. It is the default model of `sharpi run` and
the test bed for expert predictors (its routing is real, unlike a random-weight model's).
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_NAME = "stdlib-moe-q8_0.gguf"
# Its multi-token-prediction head, trained on the same corpus (tools/train_moe/train_mtp.py), as a
# file holding only the block: `sharpi run --spec-type draft-mtp` uses it for the default model.
DEFAULT_MTP_NAME = "stdlib-moe-mtp-q8_0.gguf"


def default_model_path() -> str:
    """Path of the shipped default model; raises FileNotFoundError naming it if the install lacks it."""
    path = MODELS_DIR / DEFAULT_MODEL_NAME
    if not path.is_file():
        raise FileNotFoundError(f"shipped model {path} is missing from this installation")
    return str(path)


def default_mtp_path() -> str:
    """Path of the shipped model's MTP head (FileNotFoundError naming it if the install lacks it)."""
    path = MODELS_DIR / DEFAULT_MTP_NAME
    if not path.is_file():
        raise FileNotFoundError(f"shipped MTP head {path} is missing from this installation")
    return str(path)
