"""Graph layer: op predicates, node metadata, graph utilities.

The lowest layer of spmd_backend: it imports only torch and the error hierarchy. Everything that
asks "what kind of node is this?" goes through :mod:`spmd_backend.graph.ops`.
"""
