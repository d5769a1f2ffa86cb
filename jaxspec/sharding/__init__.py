"""Sharding and placement (logical-axis rules, meshes, placements). Not yet implemented: the
fused loop runs on the devices that hold the weights (see the sharding issue)."""
