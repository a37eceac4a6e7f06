import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
