"""Token mode's engine-side settings: sampling masks, the served model name, generation
defaults, renderer choice and raw-content decoding, each against what vLLM really does."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from server_fixtures import Control, ServerThread

from skycap.cli.main import main as skycap_main
from skycap.mock.engine import Reply, ScriptedEngine
from skycap.server.options import ServerOptions
from skycap.tokens.backend import TokenBackend
from skycap.tokens.library import renderer_names
from skycap.tokens.library_renderer import LibraryRenderer
from skycap.tokens.models import ServedModel
from skycap.tokens.renderer import RenderError, raw_content
from skycap.tokens.sampling import load_generation_config

START = [{"role": "user", "content": "find x"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]


def sdk(control: Control) -> openai.OpenAI:
    created = control.create()
    return openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)


# -- sampling masks ------------------------------------------------------------------------


def test_masks_asked_of_an_engine_without_the_flag_name_it(
    qwen3_tokenizer: Any, qwen3_renderer: Any
) -> None:
    with ScriptedEngine(qwen3_tokenizer) as engine:  # no --return-sampling-mask
        options = ServerOptions(
            engine.url,
            mode="tokens",
            renderer=qwen3_renderer,
            sampling_mask=True,
            sampling_overrides={"top_k": 20},
        )
        with ServerThread(options) as server, Control(server.url) as control:
            with pytest.raises(openai.InternalServerError) as raised:
                sdk(control).chat.completions.create(model="p", messages=START)
    assert raised.value.status_code == 502
    assert "--return-sampling-mask" in raised.value.message


def test_mask_constraints_are_400s_naming_the_field(
    qwen3_tokenizer: Any, qwen3_renderer: Any
) -> None:
    with ScriptedEngine(qwen3_tokenizer, sampling_mask=True) as engine:
        options = ServerOptions(
            engine.url, mode="tokens", renderer=qwen3_renderer, sampling_mask=True
        )
        with ServerThread(options) as server, Control(server.url) as control:
            client = sdk(control)
            with pytest.raises(openai.BadRequestError) as no_k:
                client.chat.completions.create(model="p", messages=START)
            with pytest.raises(openai.BadRequestError) as greedy:
                client.chat.completions.create(
                    model="p", messages=START, temperature=0, extra_body={"top_k": 5}
                )
            reply = client.chat.completions.create(
                model="p", messages=START, extra_body={"top_k": 5}
            )
            assert reply.choices[0].message.content
            assert engine.generated[-1].body["sampling_params"]["top_k"] == 5
    assert no_k.value.param == "top_k" and "--return-sampling-mask" in no_k.value.message
    assert greedy.value.param == "temperature" and "temperature > 0" in greedy.value.message
    assert len(engine.generated) == 1


@pytest.mark.parametrize(
    ("overrides", "mask", "field"),
    [
        ({"top_k": 0}, True, "top_k"),
        ({"temperature": 0}, True, "temperature"),
        ({"temperature": 5}, False, "temperature"),
        ({"top_p": 1.5}, False, "top_p"),
    ],
)
def test_overrides_vllm_would_refuse_fail_at_start(
    qwen3_renderer: Any, overrides: dict[str, Any], mask: bool, field: str
) -> None:
    with pytest.raises(ValueError, match=rf"sampling_overrides\.{field}: "):
        TokenBackend(
            upstream_url="http://127.0.0.1:9",
            renderer=qwen3_renderer,
            sampling_mask=mask,
            sampling_overrides=overrides,
        )


# -- the served model name -----------------------------------------------------------------


def test_the_name_is_learned_with_backoff_and_several_names_take_the_first() -> None:
    answers: list[Any] = [
        OSError("connection refused"),
        (503, b"{}"),
        (200, json.dumps({"data": [{"id": "a"}, {"id": "b"}]}).encode()),
    ]

    async def lister() -> tuple[int, bytes]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def main() -> ServedModel:
        served = ServedModel(None)
        await served.start(lister)
        await served.close()
        return served

    served = asyncio.run(main())
    assert served.name == "a" and answers == []
    assert served.describe() == "model a (from the engine's /v1/models; the engine also serves b)"
    assert ServedModel("mine").describe() == "model mine (--model)"


def test_an_engine_down_at_start_is_asked_again_on_the_first_call() -> None:
    calls: list[int] = []

    async def down() -> tuple[int, bytes]:
        calls.append(1)
        raise OSError("refused")

    async def up() -> tuple[int, bytes]:
        return 200, b'{"data": [{"id": "late"}]}'

    async def main() -> tuple[ServedModel, str | None]:
        served = ServedModel(None)
        await served.start(down)
        assert served.name is None and "refused" in served.describe()
        learned = await served.on_call(up)
        await served.close()
        return served, learned

    served, learned = asyncio.run(main())
    assert learned == "late" and served.source == "engine" and len(calls) >= 5

    async def only_the_first_call_asks() -> list[int]:
        served = ServedModel(None)
        await served.on_call(down)
        await served.on_call(down)
        return calls

    before = len(calls)
    assert len(asyncio.run(only_the_first_call_asks())) == before + 1


def test_the_start_line_names_the_model_and_the_logprobs_pairing(
    qwen3_tokenizer: Any, qwen3_dir: Path
) -> None:
    with ScriptedEngine(qwen3_tokenizer, model="served-policy") as engine:
        process = subprocess.Popen(
            [sys.executable, "-m", "skycap.cli.main", "serve", "--mode", "tokens"]
            + ["--upstream-url", engine.url, "--tokenizer", str(qwen3_dir)]
            + ["--renderer", "qwen3", "--renderer-pool-size", "1", "--port", "0"]
            + ["--render-cache-mib", "64"],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
        )
        try:
            deadline, line = time.monotonic() + 120, ""
            while time.monotonic() < deadline and not line.startswith("token mode:"):
                line = process.stderr.readline()
                assert line or process.poll() is None, "skycap serve exited"
        finally:
            process.terminate()
            process.wait(timeout=30)
    assert "model served-policy (from the engine's /v1/models)" in line
    assert "logprobs_mode processed_logprobs" in line and "raw_logprobs" in line
    # The pool is built before the server says it is ready, and says how long it took.
    assert re.search(r"1 renderer slot built in \d+\.\d s; render cache 64 MiB", line)


# -- generation defaults -------------------------------------------------------------------


def test_generation_config_auto_none_and_path(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_k": 20, "max_new_tokens": 99, "do_sample": True})
    )
    expected = {"temperature": 0.7, "top_k": 20, "max_tokens": 99}
    assert load_generation_config("auto", [tmp_path, folder])[0] == expected
    assert load_generation_config(None, [tmp_path]) == ({}, None)
    assert load_generation_config("none", [folder]) == ({}, None)
    assert load_generation_config(str(folder), [])[0] == expected
    with pytest.raises(ValueError, match="no such file"):
        load_generation_config(str(tmp_path / "missing.json"), [])
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 9}))
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
        load_generation_config("auto", [folder])


# -- renderer choice -----------------------------------------------------------------------


def test_a_folder_no_renderer_is_known_for_fails_listing_the_names(qwen3_dir: Path) -> None:
    names = renderer_names()
    assert "qwen3" in names and "default" in names
    for choice in (None, "auto"):
        with pytest.raises(RenderError, match="pass --renderer NAME") as raised:
            LibraryRenderer(qwen3_dir, renderer_name=choice)
        assert all(name in str(raised.value) for name in names)


def test_skycap_serve_refuses_to_start_naming_the_choices(
    qwen3_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = skycap_main(
        ["serve", "--mode", "tokens", "--upstream-url", "http://127.0.0.1:9"]
        + ["--tokenizer", str(qwen3_dir), "--port", "0"]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "no renderer is known for tokenizer" in err and "qwen3" in err and "Traceback" not in err


def test_a_folder_saved_from_a_known_model_infers_its_renderer(
    qwen3_dir: Path, tmp_path: Path, qwen3_tokenizer: Any
) -> None:
    folder = tmp_path / "my-checkpoint"
    folder.mkdir()
    for item in qwen3_dir.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen3-8B"}))
    renderer = LibraryRenderer(folder)
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call><|im_end|>'
    completion = qwen3_tokenizer.encode(text, add_special_tokens=False)
    message = renderer.parse(completion, TOOLS)
    assert message["tool_calls"][0]["function"]["name"] == "search"
    named = tmp_path / "Qwen3-8B"  # a folder named like the model
    named.mkdir()
    for item in qwen3_dir.iterdir():
        (named / item.name).symlink_to(item)
    assert LibraryRenderer(named).parse(completion, TOOLS)["tool_calls"]


# -- raw content decoding parity -----------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_raw_content_decodes_as_the_tokenizer_does(
    qwen3_renderer: Any, qwen3_tokenizer: Any, skip: bool
) -> None:
    """vLLM's text is the completion without its stop token, decoded with
    skip_special_tokens (true by default); mid-completion special tokens show the difference."""
    text = "<think>\nhm\n</think>\n\nA 😀 b<|endoftext|>c <|im_start|>d 你好<|im_end|>"
    completion = qwen3_tokenizer.encode(text, add_special_tokens=False)
    prompt = qwen3_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    expected = qwen3_tokenizer.decode(completion[:-1], skip_special_tokens=skip)
    assert raw_content(qwen3_renderer, completion, prompt, skip_special_tokens=skip) == expected
    assert ("<|endoftext|>" in expected) is not skip


def test_keep_special_tokens_reaches_the_raw_reply(
    qwen3_tokenizer: Any, qwen3_renderer: Any
) -> None:
    with ScriptedEngine(qwen3_tokenizer) as engine:
        engine.queue(Reply("x<|endoftext|>y"), Reply("x<|endoftext|>y"))
        for keep, expected in ((False, "xy"), (True, "x<|endoftext|>y")):
            options = ServerOptions(
                engine.url,
                mode="tokens",
                renderer=qwen3_renderer,
                use_raw_content=True,
                keep_special_tokens=keep,
            )
            with ServerThread(options) as server, Control(server.url) as control:
                reply = sdk(control).chat.completions.create(model="p", messages=START)
            assert reply.choices[0].message.content == expected
