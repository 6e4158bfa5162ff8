"""`skycap.rollout`: the trainer-side rollout loop any harness plugs into (client side only).

    class MyAgent(RolloutRunner):
        async def run_rollout(self, prompt, *, base_url, api_key, sampling, env):
            ...  # run the agent against base_url, score it
            return Rollout(reward=1.0)

    runner = MyAgent(pool, concurrency=64, timeout=600, attempts=2)
    results = await runner.generate(prompts, repeats=8, step=step)
    runner.record_log  # every attempt opened, for step indexes

See docs/trainer.md.
"""

from skycap.rollout.log import AttemptRecord, RecordLog
from skycap.rollout.runner import STOP_REASONS, Rollout, RolloutResult, RolloutRunner

__all__ = [
    "STOP_REASONS",
    "AttemptRecord",
    "RecordLog",
    "Rollout",
    "RolloutResult",
    "RolloutRunner",
]
