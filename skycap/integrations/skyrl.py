"""`skycap.integrations.skyrl`: a SkyRL generator on skycap's rollout loop; a harness writes
`run_rollout` and nothing else.

    class MyAgent(SkycapGenerator, GeneratorInterface):
        async def run_rollout(self, prompt, *, base_url, api_key, sampling, env):
            ...  # prompt["messages"] is the conversation, the rest is env_extras
            return Rollout(reward=1.0)

    runtime = SkycapRuntime.start(SkycapConfig.from_mapping(cfg))
    generator = runtime.generator(MyAgent, concurrency=64, timeout=600)
    ...  # SkyRL calls `await generator.generate(input_batch)` each step
    runtime.stop()

Neither skyrl nor torch is imported here: the output is plain lists, its trajectory ids
SkyRL's `TrajectoryID` when skyrl imports (else a stand-in with the same fields). See
docs/skyrl.md.
"""

from __future__ import annotations

from typing import Any

from skycap.integrations.skyrl_config import SkycapConfig
from skycap.integrations.skyrl_generator import SkycapGenerator, openai_sampling
from skycap.integrations.skyrl_output import SkyRLTrajectoryID, trajectory_id_class
from skycap.integrations.skyrl_runtime import SkycapCallback, SkycapRuntime
from skycap.rollout import Rollout

__all__ = [
    "Rollout",
    "SkyRLTrajectoryID",
    "SkycapCallback",
    "SkycapConfig",
    "SkycapGenerator",
    "SkycapRuntime",
    "openai_sampling",
]


def __getattr__(name: str) -> Any:
    """`TrajectoryID`: skyrl's own class when skyrl imports, else the stand-in (looked up on
    first use, so importing this module never imports torch)."""
    if name == "TrajectoryID":
        return trajectory_id_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
