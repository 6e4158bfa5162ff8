"""skycap: capture what an LLM policy saw and sampled, as training data."""
