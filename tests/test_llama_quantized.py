"""Files quantized by llama.cpp's own tools to the IQ types (issue 19): a tiny random Hugging Face
Qwen3 MoE (tests/reference/hf_export.py, every row 256 wide so that each matrix can take a K or IQ
type), converted to f16 by llama.cpp's converter, an importance matrix made by llama-imatrix on real
text (a Python standard-library source file; IQ1_*, IQ2_* and IQ3_XXS refuse to quantize without
one), then quantized by llama-quantize to each IQ type and to one mixed recipe (IQ2/IQ3 experts,
Q4_K/Q6_K dense parts, a type that changes from layer to layer).

Each file: the gguf reader sees the types the recipe promises (so no test passes on a file that
holds something else), sharpi in exact mode decodes within 1e-4 of the float64 numpy reference on
the same file's weights dequantized by the gguf package, and it streams bit-identically to resident
at a quarter budget, in the fast and the exact mode.

The tools come from tools/build_llama_tools.sh (built once, cached outside the checkout). Without
the tools, the converter, torch or transformers every test skips with the reason, except under
SHARPI_REQUIRE_ALL=1 (CI, tests/ci_policy.py), where a missing one fails them: there the module
would otherwise pass vacuously.
"""

import subprocess
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
import sharpi
from ci_policy import prerequisite_missing, require_module
from reference import hf_export
from reference.engine_checks import (
    check_greedy,
    check_prefill_and_stepwise,
    check_streams_like_resident,
    session_opener,
)
from reference.numpy_forward import ReferenceModel, forward

QT = gguf.GGMLQuantizationType
BUILD_SCRIPT = hf_export.REPO_ROOT / "tools" / "build_llama_tools.sh"
MODEL = "qwen3moe_256"
BUDGET = 1e-4  # exact mode: f32 vs float64 arithmetic on identical weights (test_model_vs_reference)
THREADS = 2

# The IQ type under test -> the llama-quantize file type whose recipe puts it on the expert gate and
# up matrices (llama-quantize's "IQ2_S" recipe uses IQ2_XS there; its "IQ2_M" uses IQ2_S).
FTYPE_FOR = {
    "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_XS",
    "IQ3_S": "IQ3_S",
    "IQ3_XXS": "IQ3_XXS",
    "IQ2_S": "IQ2_M",
    "IQ2_XS": "IQ2_XS",
    "IQ2_XXS": "IQ2_XXS",
    "IQ1_S": "IQ1_S",
    "IQ1_M": "IQ1_M",
}
# A dynamic mix as the 1.5-3 bit MoE files on the Hub are made: IQ2_XXS experts with IQ3_XXS down
# projections and one layer's gate in IQ2_S, attention in Q4_K with attn_v and the output in Q6_K.
# llama-quantize applies the first --tensor-type pattern that matches a tensor's name.
MIX = "mix"
MIX_ARGS = [
    "--tensor-type", r"blk\.1\.ffn_gate_exps=iq2_s",
    "--tensor-type", "ffn_down_exps=iq3_xxs",
    "--tensor-type", "attn_v=q6_k",
    "--tensor-type", "attn_=q4_k",
    "--output-tensor-type", "q6_k",
    "--token-embedding-type", "q4_k",
]  # fmt: skip
MIX_TYPES = {  # role -> {layer: type} (None: every layer)
    "ffn_gate_exps": {0: QT.IQ2_XXS, 1: QT.IQ2_S},
    "ffn_up_exps": {None: QT.IQ2_XXS},
    "ffn_down_exps": {None: QT.IQ3_XXS},
    "attn_v": {None: QT.Q6_K},
    "attn_q": {None: QT.Q4_K},
    "attn_k": {None: QT.Q4_K},
    "attn_output": {None: QT.Q4_K},
}
RECIPES = [*FTYPE_FOR, MIX]

# Importance-matrix text: 4 chunks of 128 tokens of a standard-library source file.
IMATRIX_CTX = 128
IMATRIX_CHUNKS = 4


@pytest.fixture(scope="module", autouse=True)
def _oracle_modules() -> None:
    """The HF export needs torch and transformers: checked before any other fixture of the module
    runs, in a fixture rather than at import so that a failure under SHARPI_REQUIRE_ALL=1 fails
    these tests instead of aborting the collection of the whole suite."""
    require_module("torch")
    require_module("transformers", minversion="5.0")


def _run(command: list, what: str, timeout: int) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise AssertionError(
            f"{what} failed (rc {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return done


@pytest.fixture(scope="module")
def llama_tools() -> Path:
    """The directory holding llama-quantize and llama-imatrix (built on first use, ~minutes)."""
    try:
        done = subprocess.run(
            ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=5400, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        prerequisite_missing(f"tools/build_llama_tools.sh failed: {error}")
    lines = done.stdout.strip().splitlines()
    bin_dir = Path(lines[-1]) if lines else None
    if done.returncode != 0 or bin_dir is None or not (bin_dir / "llama-quantize").is_file():
        prerequisite_missing(f"tools/build_llama_tools.sh failed (rc {done.returncode}): {done.stderr[-3000:]}")
    return bin_dir


@pytest.fixture(scope="module")
def f16_file(model_dir) -> Path:
    try:
        converter = hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        prerequisite_missing(f"llama.cpp converter unavailable: {error}")
    return hf_export.prepare(MODEL, model_dir, converter, outtypes=("f16",)).gguf["f16"]


@pytest.fixture(scope="module")
def imatrix(llama_tools, f16_file) -> Path:
    text = f16_file.parent / "imatrix-text.txt"
    text.write_text(Path(textwrap.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    out = f16_file.parent / "imatrix.gguf"
    if not out.is_file():
        _run(
            [llama_tools / "llama-imatrix", "-m", f16_file, "-f", text, "-o", out, "-c", IMATRIX_CTX,
             "-b", IMATRIX_CTX, "--chunks", IMATRIX_CHUNKS, "-t", THREADS, "--no-ppl"],
            "llama-imatrix", timeout=900,
        )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def quantized(llama_tools, f16_file, imatrix):
    files = {}

    def get(recipe: str) -> str:
        if recipe not in files:
            out = f16_file.parent / f"{MODEL}-{recipe.lower()}.gguf"
            ftype, extra = (FTYPE_FOR[recipe], []) if recipe in FTYPE_FOR else ("IQ2_XXS", MIX_ARGS)
            _run(
                [llama_tools / "llama-quantize", "--imatrix", imatrix, *extra, f16_file, out, ftype, THREADS],
                f"llama-quantize {recipe}",
                timeout=900,
            )
            files[recipe] = str(out)
        return files[recipe]

    return get


def _types_and_shapes(path) -> dict:
    """name -> (type, ggml shape)"""
    return {
        t.name: (QT(int(t.tensor_type)), [int(n) for n in t.shape]) for t in gguf.GGUFReader(path).tensors
    }


def _types(path) -> dict:
    return {name: qtype for name, (qtype, _) in _types_and_shapes(path).items()}


def test_imatrix_has_every_expert_of_every_layer(imatrix):
    # llama-quantize uses an expert's slice of the matrix only if the text routed tokens to it.
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(imatrix)).tensors}
    for il in range(2):
        for role in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            counts = tensors[f"blk.{il}.{role}.weight.counts"].reshape(-1)
            assert counts.size == 8 and (counts > 0).all(), (il, role, counts)


@pytest.mark.parametrize("recipe", RECIPES)
def test_file_holds_the_recipe_types(quantized, recipe):
    types = _types(quantized(recipe))
    where = f"{recipe}: {sorted((n, t.name) for n, t in types.items())}"
    assert types["blk.0.ffn_gate_inp.weight"] == QT.F32, where  # routers stay f32
    if recipe in FTYPE_FOR:
        for role in ("ffn_gate_exps", "ffn_up_exps"):
            assert {t for n, t in types.items() if f".{role}." in n} == {QT[recipe]}, where
        return
    for role, per_layer in MIX_TYPES.items():
        for il in range(2):
            want = per_layer.get(il, per_layer.get(None))
            assert types[f"blk.{il}.{role}.weight"] == want, (il, role, where)
    assert types["output.weight"] == QT.Q6_K and types["token_embd.weight"] == QT.Q4_K, where


@pytest.mark.parametrize("recipe", RECIPES)
def test_exact_mode_matches_reference(quantized, recipe):
    path = quantized(recipe)
    ref = ReferenceModel(path)
    hp = ref.hparams
    prompt = hf_export.random_prompt(hp.n_vocab, 12, seed=19)

    def open_session(dump_activations):
        return sharpi.Session(path, threads=THREADS, n_ctx=0, exact=True, dump_activations=dump_activations)

    what = f"{recipe} (llama-quantize) vs reference"
    check_prefill_and_stepwise(open_session, prompt, forward(ref, prompt), BUDGET, what, hp.n_expert_used)
    check_greedy(
        open_session, prompt, lambda tokens: forward(ref, tokens), 16, BUDGET, what, hp.n_expert_used
    )


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("recipe", RECIPES)
def test_streams_bit_identically_at_a_quarter_budget(quantized, recipe, exact):
    path = quantized(recipe)

    open_session = session_opener(path, threads=THREADS, n_ctx=128, exact=exact)

    n_vocab = int(_types_and_shapes(path)["token_embd.weight"][1][1])
    prompt = hf_export.random_prompt(n_vocab, 20, seed=25)
    check_streams_like_resident(open_session, prompt, 24, f"{recipe} exact={exact}")
