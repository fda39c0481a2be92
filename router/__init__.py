"""Router: the public `pagedserve.v1.Generation` service (built in the router issue).

Never imports torch; may import only `pagedserve.kvstore.hashing` / `prefix_index` below it.
"""
