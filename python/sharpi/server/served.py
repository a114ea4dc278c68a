"""ServedModel: what every route needs to know about the one model the server serves: the Engine
that runs it, the name the API reports, and how chat requests are rendered."""

from __future__ import annotations

from dataclasses import dataclass, field

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
