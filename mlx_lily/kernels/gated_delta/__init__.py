"""Gated DeltaNet kernels: ``recurrence`` (the ``gated_delta`` op, one
recurrent pass, or ``chunked`` for long prompts: prepare, state, output),
``decode`` (one token's whole mixer step), ``conv`` (causal conv + SiLU +
q/k norm) and ``norm`` (the gated RMSNorm on the output); their ``.metal``
bodies beside them."""
