"""ServedModel: what every route needs to know about the one model the server serves: the Engine
that runs it, the name the API reports, how chat requests are rendered, the sampling defaults of
a request, and the server's request limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from .body import DEFAULT_MAX_BODY
from .scheduler import Engine


@dataclass
class ServedModel:
    engine: Engine
    model_id: str  # the name the API reports and accepts (--alias, default the file name)
    model_path: str
    # The chat template chat requests are rendered with, None for the model's own, and the
    # server's --chat-template-kwargs (a request's own chat_template_kwargs go on top).
    chat_template: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    # Session.generate keywords a request's own fields override (`sharpi serve`'s sampling flags,
    # cli_args.sampling_options); empty: OpenAI's defaults (openai_api.OPENAI_SAMPLING_DEFAULTS).
    sampling_defaults: dict = field(default_factory=dict)
    max_body: int = DEFAULT_MAX_BODY  # bytes of a request body (--max-body)
    # --reasoning-format: "deepseek" splits reasoning into reasoning_content, "none" leaves it in the content.
    reasoning_format: str = "deepseek"
    # prompt.max_token_bytes of the tokenizer: a prompt text longer than n_ctx tokens can be is
    # refused untokenized; None: always tokenized.
    max_token_bytes: int | None = None
