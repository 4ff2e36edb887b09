"""Tools around the layers: the ``waterwave`` command line (``cli``), the
models it knows by name (``models``) and its plots (``plots``).

May import: every other waterwave package.
"""
