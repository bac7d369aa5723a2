"""Integrations with other packages, each explicit: importing one changes nothing until its ``enable()``.

* :mod:`cache_dit_opd.integrations.cache_dit`: an installed cache-dit runs its kernels through the daemon.
"""
