"""Bad model files get a clear, typed error naming the thing at fault — never a crash.

Each test derives a broken file from a valid tiny model with the gguf package (model_files.py);
file-format damage (bad magic, truncation, out-of-bounds data) is covered in test_gguf.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import sharpi
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from model_files import rewrite_gguf
from sharpi.make_model import write_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("errors") / "tiny.gguf")
    write_model(path, arch="qwen3moe", preset="tiny", quant="q8_0", seed=1)
    return path


def test_valid_file_loads(tiny):
    s = sharpi.Session(tiny, threads=1)
    assert s.info["arch"] == "qwen3moe"
    assert np.isfinite(s.decode([1, 2, 3])).all()


def test_unknown_architecture(tiny, tmp_path):
    bad = str(tmp_path / "arch.gguf")
    rewrite_gguf(tiny, bad, set_kv={"general.architecture": "mamba9"})
    with pytest.raises(sharpi.UnsupportedError, match=r"unknown architecture 'mamba9'.*qwen3moe") as error:
        sharpi.Session(bad)
    # The list names every supported architecture (the make-model ones and qwen3next's hybrid kin).
    for arch in ("llama", "qwen2moe", "qwen3moe", "olmoe", "qwen2", "qwen3", "deepseek2", "qwen3next",
                 "qwen35moe", "gpt-oss", "glm4moe", "llama4", "minimax-m2", "deepseek4",
                 "deepseek32", "nemotron_h_moe"):  # fmt: skip
        assert f"{arch}" in str(error.value).split("supported:")[1], arch


def test_missing_tensor(tiny, tmp_path):
    bad = str(tmp_path / "missing.gguf")
    rewrite_gguf(tiny, bad, drop_tensors=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(sharpi.MissingTensorError, match=r"missing tensor blk\.1\.ffn_up_exps\.weight"):
        sharpi.Session(bad)


def test_missing_metadata_key(tiny, tmp_path):
    bad = str(tmp_path / "nokey.gguf")
    rewrite_gguf(tiny, bad, drop_kv=("qwen3moe.embedding_length",))
    with pytest.raises(sharpi.MissingTensorError, match="qwen3moe.embedding_length"):
        sharpi.Session(bad)


def test_wrong_tensor_shape(tiny, tmp_path):
    bad = str(tmp_path / "shape.gguf")

    def edit(name, raw, ttype, shape):
        if name == "blk.0.ffn_gate_inp.weight":  # router [n_embd, n_expert] -> [n_embd, n_expert - 1]
            row = raw.size // shape[1]
            return raw[: row * (shape[1] - 1)], ttype, [shape[0], shape[1] - 1]
        return None

    rewrite_gguf(tiny, bad, tensor_edit=edit)
    with pytest.raises(sharpi.FormatError, match=r"blk\.0\.ffn_gate_inp\.weight has shape \[256, 7\], expected \[256, 8\]"):
        sharpi.Session(bad)


def test_unsupported_quant_type(tiny, tmp_path):
    bad = str(tmp_path / "tq2.gguf")

    def edit(name, raw, ttype, shape):
        if name == "blk.0.attn_q.weight":  # same element count, stored as TQ2_0 (no sharpi kernel)
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType.TQ2_0]
            n_blocks = int(np.prod(shape)) // block
            return np.zeros(n_blocks * size, dtype=np.uint8), GGMLQuantizationType.TQ2_0, shape
        return None

    rewrite_gguf(tiny, bad, tensor_edit=edit)
    with pytest.raises(sharpi.UnsupportedError, match=r"blk\.0\.attn_q\.weight has type tq2_0"):
        sharpi.Session(bad)


def test_unsupported_rope_scaling(tiny, tmp_path):
    bad = str(tmp_path / "rope.gguf")
    rewrite_gguf(tiny, bad, set_kv={"qwen3moe.rope.scaling.type": "su", "qwen3moe.rope.scaling.factor": 4.0})
    with pytest.raises(sharpi.UnsupportedError, match="rope scaling type 'su'"):
        sharpi.Session(bad)


def test_inconsistent_expert_count(tiny, tmp_path):
    bad = str(tmp_path / "topk.gguf")
    rewrite_gguf(tiny, bad, set_kv={"qwen3moe.expert_used_count": 99})
    with pytest.raises(sharpi.FormatError, match="expert_used_count 99"):
        sharpi.Session(bad)


def test_missing_file():
    with pytest.raises(sharpi.IoError, match="no-such-model.gguf"):
        sharpi.Session("/nonexistent/no-such-model.gguf")


@pytest.fixture(scope="module")
def tiny_deepseek2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("errors") / "tiny-deepseek2.gguf")
    write_model(path, arch="deepseek2", preset="tiny", quant="f32", seed=1)
    return path


def test_deepseek2_old_conversion_without_split_kv_b(tiny_deepseek2, tmp_path):
    # Files from before the converter split attn_kv_b into attn_k_b / attn_v_b.
    bad = str(tmp_path / "kv_b.gguf")
    kv_b = np.zeros((4 * (64 + 64), 256), dtype=np.float32)  # numpy [n_head * (qk_nope + v_head), kv_lora]
    rewrite_gguf(tiny_deepseek2, bad, drop_tensors=("blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"),
                 add_tensors={"blk.0.attn_kv_b.weight": kv_b})  # fmt: skip
    with pytest.raises(sharpi.UnsupportedError, match=r"attn_kv_b.* re-convert"):
        sharpi.Session(bad)


@pytest.mark.parametrize(
    "kv, match",
    [
        ({"deepseek2.expert_gating_func": 5}, r"expert_gating_func 5 is not supported"),
        ({"deepseek2.expert_group_count": 3}, r"expert groups: 3 groups"),
        ({"deepseek2.attention.value_length": 100}, r"inconsistent MLA hyper-parameters"),
        ({"deepseek2.leading_dense_block_count": 9}, r"leading_dense_block_count 9 > block_count"),
    ],
)
def test_deepseek2_bad_metadata(tiny_deepseek2, tmp_path, kv, match):
    bad = str(tmp_path / "bad.gguf")
    rewrite_gguf(tiny_deepseek2, bad, set_kv=kv)
    with pytest.raises((sharpi.UnsupportedError, sharpi.FormatError), match=match):
        sharpi.Session(bad)
