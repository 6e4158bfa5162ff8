"""SkycapConfig from SkyRL's `cfg.skycap` block or its whole config: defaults, the plan's checks
in one place, and errors that name the key; a SkycapCallback forwards the step hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from skycap.compose import Policy
from skycap.integrations.skyrl import SkycapCallback, SkycapConfig, openai_sampling

STEP_WISE = {"step_wise_trajectories": True, "merge_stepwise_output": False}


def whole(block: dict[str, Any], generator: dict[str, Any] | None = None, **trainer: Any) -> Any:
    """SkyRL's whole config as a mapping: `skycap`, `generator`, `trainer`."""
    return {"skycap": block, "generator": generator or dict(STEP_WISE), "trainer": trainer}


def test_a_block_reads_with_defaults_and_every_option() -> None:
    config = SkycapConfig.from_mapping(
        {
            "servers": ["http://10.0.0.1:9000", "http://10.0.0.2:9000"],
            "record_dir": "/data/records",
            "record_mirror": "s3://bucket/run-7",
            "record_mirror_config": {"key": "k"},
            "upstream_url": "http://engine:8000",
            "tokenizer": "Qwen/Qwen3-8B",
            "use_raw_content": True,
            "renderer_pool_size": 4,
            "ttl": 600,
            "serve": {"max_model_len": 32768},
            "policy": {"max_seq_len": 4096, "timeout_threshold": 0.5},
            "wandb": {"enabled": False, "phases": ["train", "eval"]},
        }
    )
    assert config.servers == ("http://10.0.0.1:9000", "http://10.0.0.2:9000")
    assert not config.starts_servers and config.rows == "step" and config.ray is None
    assert config.policy == Policy(max_seq_len=4096, timeout_threshold=0.5)
    assert config.wandb_phases == ("train", "eval") and not config.wandb_enabled
    options = config.serve_options()
    assert options["mode"] == "tokens" and options["ttl"] == 600
    assert options["record_mirror_config"] == {"key": "k"} and options["max_model_len"] == 32768
    assert SkycapConfig.from_mapping({}).servers == 1


def test_the_whole_config_sets_the_index_from_the_logger_and_r3_from_the_engine() -> None:
    r3 = {**STEP_WISE, "inference_engine": {"enable_return_routed_experts": True}}
    config = SkycapConfig.from_mapping(whole({}, r3, logger="wandb"))
    assert config.wandb_enabled and config.routed_experts  # R3 with step-wise rows is allowed
    assert not SkycapConfig.from_mapping(whole({}, logger="console")).wandb_enabled
    assert SkycapConfig.from_mapping(whole({}, logger=["console", "wandb"])).wandb_enabled
    off = SkycapConfig.from_mapping(whole({"wandb": {"enabled": False}}, logger="wandb"))
    assert not off.wandb_enabled
    final = whole({"rows": "final"}, {"step_wise_trajectories": False})
    assert SkycapConfig.from_mapping(final).rows == "final"


@pytest.mark.parametrize(
    ("mapping", "named"),
    [
        (whole({}, {"step_wise_trajectories": False}), "generator.step_wise_trajectories"),
        (
            whole({}, {"step_wise_trajectories": True, "merge_stepwise_output": True}),
            "generator.merge_stepwise_output",
        ),
        (whole({}, {**STEP_WISE, "zero_reward_on_non_stop": True}), "zero_reward_on_non_stop"),
        (whole({}, {**STEP_WISE, "apply_overlong_filtering": True}), "apply_overlong_filtering"),
        ({"record_mirror_config": {"key": "k"}}, "skycap.record_mirror_config"),
        ({"severs": 2}, "skycap.severs"),
        ({"servers": 0}, "skycap.servers"),
        ({"servers": "http://one"}, "skycap.servers"),
        ({"servers": 2, "ray": False}, "skycap.servers"),
        ({"rows": "turn"}, "skycap.rows"),
        ({"placement": "RANDOM"}, "skycap.placement"),
        ({"cpus_per_server": 0}, "skycap.cpus_per_server"),
        ({"policy": {"truncation": "fold"}}, "skycap.policy"),
        ({"policy": {"max_len": 5}}, "skycap.policy"),
        ({"wandb": {"enabled": "yes"}}, "skycap.wandb.enabled"),
        ({"wandb": {"phases": "train"}}, "skycap.wandb.phases"),
        ({"wandb": {"project": "x"}}, "skycap.wandb.project"),
        ({"serve": {"upstream_url": "http://x"}}, "skycap.upstream_url"),
        ({"ray": "auto"}, "skycap.ray"),
    ],
)
def test_a_bad_setting_is_refused_naming_its_key(mapping: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        SkycapConfig.from_mapping(mapping)


@dataclass
class CallbackInput:
    """SkyRL's `CallbackInput`: the fields the callback reads."""

    global_step: int


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, Any, str]] = []

    def on_step_end(self, step: int, ids: Any, phase: str = "train") -> None:
        self.calls.append((step, ids, phase))


def test_the_callback_forwards_step_and_eval_ends_and_ignores_the_rest() -> None:
    recorder = Recorder()
    callback = SkycapCallback(recorder)  # type: ignore[arg-type]
    callback.on_train_start(None, CallbackInput(0), None)
    callback.on_step_end(None, CallbackInput(3), None)
    callback.on_log(None, CallbackInput(3), None)
    callback.on_eval_end(None, CallbackInput(3), None)
    assert recorder.calls == [(3, None, "train"), (3, None, "eval")]
    with pytest.raises(AttributeError):
        callback.missing  # noqa: B018


@dataclass
class GeneratorConfig:
    step_wise_trajectories: bool = True
    merge_stepwise_output: bool = False


@dataclass
class TrainConfig:
    """SkyRL's config is a dataclass; an integration adds its own `skycap` field."""

    generator: GeneratorConfig
    skycap: dict[str, Any]


def test_a_dataclass_config_reads_like_a_mapping() -> None:
    config = SkycapConfig.from_mapping(TrainConfig(GeneratorConfig(), {"rows": "path"}))
    assert config.rows == "path"
    with pytest.raises(ValueError, match="merge_stepwise_output"):
        SkycapConfig.from_mapping(TrainConfig(GeneratorConfig(True, True), {}))


def test_skyrl_sampling_params_become_openai_keywords() -> None:
    """SkyRL's vLLM-backend params (`get_vllm_sampling_params`): the Chat Completions ones as
    keywords, vLLM's own in extra_body, decoding and logprobs left to the server."""
    skyrl = {
        "min_tokens": 1,
        "skip_special_tokens": True,
        "include_stop_str_in_output": True,
        "max_tokens": 512,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.0,
        "logprobs": 0,
        "stop": None,
    }
    assert openai_sampling(skyrl) == {
        "max_tokens": 512,
        "temperature": 1.0,
        "top_p": 0.9,
        "extra_body": {"min_tokens": 1, "top_k": -1, "min_p": 0.0},
    }
    assert openai_sampling(None) == {}
