"""Benchmarks that run aggnet beside its peers (gloo, raw sockets, memory copy) in one run."""
