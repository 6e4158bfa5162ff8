"""Scripted stand-ins for an OpenAI-compatible server and a vLLM engine (demo, tests, benches)."""
