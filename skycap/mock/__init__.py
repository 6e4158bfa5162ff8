"""Scripted stand-ins for an OpenAI-compatible server and a vLLM engine, for the demo, tests and benchmarks."""
