"""The Dynamo door's parts: scoped whole-step capture (``scope``), graph surgery on Dynamo's
and AOTAutograd's graphs (``graphs``) and the per-graph gradient audit (``audit``). The backend
itself is :mod:`spmd_backend.backend`."""
