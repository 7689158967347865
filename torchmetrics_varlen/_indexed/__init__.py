"""The parts of :class:`~torchmetrics_varlen.IndexedMetric`, one concern per module.

* :mod:`.arguments`: capture a call's arguments (per-sample tensors, per-call values), check they keep one layout;
* :mod:`.dedup`: order the gathered samples by dataset index and keep each index once, refusing likely mistakes;
* :mod:`.replay`: feed the ordered samples to a fresh copy of the wrapped metric, as one process would;
* :mod:`.routing`: send ``compute()`` through a one-rank gather when ``compute_on_rank`` is set.

``IndexedMetric`` itself (in :mod:`torchmetrics_varlen.indexed`) only owns the states and wires these together.
"""
