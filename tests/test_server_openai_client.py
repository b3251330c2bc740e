"""The official `openai` client (AsyncOpenAI, streaming) against `exlpy serve`'s app: what the serving
benchmark drives on a GPU, here on the demo model in-process."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from exlpy.server import create_app  # noqa: E402
from tests.test_server_helpers import (  # noqa: E402
    NO_EOS,
    make_state,
    prompt_ids,
    reference_greedy,
    single_torch_thread,  # noqa: F401
)


def test_concurrent_streams_through_async_openai() -> None:
    state = make_state()
    prompts = ["Once", "Why", "Echoes of", "A"]

    async def main() -> list[tuple[str, int]]:
        transport = httpx.ASGITransport(app=create_app(state))
        http = httpx.AsyncClient(transport=transport, base_url="http://test/v1", timeout=60)
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)

        async def one(p: str) -> tuple[str, int]:
            stream = await client.completions.create(
                model="aidreams260K", prompt=prompt_ids(p)[0].tolist(), max_tokens=10, temperature=0,
                logit_bias=NO_EOS, stream=True, stream_options={"include_usage": True})
            text, used = "", 0
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage is not None:
                    used = chunk.usage.completion_tokens
            return text, used

        try:
            return await asyncio.gather(*[one(p) for p in prompts])
        finally:
            await state.bridge.stop()
            await http.aclose()

    for p, (text, used) in zip(prompts, asyncio.run(main())):
        assert used == 10 and text == reference_greedy(prompt_ids(p), 10, banned_eos=True)
