"""`skycap.integrations`: skycap wired to a trainer's own contract (client side only).

`skycap.integrations.skyrl` is a SkyRL generator on skycap's rollout loop; see docs/skyrl.md.
"""
