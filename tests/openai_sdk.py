"""The OpenAI SDK pointed at a service under test."""

from __future__ import annotations

import openai

from tests.api_keys import API_KEY


def sdk(stack, key: str = API_KEY) -> openai.OpenAI:
    """A client of `stack`'s API that retries nothing, so a refusal reaches the test as the SDK raised it."""
    return openai.OpenAI(base_url=stack.api_url + "/v1", api_key=key, max_retries=0, timeout=120)
