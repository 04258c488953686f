"""Decode diagnostics: where a decode token's time goes (the host's graph building,
launches, each kernel's device time, the decode attention's split)."""
