"""Shared MoE runtime parts (design document, ``models/common/moe``): routed experts whose banks live in host
memory, served by a device expert cache, a CPU worker team, and whole layers streamed to the device."""
