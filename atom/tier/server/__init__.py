"""The LMCache MP server: an owned one started, supervised and stopped; its L2; its module."""
