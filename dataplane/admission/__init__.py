"""Admission: whether and when a request goes on to a node. The stage (`admit`) takes a request
through its tenant's limits (`limits`, over the `quota` and the `tenants` of the config) and the
gateway's queue (`queue`), which admits by the one rule for a node's room that `occupancy`
asks; the `ticket` carries the request's admission to its settlement, with its tokens
(`tokens`) and the rewrites of its body (`bodies`)."""
