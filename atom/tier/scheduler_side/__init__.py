"""The tier's scheduler side: its decisions, on the step thread (``planner.OffloadConnector``)."""
