"""The LMCache MP tier: everything the tier is, and the only code that imports lmcache (lazily).

Three parts, after vLLM's v1 connector (``KVConnectorBase_V1``'s two roles):

``scheduler_side``  decisions, on the engine's step thread: lookup answers, load and save
                    plans, per-request tier state, deadlines (``OffloadConnector``, the
                    engine's ``Connector``). It answers with values and writes no engine state:
                    the engine scheduler publishes what a load filled and holds the leases.
``worker_side``     moving bytes: the lookup and transfer threads (lmcache's adapters), the
                    registration layout, engine-driven copies out of the server's L1, and the
                    per-rank parts of tensor parallelism.
``server``          the LMCache server itself: owned and supervised, its L2 adapters, the
                    module that runs inside it (``atom.locate``), its clear request.

``attach.LMCacheTier`` wires the three to one engine; ``config``, ``policy``, ``operations``
and ``tier_metrics`` are shared by them.
"""
