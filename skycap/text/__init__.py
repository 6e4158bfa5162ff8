"""Text mode: forward calls to an OpenAI-compatible server and record what comes back."""
