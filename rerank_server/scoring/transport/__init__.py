"""How scorers reach backends: the client of one instance, the lean HTTP/1.1 transport, the
pool of instances, and the failures scorers see.
"""
