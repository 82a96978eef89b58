"""The part of vLLM's OpenAI-compatible API a teacher needs, as typed models validated at the edge: a completion
request with token-id prompts and ``prompt_logprobs``, its response, the model list, ``/tokenize``, and vLLM's
error body (``{"error": {"message", "type", "param", "code"}}``). Field names and shapes follow vLLM's
``vllm/entrypoints/openai/completion/protocol.py`` and ``engine/protocol.py`` (read at commit 002032ee of its main
branch), so vLLM's clients read ours and ours reads vLLM's; fields a teacher does not use are accepted and
ignored, as vLLM ignores unknown ones; the few of our own are marked "Ours". The response's per-position entries
are written as plain data (``app.py``); ``CompletionResponse`` is their schema, which a test validates an answer
against. The compact answer our client may ask for instead is ``opsd_rollout.compact_answer``'s."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class Lenient(BaseModel):
    """Unknown fields accepted and ignored (an OpenAI client sends many a teacher has no use for)."""

    model_config = ConfigDict(extra="ignore")


TokenId = Annotated[int, Field(ge=0)]


class CompletionRequest(Lenient):
    model: str | None = None
    prompt: list[TokenId] | list[list[TokenId]] = Field(min_length=1)
    """Token ids: one prompt or a list of them (text prompts are not served: the teacher scores given tokens)."""
    max_tokens: int | None = Field(default=16, ge=0)
    """Tokens to generate: none is generated here (a teacher scores its prompt), so any value is accepted."""
    prompt_logprobs: int | None = Field(default=None, ge=0)
    """k: at every prompt position, the given token's log-probability and the k most likely tokens'."""
    temperature: float | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    echo: bool = False
    return_token_ids: bool | None = None
    prompt_logprobs_start: list[Annotated[int, Field(ge=1)]] | None = None
    """Ours, read with the compact answer only: per prompt, the first position answered (the response's first
    token); ``None``: every position from 1."""
    prompt_logprobs_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Ours, read with the compact answer only: the dtype of the log-probabilities sent (the client's cache's)."""

    def rows(self) -> list[list[int]]:
        return [self.prompt] if isinstance(self.prompt[0], int) else self.prompt


class Logprob(BaseModel):
    logprob: float
    rank: int | None = None
    """1 for the most likely token; the given token's rank may be past k."""
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str = ""
    logprobs: None = None
    finish_reason: str | None = "length"
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_token_ids: list[int] | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "opsd-rollout"
    root: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None
    """Ours, not vLLM's: the vocabulary a client compares with its student's."""
    max_logprobs: int | None = None
    """Ours: the largest ``prompt_logprobs`` served (vLLM's ``--max-logprobs``)."""
    compact_answer_version: int | None = None
    """Ours: the version of the compact answer this server gives when asked (``opsd_rollout.compact_answer``); ``None``:
    vLLM's JSON only. Our client asks for the compact answer only where this says it may."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
