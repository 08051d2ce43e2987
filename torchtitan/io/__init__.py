"""The I/O floor every other package stands on.

``storage`` (a path that may be a local file or an object in a store: read, publish
whole, conditional requests), ``claims`` (who holds a lease or a unit's measuring, and
the one liveness rule) and ``tensor_json`` (the project's own checkpoint entries as JSON
in a tensor, so loading them unpickles nothing).

Never: import anything of torchtitan above it (checkpoint, data, parallel, the loop).
"""
