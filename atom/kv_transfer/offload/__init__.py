"""The LMCache MP tier: config, server, worker, transfers, scheduler hooks."""
