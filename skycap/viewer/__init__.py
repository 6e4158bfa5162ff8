"""The record viewer: derived values, health flags, groups, validation and a read-only web app."""
