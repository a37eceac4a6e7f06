"""What the model families share: config I/O and checks, preset helpers, pool-geometry pieces.

Only code whose rule is the same for every family lives here; a family keeps its own code
wherever its model differs, even where the lines look alike.
"""
