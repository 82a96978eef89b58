"""The embedded teacher server (``opsd-rollout serve-teacher``): the part of vLLM's OpenAI-compatible API a teacher
needs (token-id prompts, ``prompt_logprobs``), a thin FastAPI app over an engine that batches. It stands on ``opsd``'s
layer beside ``train`` and ``bench``; clients are ``opsd.served.ServedTeacher`` and anything that speaks vLLM's API.
Light at import: the modules load when named."""

__all__ = ["ServeConfig", "TeacherServer", "EngineLimits"]


def __getattr__(name: str):
    if name in ("ServeConfig", "TeacherServer"):
        from opsd_rollout.serve import server

        return getattr(server, name)
    if name == "EngineLimits":
        from opsd_rollout.serve.engine import EngineLimits

        return EngineLimits
    raise AttributeError(name)
