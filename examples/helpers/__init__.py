"""Modules the example scripts import (the harness, the GRPO task); none of them runs on its own."""
