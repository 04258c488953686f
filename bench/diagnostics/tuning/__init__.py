"""Tuning diagnostics: the decode GEMV's launch choices and the bandwidth its weight reads reach."""
