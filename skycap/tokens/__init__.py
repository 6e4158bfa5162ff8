"""Token mode: render prompts, call the engine with exact token ids, commit the tokens it saw."""
