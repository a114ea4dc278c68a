"""What a Session is given for a request: chat messages rendered with a chat template into prompt
ids (encode_chat, or render_chat then encode_rendered_chat), a lower bound on a text's token count
without tokenizing it (max_token_bytes), and how much of a prompt the KV cache already holds
(reuse_prefix). Used by the server and by `sharpi chat`; nothing here knows about HTTP.
"""

from __future__ import annotations

from ..synthetic_tokenizer import CHAT_TEMPLATE

# The template used when the model ships none (the shipped stdlib-moe is a code model): ChatML, as
# llama.cpp's server falls back to; the synthetic models' template is exactly that.
CHATML_TEMPLATE = CHAT_TEMPLATE


# Names a template keyword argument (--chat-template-kwargs, a request's chat_template_kwargs) may
# not take: Tokenizer.apply_chat_template's own parameters.
RESERVED_TEMPLATE_KWARGS = frozenset({"self", "messages", "add_generation_prompt", "template"})


def render_chat(tok, messages: list, /, template: str | None = None, **template_kwargs) -> str:
    """The prompt text of chat messages: `template` (default: the model's) rendered with a
    generation prompt; template_kwargs may use no name in RESERVED_TEMPLATE_KWARGS."""
    return tok.apply_chat_template(messages, add_generation_prompt=True, template=template, **template_kwargs)


# What a template is shown to learn how it writes an assistant turn's tool calls (see
# tool_call_form): one call whose argument value shows in the text, unescaped where the arguments
# were written as a JSON object, escaped (\\") where a JSON string was written as JSON again.
_PROBE_ARGUMENTS = {"sharpi_probe_argument": "sharpi_probe_value"}
# ...offered as a tool, as a request with calls in its history offers its tools (Hermes 2 Pro's
# template iterates `tools` and fails without them).
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "sharpi_probe", "description": "probe",
    "parameters": {"type": "object", "properties": {"sharpi_probe_argument": {"type": "string"}}}}}]
_TOOL_CALL_FORMS: dict = {}  # template source -> (content of a calls-only turn, arguments as "string"/"object")


def _render_or_none(tok, messages: list, template: str) -> str | None:
    from .. import _core

    try:
        return tok.apply_chat_template(messages, add_generation_prompt=False, template=template, tools=_PROBE_TOOLS)
    except _core.InvalidArgument:  # the template failed on these messages (the tokenizer wraps its error)
        return None


def tool_call_form(tok, template: str) -> tuple:
    """How `template` must be given an assistant turn's tool calls to write them: (the content of
    a turn with calls and no text: None or "", the arguments: "string" (OpenAI's JSON text) or
    "object" (parsed)). Templates differ: DeepSeek-R1's write a calls-only turn only when content is
    None and concatenate the arguments as text; Qwen3-Coder's iterate them as a mapping (`|items`);
    Qwen2.5's and Llama 3's print them with `tojson`, which would write a string as an escaped one.
    Found as llama.cpp's minja finds it: the first form whose rendering shows the probe argument's
    value, not inside an escaped JSON string; ("", "content") when none does: the template ignores
    an assistant turn's tool_calls (SmolLM3's, LFM2's, Granite's expect the model's raw text), so
    fit_tool_calls writes them into the content. Cached per template source."""
    form = _TOOL_CALL_FORMS.get(template)
    if form is not None:
        return form
    import json

    form = ("", "content")
    for content in (None, ""):
        for args_form in ("string", "object"):
            args = json.dumps(_PROBE_ARGUMENTS) if args_form == "string" else dict(_PROBE_ARGUMENTS)
            messages = [{"role": "user", "content": "probe"},
                        {"role": "assistant", "content": content, "tool_calls": [{
                            "id": "call00001", "type": "function",
                            "function": {"name": "sharpi_probe", "arguments": args}}]},
                        {"role": "tool", "tool_call_id": "call00001", "content": "ok"}]
            text = _render_or_none(tok, messages, template)  # None: a form this template cannot take
            if text is not None and "sharpi_probe_value" in text and '\\"sharpi_probe_value' not in text:
                form = (content, args_form)
                break
        if form != ("", "content"):
            break
    _TOOL_CALL_FORMS[template] = form
    return form


def fit_tool_calls(tok, template: str | None, messages: list) -> list:
    """`messages` (OpenAI's shapes: a calls-only assistant turn has content None or "", arguments
    are JSON text) with each assistant turn's tool calls in the form `template` (default: the
    model's) writes them (tool_call_form), or written into the content where it writes none.
    Arguments that are not JSON text stay as given."""
    import json

    template = template if template is not None else tok.chat_template
    if not template or not any(m.get("role") == "assistant" and m.get("tool_calls") for m in messages):
        return messages
    content_form, args_form = tool_call_form(tok, template)
    out = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if not calls or not isinstance(calls, list):
            out.append(m)
            continue
        if args_form == "content":
            out.append(_calls_in_content(m))
            continue
        fitted = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and args_form == "object" and isinstance(fn.get("arguments"), str):
                try:
                    call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
                except ValueError:
                    pass
            elif isinstance(fn, dict) and args_form == "string" and isinstance(fn.get("arguments"), dict):
                call = {**call, "function": {**fn, "arguments": json.dumps(fn["arguments"], ensure_ascii=False)}}
            fitted.append(call)
        content = m.get("content")
        out.append({**m, "content": content_form if not content else content, "tool_calls": fitted})
    return out


def _calls_in_content(message: dict) -> dict:
    """An assistant turn whose tool_calls the template would drop, with them written into its
    content as minja's polyfill writes them: {"tool_calls": [{"name", "arguments" (an object),
    "id"}], "content"} as JSON with an indent of 2."""
    import json

    calls = []
    for call in message["tool_calls"]:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            continue
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append({"name": fn.get("name"), "arguments": args, **({"id": call["id"]} if call.get("id") else {})})
    obj: dict = {"tool_calls": calls}
    if message.get("content"):
        obj["content"] = message["content"]
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": json.dumps(obj, indent=2, ensure_ascii=False)}


def encode_rendered_chat(tok, text: str) -> list:
    """Prompt ids of render_chat's text: control tokens encoded as text and no second BOS when
    the template writes one."""
    starts_with_bos = tok.bos_id is not None and text.startswith(tok.id_to_token(tok.bos_id))
    return tok.encode(text, add_bos=False if starts_with_bos else None, special=True)


def encode_chat(tok, messages: list, /, template: str | None = None, **template_kwargs) -> list:
    """Prompt ids for chat messages: `template` (default: the model's) rendered with a generation
    prompt, encoded with control tokens as text and no second BOS when the template writes one."""
    return encode_rendered_chat(tok, render_chat(tok, messages, template, **template_kwargs))


# Fill-in-the-middle tokens by their text where the GGUF names none (tokenizer.ggml.fim_*_token_id):
# (prefix, suffix, middle) as Qwen2.5-Coder / Qwen3, StarCoder and DeepSeek-Coder spell them.
FIM_TOKEN_TEXTS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
                   ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                   ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))


def fim_token_ids(tok, metadata: dict) -> tuple | None:
    """(prefix, suffix, middle) ids of the model's fill-in-the-middle tokens: the GGUF's
    tokenizer.ggml.fim_pre_token_id / fim_suf_token_id / fim_mid_token_id (llama.cpp's names), else
    the first of FIM_TOKEN_TEXTS whose three texts are all in the vocabulary; None without them.
    One pass over the vocabulary when the metadata names none."""
    keys = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.fim_mid_token_id")
    ids = [metadata.get(k) for k in keys]
    if all(isinstance(i, int) and 0 <= i < tok.n_vocab for i in ids):
        return tuple(ids)
    wanted = {text for texts in FIM_TOKEN_TEXTS for text in texts}
    found = {}
    for i in range(tok.n_vocab):
        text = tok.id_to_token(i)
        if text in wanted:
            found.setdefault(text, i)
    for texts in FIM_TOKEN_TEXTS:
        if all(t in found for t in texts):
            return tuple(found[t] for t in texts)
    return None


def fim_prompt_ids(tok, fim_ids: tuple, prefix: str, suffix: str) -> list:
    """The prompt of a fill-in-the-middle request in llama.cpp's PSM order (llama-server's /infill):
    [BOS where the model adds one] <fim_pre> prefix <fim_suf> suffix <fim_mid>; the model writes the
    middle. Prefix and suffix are tokenized as text (control-token texts in them are not tokens)."""
    pre, suf, mid = fim_ids
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return [*bos, pre, *tok.encode(prefix, add_bos=False, add_eos=False), suf,
            *tok.encode(suffix, add_bos=False, add_eos=False), mid]


def max_token_bytes(tok) -> int | None:
    """The most bytes of text one token of `tok` can stand for (its piece as text, or its bytes,
    whichever is longer), so a text of B bytes is at least B / max_token_bytes tokens; None where no
    such bound holds: a SentencePiece vocabulary without byte tokens makes one <unk> of a whole run
    of unknown text. One pass over the vocabulary (a fraction of a second for 150 k tokens)."""
    from ..tokenizer import TOKEN_BYTE

    n_vocab = tok.n_vocab
    if tok.model != "gpt2" and not any(tok.token_type(i) == TOKEN_BYTE for i in range(n_vocab)):
        return None
    return max(max(len(tok.token_to_bytes(i)), len(tok.id_to_token(i).encode("utf-8"))) for i in range(n_vocab))


def reuse_prefix(session, held: list, ids: list) -> int:
    """Readies `session`, whose KV cache holds `held` (ids in order), to decode the prompt `ids`,
    and returns how many leading ids it kept: the common prefix of both (the next turn of a chat
    extends `held`; an edited or regenerated one diverges from it), less the prompt's last id,
    which is decoded again for the logits that pick the first answer token. The cache is cut back
    to that prefix (Session.truncate), or cleared when nothing is shared. Decoding only the rest
    gives a cold run's logits bit for bit, since a prefill computes each position from the cached
    rows exactly as token-by-token decoding does.

    Hybrid archs (qwen3next, qwen35moe) keep a recurrent DeltaNet state that has absorbed every
    held position and cannot be rewound: there only a prompt that extends `held` keeps it, and
    any other starts over (truncate raises UnsupportedError, caught here)."""
    from .. import _core

    n = 0
    for a, b in zip(held, ids[:-1]):
        if a != b:
            break
        n += 1
    if n == 0:
        session.reset()
        return 0
    try:
        session.truncate(n)
    except _core.UnsupportedError:
        session.reset()
        return 0
    return n

