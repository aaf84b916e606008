"""Core storage, graph and transfer primitives: device descriptor, paged KV pools, StateImage storage, the
ForwardBatch geometry and its packing, exact-B decode graphs, the packed device->host readback."""
