"""The server's agent-facing API dialects, beside mlx-lm's chat completions:
Anthropic's Messages (``/v1/messages``, ``/v1/messages/count_tokens``) and
OpenAI's Responses (``/v1/responses``), plus ``/metrics``.

Every dialect turns its request into one internal chat request and renders
one internal result (:mod:`dflash_mlx.api.turn`).
"""

from functools import partial

from .messages import MessagesEndpoint
from .metrics import Metrics
from .responses import ResponsesEndpoint, ResponseStore
from .turn import Result, ToolCall, Turn, read_json_body

# POST routes served here, and the endpoint class that serves each.
ENDPOINTS = {
    "/v1/messages": MessagesEndpoint,
    "/v1/messages/count_tokens": partial(MessagesEndpoint, count_only=True),
    "/v1/responses": ResponsesEndpoint,
}

__all__ = ["ENDPOINTS", "Metrics", "Result", "ResponseStore", "ToolCall", "Turn", "read_json_body"]
