"""Tools around the layers: the ``waterwave`` command line (``cli``, with
``sim_commands``), the models it knows by name (``models``), its plots
(``plots``) and the demo ``make demo`` runs (``demo``).

May import: every other waterwave package.
"""
