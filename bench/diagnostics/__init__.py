"""Diagnostics: one question each, one command each
(``python3 -m bench.diagnostics.GROUP.NAME --help``), grouped by what they ask about:

* ``decode``: where a decode token's time goes (host, launches, kernels, graph);
* ``prefill``: a prompt chunk's kernels and memory;
* ``tuning``: the decode GEMV's launch choices and the bandwidth its reads reach;
* ``numerics``: which result differs run to run or from the fp32 oracle, and why.

bench/README.md lists each one and what it answers.
"""
