"""Putting aggregators where a topology file says: ``aggnet up`` and
``aggnet down``, their state on this machine, and the P4 jobs they
install on switches."""
