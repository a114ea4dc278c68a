"""The file's multi-token-prediction block (Session(mtp=True), Session.draft_mtp, --spec-type draft-mtp)
on qwen35moe, qwen3next, glm4moe, deepseek32, deepseek4 and nemotron_h_moe files (deepseek32's block
is dense MLA, as llama.cpp runs it: the trunk selects with its indexer, the block does not;
deepseek4's takes and returns all hyper-connection streams; nemotron_h_moe's holds attention and MoE
and norms its head with a LayerNorm).

Oracle: tests/reference/numpy_forward.mtp_forward, a float64 numpy model of the block as DeepSeek-V3
and Qwen3.5 define it (the trunk's output-normed hidden state and the next token's embedding, each
normed, concatenated and projected, one full-attention decoder block over the pairs at positions
1.., the shared head norm and lm_head), on the dequantized weights of the same file, sharpi in exact
mode. The trunk's hidden rows come from the numpy reference forward too, so every pair sharpi
keeps in its MTP KV cache (written step by step, across rollbacks) is checked against one
recomputation from scratch. deepseek4's oracle is tests/reference/deepseek4_numpy.py's mtp (llama.cpp's
deepseek4 graph_mtp: per stream eh_proj of [enorm(embed) | hnorm(stream)] of the trunk's raw last
layer streams, the hyper-connected layer, the block file's hc head, shared_head_norm, lm_head).
Speculation with the block is checked as every draft source is: the output of plain decoding, token
for token and logits bit for bit.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import sharpi
from gguf import GGUFReader
from model_files import rewrite_gguf
from reference.deepseek4_numpy import Deepseek4Reference
from reference.numpy_forward import ReferenceModel, forward, mtp_forward
from sharpi.make_model import write_model
from sharpi.speculative import MtpDraft, Speculation, open_speculation

ARCHS = ["qwen35moe", "qwen3next", "glm4moe", "deepseek32", "deepseek4", "nemotron_h_moe"]
BUDGET = 1e-4  # relative L2, exact mode, same dequantized weights


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp_models")
    out = {}
    for arch in ARCHS:
        for quant in ("f32", "q8_0", "q4_k_m"):
            path = str(d / f"{arch}-mtp-{quant}.gguf")
            write_model(path, arch=arch, preset="tiny", quant=quant, seed=21, n_layer_nextn=1)
            out[arch, quant] = path
    out["plain"] = str(d / "qwen35moe-plain.gguf")
    write_model(out["plain"], arch="qwen35moe", preset="tiny", quant="f32", seed=21)
    return out


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class Deepseek4Mtp:
    """deepseek4's references: the trunk's, and the block's (a --mtp sidecar's, else the same file)."""

    def __init__(self, trunk, block=None):
        self.trunk = Deepseek4Reference(trunk)
        self.block = Deepseek4Reference(block) if block else self.trunk


def make_reference(path, block=None):
    arch = GGUFReader(path).fields["general.architecture"].contents()
    return Deepseek4Mtp(path, block) if arch == "deepseek4" else ReferenceModel(path)


def reference_drafts(ref, tokens: list, next_token: int, drafted: list) -> list:
    """The block's logits at each draft position for the sequence `tokens`, `next_token` after it
    and the chain fed with `drafted` (sharpi's own drafts), recomputed from scratch each time."""
    if isinstance(ref, Deepseek4Mtp):
        hidden, block = ref.trunk.streams(tokens), ref.block.mtp
    else:
        hidden = forward(ref, tokens).intermediates["result_norm"]
        def block(h, t):
            return mtp_forward(ref, h, t)
    pair_tokens = list(tokens[1:]) + [next_token]
    out = []
    for i in range(len(drafted)):
        logits, h_out = block(hidden, pair_tokens)
        out.append(logits[-1])
        hidden = np.concatenate([hidden, h_out[-1:]])
        pair_tokens.append(drafted[i])
    return out


def check_drafts(session, ref, tokens, next_token, n, what):
    drafted, logits = session.draft_mtp(next_token, n, with_logits=True)
    assert len(drafted) == n and logits.shape == (n, session.info["n_vocab"]), what
    want = reference_drafts(ref, tokens, next_token, drafted)
    for i in range(n):
        err = rel(logits[i], want[i])
        assert err <= BUDGET, f"{what}: draft position {i} logits rel-L2 {err:.2e}"
        top2 = np.sort(want[i])[-2:]
        if top2[1] - top2[0] > 1e-3:  # a clear winner: the draft is the reference's argmax
            assert drafted[i] == int(np.argmax(want[i])), f"{what}: draft position {i}"
    return drafted


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_k_m"])
def test_the_block_matches_the_float64_reference(files, arch, quant):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    path = files[arch, quant]
    ref = make_reference(path)
    s = sharpi.Session(path, threads=2, exact=True, mtp=True, max_draft_tokens=4)
    n_vocab = s.info["n_vocab"]
    prompt = [int(t) for t in rng.integers(0, n_vocab, 11)]
    # Steps of several shapes: a prefill chunk, two tokens, single tokens.
    s.decode(prompt[:6])
    s.decode(prompt[6:8])
    for t in prompt[8:]:
        s.decode([t])
    x = int(rng.integers(0, n_vocab))
    what = f"{arch} {quant} seed {seed}"
    check_drafts(s, ref, prompt, x, 3, what)
    # Drafting leaves the sequence as it was: the trunk goes on, and so do the pairs.
    y = int(rng.integers(0, n_vocab))
    s.decode([x])
    check_drafts(s, ref, prompt + [x], y, 2, what + " (after one more token)")


@pytest.mark.parametrize("arch", ARCHS)
def test_pairs_are_right_after_a_rejected_draft_and_a_far_truncate(files, arch):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    path = files[arch, "f32"]
    ref = make_reference(path)
    s = sharpi.Session(path, threads=2, exact=True, mtp=True, max_draft_tokens=4)
    n_vocab = s.info["n_vocab"]
    def ids(n):
        return [int(t) for t in rng.integers(0, n_vocab, n)]

    prompt, step, after = ids(8), ids(4), ids(3)
    s.decode(prompt)
    s.decode(step, all_logits=True, rewindable=True)  # a verify step: x and three drafts
    s.truncate(len(prompt) + 2)  # two of them kept
    s.decode(after[:1])
    kept = prompt + step[:2] + after[:1]
    check_drafts(s, ref, kept, after[1], 2, f"{arch} after a rejected draft, seed {seed}")


@pytest.mark.parametrize("arch", ["qwen35moe", "deepseek4"])
def test_a_forked_sequence_drafts_from_its_parents_pairs(files, arch):
    path = files[arch, "f32"]
    ref = make_reference(path)
    s = sharpi.Session(path, threads=2, exact=True, mtp=True, n_seq=2)
    prompt = [int(t) for t in np.random.default_rng(secrets.randbits(32)).integers(0, 1000, 9)]
    s.decode(prompt)
    child = s.sequence(0).fork()  # a hybrid forks whole
    drafted, logits = s.draft_mtp(17, 2, seq=child, with_logits=True)
    want = reference_drafts(ref, prompt, 17, drafted)
    for i in range(2):
        assert rel(logits[i], want[i]) <= BUDGET


def greedy_run(session, prompt, **kw) -> tuple:
    """(ids, logits of each) of a greedy generate() from an empty cache."""
    session.reset()
    ids, logits = [], []

    def on_token(token, row):
        ids.append(token)
        logits.append(row.copy())

    for _ in session.generate(prompt, max_tokens=32, temperature=0.0, stop_at_eos=False, on_token=on_token, **kw):
        pass
    return ids, logits


def test_speculating_with_the_block_gives_plain_decodings_output(files):
    for arch in ARCHS:
        for quant in ("f32", "q4_k_m"):
            path = files[arch, quant]
            resident = sharpi.Session(path, threads=2, max_draft_tokens=4)
            prompt = [int(t) for t in np.random.default_rng(4).integers(3, 1000, 12)]
            want_ids, want_logits = greedy_run(resident, prompt)
            probe = sharpi.Session(path, threads=1, mtp=True, max_draft_tokens=4, ram_budget="4GiB", reader="pread")
            st = probe.expert_stats()
            budget = st["fixed_bytes"] + probe.info["n_expert_used"] * st["slot_bytes"]
            for options in ({}, {"ram_budget": budget, "reader": "pread"}):
                s = sharpi.Session(path, threads=2, mtp=True, max_draft_tokens=4, **options)
                spec = open_speculation(s, "draft-mtp", n_max=4)
                assert isinstance(spec.source, MtpDraft)
                got_ids, got_logits = greedy_run(s, prompt, speculative=spec)
                what = f"{arch} {quant} {options or 'resident'}"
                assert got_ids == want_ids, what
                for a, b in zip(got_logits, want_logits):
                    np.testing.assert_array_equal(a, b, err_msg=what)
                assert s.last_stats["spec_drafted"] > 0, what


def test_the_trunk_is_unchanged_by_the_block(files):
    path = files["qwen35moe", "q4_k_m"]
    tokens = [int(t) for t in np.random.default_rng(9).integers(0, 1000, 20)]
    plain = sharpi.Session(path, threads=2).decode(tokens, all_logits=True)
    with_mtp = sharpi.Session(path, threads=2, mtp=True).decode(tokens, all_logits=True)
    np.testing.assert_array_equal(plain, with_mtp)


@pytest.mark.parametrize("arch", ["qwen35moe", "deepseek4"])
def test_the_budget_charges_the_block(files, arch):
    path = files[arch, "q8_0"]
    n_ctx = 128
    fixed = {}
    for mtp in (False, True):
        probe = sharpi.Session(path, n_ctx=n_ctx, n_seq=2, mtp=mtp, ram_budget="4GiB", reader="pread")
        fixed[mtp] = probe.expert_stats()["fixed_bytes"]
    info = probe.info
    block = f"blk.{info['n_layer']}."
    weights = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name.startswith(block))
    if arch == "deepseek4":
        # The sliding-window block's f32 row (its kv, head_dim wide, K = V), and all 4 streams of the
        # trunk's hidden row per position.
        kv_row, hidden_row = info["head_dim"] * 4, 4 * info["n_embd"] * 4
    else:
        # K and V rows, f16 (fast mode's default); the output-normed hidden row.
        kv_row, hidden_row = 2 * info["n_head_kv"] * info["head_dim"] * 2, info["n_embd"] * 4
    per_seq = n_ctx * (kv_row + hidden_row)
    assert fixed[True] - fixed[False] == weights + 2 * per_seq


def test_bad_use_of_the_block_is_a_clear_error(files, tmp_path):
    with pytest.raises(sharpi.InvalidArgument, match="no multi-token-prediction layers"):
        sharpi.Session(files["plain"], mtp=True)
    s = sharpi.Session(files["qwen35moe", "f32"], threads=1)
    with pytest.raises(sharpi.InvalidArgument, match="without its MTP head"):
        s.draft_mtp(5, 2)
    with pytest.raises(sharpi.InvalidArgument, match="open the session with mtp=True"):
        open_speculation(s, "draft-mtp", n_max=2, )
    plain = sharpi.Session(files["plain"], threads=1)
    with pytest.raises(sharpi.InvalidArgument, match="no MTP layers"):
        open_speculation(plain, "draft-mtp")
    m = sharpi.Session(files["qwen35moe", "f32"], threads=1, mtp=True)
    with pytest.raises(sharpi.InvalidArgument, match="sequence is empty"):
        m.draft_mtp(5, 2)
    m.decode([1, 2, 3])
    with pytest.raises(sharpi.InvalidArgument, match="outside the vocabulary"):
        m.draft_mtp(10**6, 2)
    with pytest.raises(sharpi.InvalidArgument, match="n must be >= 1"):
        m.draft_mtp(5, 0)
    assert m.n_past == 3
    with pytest.raises(sharpi.UnsupportedError, match="not on the device path"):
        sharpi.Session(files["qwen35moe", "f32"], mtp=True, device="cuda")
    assert Speculation(MtpDraft(m), n_max=2).draft([1, 2, 3, 4], 2, key=0)  # the happy path drafts
    # deepseek4's block attends over pair rows, which keep relative positions only: a compressed
    # block (its windows close at absolute positions) is refused, the trunk still opens.
    compressed = tmp_path / "deepseek4-compressed-block.gguf"
    rewrite_gguf(files["deepseek4", "f32"], str(compressed),
                 set_kv={"deepseek4.attention.compress_ratios": [4, 0, 128, 4, 128]})  # fmt: skip
    with pytest.raises(sharpi.UnsupportedError, match="compress ratio 128; only a sliding-window block"):
        sharpi.Session(str(compressed), mtp=True)
    sharpi.Session(str(compressed), threads=1).decode([1, 2, 3])


# ---- files written by llama.cpp's converter (tiny random Hugging Face checkpoints whose mtp.*
# block hf_export adds, as real Qwen3-Next / Qwen3.5 checkpoints carry one) ----------------------


@pytest.fixture(scope="module")
def converted(model_dir, converter):
    from reference import hf_export

    names = ("qwen35moe", "qwen3next", "glm4moe", "deepseek_v32", "nemotron_h_mtp")
    return {name: {q: str(p) for q, p in hf_export.prepare(name, model_dir, converter,
                                                          outtypes=("f32", "q8_0")).gguf.items()}
            for name in names}


@pytest.mark.parametrize("name", ["qwen35moe", "qwen3next", "glm4moe", "deepseek_v32", "nemotron_h_mtp"])
@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_the_converters_block_matches_the_float64_reference(converted, name, quant):
    path = converted[name][quant]
    s = sharpi.Session(path, threads=2, exact=True, mtp=True, max_draft_tokens=4)
    assert s.info["n_layer_nextn"] == 1
    decode_and_check_drafts(s, make_reference(path), 10, 7, f"{name} {quant} converter")


def decode_and_check_drafts(session, ref, n_prompt, n_first, what):
    """A random prompt decoded as one step of n_first tokens then token by token; then three drafts
    against the reference."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    n_vocab = session.info["n_vocab"]
    prompt = [int(t) for t in rng.integers(0, n_vocab, n_prompt)]
    session.decode(prompt[:n_first])
    for t in prompt[n_first:]:
        session.decode([t])
    check_drafts(session, ref, prompt, int(rng.integers(0, n_vocab)), 3, f"{what} seed {seed}")


@pytest.mark.parametrize("n_slots", [1, 3])
@pytest.mark.parametrize("arch", ["qwen35moe", "deepseek4", "nemotron_h_moe"])
def test_the_server_drafts_with_the_block_per_slot(files, n_slots, arch):
    """The scheduler with draft-mtp: each slot's drafts come from its own sequence's pairs (the
    key is the sequence id) and join the batched step as rewindable entries of a hybrid model;
    every answer is plain decoding's."""
    import asyncio

    from sharpi.server.scheduler import END, Engine

    path = files[arch, "q8_0"]
    s = sharpi.Session(path, threads=2, n_ctx=256, n_seq=n_slots, mtp=True, max_draft_tokens=3)
    plain = sharpi.Session(path, threads=2, n_ctx=256)
    rng = np.random.default_rng(secrets.randbits(32))
    prompts = [[int(t) for t in rng.integers(3, 1000, n)] for n in (9, 14, 5)]
    options = {"max_tokens": 24, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "stop_at_eos": False}
    want = []
    for p in prompts:
        plain.reset()
        for _ in plain.generate(p, **options):
            pass
        want.append(list(plain.last_tokens))
    engine = Engine(s, speculation=open_speculation(s, "draft-mtp", n_max=3))

    async def run():
        jobs = [engine.submit(p, dict(options)) for p in prompts]
        for job in jobs:
            while await job.queue.get() is not END:
                pass
        return [job.tokens for job in jobs]

    try:
        got = asyncio.run(run())
        snap = engine.snapshot()
    finally:
        engine.close()
    assert got == want
    assert snap["draft_tokens"] > 0


@pytest.mark.parametrize("name", ["qwen35moe", "glm4moe", "deepseek_v32", "nemotron_h_mtp"])
def test_the_block_from_the_converters_mtp_export(converted, converter, model_dir, tmp_path, name):
    """llama.cpp's converter writes the block apart (`--mtp`: the block with the embeddings, norm and
    head) and the trunk without it (`--no-mtp`): Session(mtp=sidecar) on the trunk drafts exactly what
    the whole file's block drafts, and a sidecar of another model is refused."""
    from reference import hf_export

    hf_dir = hf_export.prepare(name, model_dir, converter).exported.hf_dir
    trunk = hf_export.convert(hf_dir, tmp_path / "trunk.gguf", "f32", converter, extra_args=["--no-mtp"])
    sidecar = hf_export.convert(hf_dir, tmp_path / "mtp-only.gguf", "f32", converter, extra_args=["--mtp"])
    prompt = [int(t) for t in np.random.default_rng(secrets.randbits(32)).integers(0, 300, 9)]
    whole = sharpi.Session(converted[name]["f32"], threads=2, mtp=True)
    apart = sharpi.Session(str(trunk), threads=2, mtp=str(sidecar))
    assert apart.info["n_layer_nextn"] == 0 and apart.info["mtp"]
    for s in (whole, apart):
        s.decode(prompt)
    want = whole.draft_mtp(7, 3, with_logits=True)
    got = apart.draft_mtp(7, 3, with_logits=True)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(sharpi.InvalidArgument, match="describes another model|is a 'qwen3next' file"):
        sharpi.Session(str(trunk), mtp=converted["qwen3next"]["f32"])
    with pytest.raises(sharpi.InvalidArgument, match="no multi-token-prediction layers"):
        sharpi.Session(str(trunk), mtp=True)


def test_deepseek4s_block_from_the_converters_mtp_sidecar(model_dir, converter):
    """DeepSeek-V4's converter writes the block only with --mtp (a plain conversion drops mtp.*): the
    sidecar's block, its own hc head included (the root output_hc_* of the sidecar), drafts on the
    trunk file's streams as the float64 reference does. (`--outtype q8_0` keeps this checkpoint's
    float32 tensors f32, and eh_proj is Q8_0 in every sidecar, so f32 covers both.)"""
    from reference import deepseek_v4_export

    trunk, sidecar = (str(p) for p in deepseek_v4_export.prepare_mtp(model_dir, converter)["f32"])
    ref = make_reference(trunk, sidecar)
    assert not np.allclose(ref.block.t["output_hc_fn.weight"], ref.trunk.t["output_hc_fn.weight"])
    s = sharpi.Session(trunk, threads=2, exact=True, mtp=sidecar, max_draft_tokens=4)
    assert s.info["n_layer_nextn"] == 0 and s.info["mtp"]
    decode_and_check_drafts(s, ref, 12, 9, "deepseek_v4 sidecar")
    with pytest.raises(sharpi.InvalidArgument, match="no multi-token-prediction layers"):
        sharpi.Session(trunk, mtp=True)


def test_the_shipped_models_head_matches_the_reference():
    """python/sharpi/models/stdlib-moe-mtp-q8_0.gguf (a qwen3moe block trained for the shipped model,
    block-only like llama.cpp's --mtp export) against the float64 reference: the trunk's hidden rows
    from the shipped file, the block from the head's file."""
    from sharpi.models import default_model_path, default_mtp_path

    trunk, head = default_model_path(), default_mtp_path()
    ref_trunk, ref_head = ReferenceModel(trunk), ReferenceModel(head)
    s = sharpi.Session(trunk, threads=2, exact=True, mtp=head)
    prompt = s.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n")
    s.decode(prompt)
    drafted, logits = s.draft_mtp(prompt[-1], 3, with_logits=True)
    hidden = forward(ref_trunk, prompt).intermediates["result_norm"]
    pair_tokens = list(prompt[1:]) + [prompt[-1]]
    for i in range(3):
        want, h_out = mtp_forward(ref_head, hidden, pair_tokens)
        assert rel(logits[i], want[-1]) <= BUDGET, f"draft position {i}"
        hidden = np.vstack([hidden, h_out[-1:]])
        pair_tokens.append(drafted[i])
