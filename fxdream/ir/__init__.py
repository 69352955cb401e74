"""The graph vocabulary every stage shares: node helpers, meta keys, tensors, aliasing, FLOPs.

The bottom layer: it imports torch only, never another fxdream package."""
