"""The capture server: mitmproxy addon, control and harness routes, lifecycle and options."""
