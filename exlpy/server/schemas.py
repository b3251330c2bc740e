"""OpenAI request and response bodies (pydantic). Only types are checked here; value ranges are checked in
`params.py` (and tools / response formats in `tools.py` / `structured.py`) so that a bad value answers 400
with a typed exception that names the OpenAI field.

Unknown fields are ignored (clients send `user`, `metadata` and newer fields freely); known ones are typed
strictly: a string is not a boolean or a number, a float is not an integer.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class Loose(BaseModel):
    # strict: no lax coercion ("stream": "yes" is not true, "n": "2" is not 2, 1.5 is not an int)
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(Loose):
    include_usage: bool = False


class JsonSchemaFormat(Loose):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)

    def __init__(self, **data: Any) -> None:
        if "schema" in data:
            data["schema_"] = data.pop("schema")
        super().__init__(**data)


class ResponseFormat(Loose):
    type: str
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(Loose):
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | bool | None = None
    strict: bool | None = None


class Tool(Loose):
    type: str = "function"
    function: FunctionDef | None = None


class NamedFunction(Loose):
    name: str | None = None


class NamedToolChoice(Loose):
    type: str = "function"
    function: NamedFunction | None = None


class SamplingFields(Loose):
    """Fields shared by /v1/completions and /v1/chat/completions. None means "the default"."""

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
    response_format: ResponseFormat | None = None
    prompt_logprobs: int | None = None  # vLLM: logprobs of the prompt tokens (top k alternatives)
    logprobs_mode: str | None = None  # "raw_logprobs" (default: the model's log-softmax) or "processed_logprobs"
    # vLLM's guided decoding fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # legacy completions: number of alternatives per token (0-20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(Loose):
    type: str = "text"
    text: str | None = None
    image_url: dict[str, Any] | str | None = None  # {"url": "data:image/png;base64,..."} (exlpy/server/vision.py)


class FunctionCall(Loose):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Loose):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(Loose):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


# --- responses ------------------------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[Any] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


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
    prompt_logprobs: list[Any] | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


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


class TokenizeRequest(Loose):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Loose):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
