"""`skycap top`: polling servers (`poll`), tables fit to a terminal (`layout`), screens (`view`)."""
