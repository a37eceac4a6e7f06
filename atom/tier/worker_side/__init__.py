"""The tier's worker side: the threads that move bytes, the LMCache client, engine-driven copies,
and the per-rank parts of tensor parallelism."""
