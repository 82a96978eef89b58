"""The embedded teacher server (``opsd-rollout serve-teacher``): the part of vLLM's OpenAI-compatible API a teacher
needs (token-id prompts, ``prompt_logprobs``), a thin FastAPI app over an engine that batches. It stands on ``opsd``'s
layer beside ``train`` and ``bench``; clients are ``opsd.served.ServedTeacher`` and anything that speaks vLLM's API.
Light at import: the modules load when named (PEP 562, ``opsd_rollout.lazy``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opsd_rollout.lazy import lazy_exports

_EXPORTS = {"ServeConfig": ".server", "TeacherServer": ".server", "EngineLimits": ".engine"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from opsd_rollout.serve.engine import EngineLimits
    from opsd_rollout.serve.server import ServeConfig, TeacherServer

__getattr__ = lazy_exports(globals(), _EXPORTS)
