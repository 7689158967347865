"""The sync engine, in layers that import only downward (see :mod:`.engine` for the API and the steps).

* pure, nothing communicates: :mod:`.record` (the record format), :mod:`.mismatch` (the errors every rank raises
  alike), :mod:`.plan` (the plan), :mod:`.pack` and :mod:`.unpack` (buffers), :mod:`.objects` (Python objects in
  list states), :mod:`.scalar_codec` (logged scalars' records);
* :mod:`.group`: the state each process group keeps, the policy, the settings;
* :mod:`.comm`: the one module that starts collectives, returning their handles;
* :mod:`.wait`: the one module that waits for them (timeouts, named errors, notes in the store, process exit);
* :mod:`.grad` and :mod:`.move`: the data step, differentiable or not;
* :mod:`.engine`: the API (``start``, ``Pending.finish``, ``sync``) and the orchestration;
* :mod:`.states`: metrics' states in, reduced states out;
* :mod:`.deferred`: the syncs ``compute_async()`` leaves pending, run by one worker thread on side groups.
"""
