"""Token mode's context-length refusals seen end to end: harness 400, then the finish flag."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from server_fixtures import ServerThread, bearer

from skycap.client import CapturePool
from skycap.server.options import ServerOptions

START = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "find x"}]


async def test_finish_reports_a_context_length_refusal(
    token_server_options: Callable[..., ServerOptions], tmp_path: Path
) -> None:
    options = token_server_options(max_model_len=200, record_dir=tmp_path)
    with ServerThread(options) as server:
        async with CapturePool([server.url]) as pool:
            refused, fitting = await pool.create(), await pool.create()
            for traj in (refused, fitting):
                client = openai.AsyncOpenAI(
                    base_url=traj.base_url, api_key=traj.api_key, max_retries=0
                )
                assert (await client.chat.completions.create(model="p", messages=START)).choices
                await client.close()
            client = openai.AsyncOpenAI(
                base_url=refused.base_url, api_key=refused.api_key, max_retries=0
            )
            long = [*START, {"role": "user", "content": "word " * 400}]
            with pytest.raises(openai.BadRequestError) as too_long:
                await client.chat.completions.create(model="p", messages=long)
            await client.close()
            assert too_long.value.code == "context_length_exceeded"
            result = await refused.finish({"reward": 0})
            assert result.context_length_exceeded is True and len(result.samples) == 1
            assert (await fitting.finish()).context_length_exceeded is False
            # A repeat finish is answered like the first, though the record left memory.
            assert (await refused.finish({"reward": 0})).context_length_exceeded is True
    # The flag is not part of the record format: a restarted server cannot know it.
    with ServerThread(options) as server:
        async with httpx.AsyncClient() as http:
            url = f"{server.url}/trajectories/{refused.id}/finish"
            answer = await http.post(
                url, json={"annotations": {"reward": 0}}, headers=bearer(server.control_token)
            )
        assert answer.status_code == 200 and answer.json()["context_length_exceeded"] is False
