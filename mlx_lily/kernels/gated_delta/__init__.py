"""Gated DeltaNet kernels: ``recurrence`` (the ``gated_delta`` op, one
recurrent pass, or ``chunked`` for long prompts: prepare, state, output),
``rows`` (prompt rows of different lengths as one batch, each as alone),
``decode`` (one token's whole mixer step), ``conv`` (causal conv + SiLU +
q/k norm) and ``norm`` (the gated RMSNorm on the output); their ``.metal``
bodies beside them."""
