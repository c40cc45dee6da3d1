"""Helpers shared by tests (and by the scripts tests run in fresh processes): never a test module."""
