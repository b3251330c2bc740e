"""OpenAI request and response bodies (pydantic). Only types are checked here; value ranges are checked in
`params.py` so that a bad value answers 400 with a typed exception that names the OpenAI field.

Unknown fields are ignored (clients send `user`, `stream_options` and newer fields freely).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. None means "the default"."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None  # legacy completions: number of alternatives per token (0-5)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None


# --- responses ------------------------------------------------------------------------------------------------
FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
