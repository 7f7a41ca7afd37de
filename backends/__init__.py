"""Storage tiers, transports and registries behind :class:`paramstore.ParamStore`.

Installed as ``paramstore.backends``. A *tier* holds object bytes (``tiers/``); a *registry* holds
the metadata: versions, manifests, tags and the tensor index (``registries/``).
"""
