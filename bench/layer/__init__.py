"""One MoE layer's prefill (`bench moe`): the implementations side by side, the roofline, and the host's packing."""
