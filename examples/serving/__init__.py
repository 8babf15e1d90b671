"""A real disaggregated serving loop over transfer_engine: ``python -m examples.serving``.

Modules: ``model`` (the TP Llama-style decoder over the engine's paged pool), ``tp`` (process
groups and the leader's plans), ``server`` (a prefill or decode rank: engine, model and serving
loop), ``frontdoor`` (HTTP), ``client`` (workload replay), ``reference`` (the monolithic run),
``run`` (one command for everything, and the ``Cluster`` the tests use).
"""
